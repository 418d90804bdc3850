"""How close SpecPV stays to lossless decoding: the fidelity sweep over budget × ``full_every`` at temperature 0.

Per generation, against plain greedy decoding of the same prompt (the lossless output):

* **exact match** (the whole output equal) and the **first divergence** (index of the first differing
  token; the output length when none);
* **ROUGE-L** F1 of the decoded text against the lossless text, as SpecPV reports it (longest common
  subsequence over lower-cased whitespace tokens, F1 = 2PR / (P + R));

and teacher-forced along SpecPV's own output, at every partial verification (:class:`FidelityProbe`): the
same block (pending tokens, root, drafts) is also run against the exact full cache (a *shadow* full
verification, rolled back after), and for each committed row (the root and the accepted drafts):

* **top-1 agreement** of the partial and full logits, and **KL(full ‖ partial)** of their softmaxes;
* the **cosine** of the two last hidden states, by the row's **distance** since the last full pass
  (its position minus the full cache's length).

The probe's forward is not timed: fidelity runs are separate from the speed runs.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..decoding.config import DecodeConfig
from ..decoding.cycle import Prefill
from ..decoding.engine import autoregressive_generate
from ..decoding.specpv import PartialStep, SpecPVConfig, full_block, specpv_generate
from ..target.forward import cache_length, crop, forward
from . import metrics


def first_divergence(tokens: list[int], reference: list[int]) -> int:
    """Index of the first token where ``tokens`` and ``reference`` differ; the shorter length if one is a
    prefix of the other, and the length when they are equal."""
    return next(
        (i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference))
    )


def rouge_l(hypothesis: str, reference: str) -> float:
    """ROUGE-L F1 over lower-cased whitespace tokens (longest common subsequence)."""
    h, r = hypothesis.lower().split(), reference.lower().split()
    if not h or not r:
        return float(h == r)
    prev = [0] * (len(r) + 1)
    for a in h:
        cur = [0]
        for j, b in enumerate(r):
            cur.append(prev[j] + 1 if a == b else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, rec = lcs / len(h), lcs / len(r)
    return 2 * p * rec / (p + rec)


@torch.inference_mode()
def shadow_full(step: PartialStep) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[N+1, V]`` and last hidden states ``[N+1, H]`` of the root and drafts of ``step`` verified
    against the exact full cache (pending tokens re-fed), then the full cache cut back to ``step.F``."""
    model, cache = step.model, step.full_cache
    n_rows = len(step.tree) + 1
    pending_and_root = step.ids[:, : step.ids.shape[1] - len(step.tree)]
    ids, positions, mask = full_block(step.F, pending_and_root, step.tree, step.logits.dtype, step.ids.device)
    out = forward(model, ids, cache, positions, mask, hidden_states=True)
    crop(cache, cache_length(cache) - ids.shape[1])
    return out.logits[0, -n_rows:], out.hidden_states[-1][0, -n_rows:]


class FidelityProbe:
    """Called after every partial verification: one row per committed row of the block (root, accepted
    drafts) with its distance since the last full pass, top-1 agreement, KL(full ‖ partial), cosine."""

    def __init__(self):
        self.rows: list[dict] = []

    def __call__(self, step: PartialStep) -> None:
        full_logits, full_hidden = shadow_full(step)
        keep = [0, *(i + 1 for i in step.path)]
        root_pos = step.F + step.ids.shape[1] - len(step.tree) - 1
        depths = [0, *(step.tree.depths[i] + 1 for i in step.path)]
        lp = F.log_softmax(step.logits[keep].float(), -1)  # [n, V] partial
        lf = F.log_softmax(full_logits[keep].float(), -1)  # [n, V] full
        kl = (lf.exp() * (lf - lp)).sum(-1)  # [n]
        cos = F.cosine_similarity(step.hidden[keep].float(), full_hidden[keep].float(), dim=-1)  # [n]
        agree = lp.argmax(-1) == lf.argmax(-1)  # [n]
        for r, d in enumerate(depths):
            self.rows.append(
                dict(
                    distance=root_pos + d - step.F,
                    top1_agree=bool(agree[r]),
                    kl=float(kl[r].clamp(min=0)),
                    cosine=float(cos[r]),
                )
            )


def run_fidelity(
    target,
    drafter,
    prompts: dict[int, list[list[int]]],
    cfg: DecodeConfig,
    budgets,
    full_everys,
    variants=("specpv",),
    base: SpecPVConfig | None = None,
    progress: bool = True,
    prefills: dict | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Greedy SpecPV on every prompt (``{context length: [prompt ids]}``) for every budget × full_every × variant
    (the tables keep the variant in their ``mode`` column),
    against plain greedy decoding. Returns the per-generation table and the per-row probe table.
    ``prefills``: a dict shared with :func:`~.specpv_speed.run_speed` to prefill each prompt once."""
    cfg = replace(cfg, temperature=0.0).validate()
    base = base or SpecPVConfig()
    tok = target.tokenizer
    layers = tuple(drafter.new_session().hidden_layers) if drafter is not None else ()
    runs, steps = [], []
    grid = [(b, p, v) for b in budgets for p in full_everys for v in variants]
    todo = [(ctx, i, ids) for ctx, group in prompts.items() for i, ids in enumerate(group)]
    for ctx, i, ids in tqdm(todo, desc="SpecPV fidelity", disable=not progress):
        pre = Prefill.run(target, ids, layers, store=prefills)
        reference = autoregressive_generate(target, ids, replace(cfg, mode="ar"), prefill=pre).token_ids
        ref_text = tok.decode(reference, skip_special_tokens=True)
        for budget, full_every, variant in grid:
            pv = replace(base, budget=budget, full_every=full_every, strict=variant == "strict").validate()
            probe = FidelityProbe()
            out = specpv_generate(target, drafter, ids, cfg, pv, on_partial=probe, prefill=pre)
            key = dict(context=ctx, prompt=i, budget=budget, full_every=full_every, mode=variant)
            steps += [{**key, **row} for row in probe.rows]
            agree = [r["top1_agree"] for r in probe.rows]
            runs.append(
                {
                    **key,
                    "n_tokens": len(out.token_ids),
                    "exact_match": out.token_ids == reference,
                    "first_divergence": first_divergence(out.token_ids, reference),
                    "rouge_l": rouge_l(tok.decode(out.token_ids, skip_special_tokens=True), ref_text),
                    "top1_agreement": sum(agree) / len(agree) if agree else math.nan,
                    "kl_mean": sum(r["kl"] for r in probe.rows) / len(agree) if agree else math.nan,
                    "n_partial": out.n_partial,
                    "n_full": out.n_full,
                    "n_rollbacks": len(out.rollbacks),
                    "rollback_tokens": sum(out.rollbacks),
                    **mat_by_kind(out.accepted_per_cycle, out.cycle_kind),
                }
            )
        del pre
    return pd.DataFrame(runs), pd.DataFrame(steps)


def mat_by_kind(accepted_per_cycle: list[int], cycle_kind: list[str]) -> dict:
    """MAT (bonus token counted) over partial and over full verification cycles, and their counts."""
    res = {}
    for kind in ("partial", "full"):
        acc = [a for a, k in zip(accepted_per_cycle, cycle_kind) if k == kind]
        res[f"mat_{kind}"] = metrics.mean_accepted_tokens(acc) if acc else math.nan
        res[f"cycles_{kind}"] = len(acc)
    return res


def fidelity_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Mean over prompts per context × budget × full_every × variant (column ``mode``)."""
    keys = ["context", "budget", "full_every", "mode"]
    cols = [
        "exact_match",
        "first_divergence",
        "top1_agreement",
        "kl_mean",
        "rouge_l",
        "n_rollbacks",
        "rollback_tokens",
    ]
    out = runs.groupby(keys, as_index=False)[cols].mean()
    out["n_prompts"] = runs.groupby(keys).size().values
    return out
