"""Why a drafter accepts less on MT-bench than its held-out accuracy promises: the gap, split into its causes.

Held-out acc_0 is teacher-forced accuracy over every answer token of held-out conversations; MT-bench chain
alpha_0 is the acceptance of the first draft of each decoding cycle on 64-token answers to new prompts. Between
the two lie three differences, measured one at a time with the same drafter and the same rule (the drafter's
argmax against the target's full-vocabulary argmax, :func:`kvshot_lib.training.branch_outcomes`):

1. **answer position**: held-out acc_0 over whole answers, minus the same over each answer's first
   ``first_tokens`` tokens (MT-bench answers are that short);
2. **prompt distribution**: that, minus teacher-forced acc_0 on the MT-bench greedy references;
3. **cycle weighting**: that, minus chain alpha_0. A cycle's first draft predicts the token after a rejection
   and a bonus token, not a uniformly drawn one. Split again into *selection*, teacher-forced acc_0 at the
   positions where cycles start minus acc_0 everywhere, and a *residual*, alpha_0 minus teacher-forced acc_0
   at those positions, which should be ~0 in float32, since a cycle's first draft sees what teacher forcing sees.

The three sum to the whole gap. :func:`gap_table` gives them with bootstrap intervals over conversations and
MT-bench turns. :func:`outcome_rows` keeps every branch, so :func:`binned_accuracy` can break accuracy down by
answer position, by turn and by the target's top-1 probability. ``tests/test_mtbench_gap.py`` checks the
pieces on hand-made cases.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd
import torch

from ..corpus.sharegpt import TokenizedSplit
from ..decoding.config import GenerationResult
from ..evaluation.acceptance import Reference
from ..training import EvalSet, answer_positions, branch_outcomes

POSITION_BINS = (0, 16, 32, 64, 10**9)  # answer position of the predicted token: 0-15, 16-31, 32-63, 64+
P1_BINS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0 + 1e-9)  # the target's top-1 probability at the predicted token


def reference_split(refs: list[Reference], answer_lengths: list[int] | None = None) -> TokenizedSplit:
    """MT-bench greedy references as conversations: prompt + answer, the loss mask on the answer, cut at
    ``answer_lengths[i]`` tokens (the generation's own length: it ends at its stop token)."""
    ids, masks = [], []
    for i, r in enumerate(refs):
        answer = r.greedy_ids[: answer_lengths[i]] if answer_lengths else r.greedy_ids
        ids.append(torch.tensor(r.prompt_ids + answer))  # [T]
        masks.append(torch.tensor([False] * len(r.prompt_ids) + [True] * len(answer)))  # [T]
    digest = hashlib.sha256(b"".join(x.numpy().tobytes() for x in ids)).hexdigest()[:16]
    spec = dict(source="mtbench greedy references", n=len(refs), content=digest)
    return TokenizedSplit(ids, masks, [f"{r.question_id}-{r.turn}" for r in refs], spec)


def cycle_start_positions(result: GenerationResult) -> list[int]:
    """The answer position each cycle's first draft predicts: the target's prefill gives answer token 0, the
    first cycle drafts token 1, and a cycle that accepts ``a`` drafts moves the next start by ``a + 1``."""
    starts, s = [], 1
    for a in result.accepted_per_cycle:
        if s < len(result.token_ids):
            starts.append(s)
        s += a + 1
    return starts


@torch.no_grad()
def outcome_rows(
    drafter, evals: EvalSet, split: TokenizedSplit, lm_head: torch.Tensor, n_steps: int, batch_size: int
) -> pd.DataFrame:
    """One row per evaluated branch and draft step: ``sequence`` (index into ``split``), ``k``, ``answer_pos`` of
    the predicted token, ``hit``, ``ce`` and the target's top-1 probability ``p1`` there, over its full
    vocabulary."""
    parts, tops = [], {}
    positions = [answer_positions(m) for m in split.loss_mask]  # each [T]
    for o in branch_outcomes(drafter, evals, n_steps):
        if o.batch_index not in tops:  # the target's confidence at every position of the batch
            fh = evals.batches[o.batch_index].final_hidden.float()  # [B, T, H]
            p = torch.softmax(fh @ lm_head.float().T.to(fh.device), -1).amax(-1)  # [B, T]
            tops = {o.batch_index: p.cpu()}
        p1 = tops[o.batch_index]
        seq, tok = o.sequence.cpu(), o.token.cpu()
        first = o.batch_index * batch_size
        apos = torch.tensor(
            [int(positions[first + int(s)][int(t)]) for s, t in zip(seq, tok)], dtype=torch.long
        )
        conf = p1[seq, tok - 1]  # [M] the distribution that predicts token t
        parts.append(
            pd.DataFrame(
                dict(
                    sequence=(seq + first).numpy(),
                    k=o.k,
                    answer_pos=apos.numpy(),
                    hit=(o.guess == o.want).cpu().numpy(),
                    ce=o.cross_entropy.cpu().numpy(),
                    p1=conf.numpy(),
                )
            )
        )
    return pd.concat(parts, ignore_index=True)


def binned_accuracy(rows: pd.DataFrame, by: str) -> pd.DataFrame:
    """Accuracy (and count) per ``set``, ``drafter``, ``k`` and bin of ``by``: ``answer_pos`` (POSITION_BINS),
    ``p1`` (P1_BINS) or ``turn``; ``share`` is the bin's part of its set's branches at that step."""
    edges = {"answer_pos": POSITION_BINS, "p1": P1_BINS}.get(by)
    b = pd.cut(rows[by], list(edges), right=False).astype(str) if edges else rows[by].astype(str)
    keys = ["set", "drafter", "k"]
    g = rows.assign(bin=b).groupby([*keys, "bin"], observed=True)["hit"].agg(["mean", "size"]).reset_index()
    g = g.rename(columns={"mean": "accuracy", "size": "n"})
    g["share"] = g["n"] / g.groupby(keys)["n"].transform("sum")
    return g.assign(by=by)


def _per_unit(rows: pd.DataFrame) -> pd.DataFrame:
    """Hits and counts per sequence (the bootstrap's unit) for each measure the gap needs."""
    return rows.groupby("sequence")["hit"].agg(["sum", "size"])


def gap_table(
    held: pd.DataFrame,
    mtbench: pd.DataFrame,
    starts: dict[int, list[int]],
    alpha0: tuple[int, int],
    first_tokens: int = 64,
    n_boot: int = 1000,
    seed: int = 0,
) -> pd.DataFrame:
    """The gap from held-out acc_0 to MT-bench chain alpha_0 for one drafter, step 0 rows only: ``held`` and
    ``mtbench`` from :func:`outcome_rows`, ``starts`` each MT-bench sequence's cycle-start answer positions,
    ``alpha0`` its (accepted, attempted) first drafts. One row per measure and component, with 95% bootstrap
    intervals over held-out conversations and MT-bench turns (resampled independently)."""
    h0, m0 = held[held["k"] == 0], mtbench[mtbench["k"] == 0]
    start_sets = {seq: set(pos) for seq, pos in starts.items()}
    at_start = m0[[p in start_sets.get(s, ()) for s, p in zip(m0["sequence"], m0["answer_pos"])]]
    units = dict(
        heldout=_per_unit(h0),
        heldout_first=_per_unit(h0[h0["answer_pos"] < first_tokens]),
        mtbench_tf=_per_unit(m0),
        mtbench_tf_starts=_per_unit(at_start),
    )
    # alpha_0 comes in total only, so the bootstrap holds it fixed; each replicate resamples held-out conversations
    # and MT-bench turns, the same turns for every MT-bench measure
    rng = np.random.default_rng(seed)
    h_seqs, m_seqs = units["heldout"].index.to_numpy(), units["mtbench_tf"].index.to_numpy()

    def measures(h_pick, m_pick) -> dict:
        def rate(name, pick):
            u = units[name].reindex(pick).dropna()
            return float(u["sum"].sum() / max(u["size"].sum(), 1))

        return dict(
            heldout=rate("heldout", h_pick),
            heldout_first=rate("heldout_first", h_pick),
            mtbench_tf=rate("mtbench_tf", m_pick),
            mtbench_tf_starts=rate("mtbench_tf_starts", m_pick),
        )

    point = measures(h_seqs, m_seqs)
    point["alpha_0"] = alpha0[0] / max(alpha0[1], 1)
    boots = [
        measures(rng.choice(h_seqs, len(h_seqs)), rng.choice(m_seqs, len(m_seqs))) for _ in range(n_boot)
    ]
    boot = pd.DataFrame(boots).assign(alpha_0=point["alpha_0"])

    def components(m) -> dict:
        return dict(
            answer_position=m["heldout"] - m["heldout_first"],
            prompt_distribution=m["heldout_first"] - m["mtbench_tf"],
            cycle_selection=m["mtbench_tf"] - m["mtbench_tf_starts"],
            cycle_residual=m["mtbench_tf_starts"] - m["alpha_0"],
            total=m["heldout"] - m["alpha_0"],
        )

    comp_point, comp_boot = components(point), pd.DataFrame([components(r) for r in boot.to_dict("records")])
    rows = [
        dict(kind="measure", name=k, value=v, lo=boot[k].quantile(0.025), hi=boot[k].quantile(0.975))
        for k, v in point.items()
    ]
    rows += [
        dict(
            kind="component",
            name=k,
            value=v,
            lo=comp_boot[k].quantile(0.025),
            hi=comp_boot[k].quantile(0.975),
        )
        for k, v in comp_point.items()
    ]
    n = dict(
        heldout=len(h0), heldout_first=int(units["heldout_first"]["size"].sum()), mtbench_tf=len(m0),
        mtbench_tf_starts=int(units["mtbench_tf_starts"]["size"].sum()), alpha_0=alpha0[1],
    )  # fmt: skip
    return pd.DataFrame(rows).assign(n=[n.get(r["name"]) for r in rows])
