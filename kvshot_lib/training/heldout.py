"""Per-step held-out accuracy of a drafter: does draft step ``k`` hit the target's own next token?

On the held-out slice every branch ``i`` is unrolled ``K`` steps on the ground-truth tokens (as in
training), and step ``k``'s draft argmax, mapped back to a target id, is compared with the target's argmax
over its *full* vocabulary at position ``i+1+k``. So the accuracy counts a miss whenever the target's
choice lies outside the draft vocabulary; ``ceiling`` is the share of positions where it lies inside.
Only branches whose predicted token is an assistant token count. This is acc_k of EAGLE's training logs,
a proxy for the conditional acceptance α_k that the decoding notebooks measure.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import load_file, save_file

from ..drafters.trainable import TrainableDrafter
from ..drafters.unroll import TrainBatch, shifted
from ..target import Target, assets
from .batches import collate, store_fields
from .losses import at_rows, sample_branches, step_mask, target_probs
from .stretches import MACHINE_COLS, by_stretch, known_machines, row_machine, stretches


@dataclass
class EvalSet:
    batches: list[TrainBatch]
    target_argmax: list[torch.Tensor]  # per batch [B, T] the target's greedy next token (full vocabulary)

    @classmethod
    def build(
        cls, store, cfg, target: Target, n_sequences: int, batch_size: int, max_tokens: int | None = None
    ) -> EvalSet:
        """The first ``n_sequences`` sequences of ``store``; the target's argmax is cached on disk."""
        n = min(n_sequences, len(store))
        fields = store_fields(cfg)
        seqs = [store.sequence(i, fields) for i in range(n)]
        argmax = greedy_targets(store, target, n)
        batches, tops = [], []
        for a in range(0, n, batch_size):
            part = seqs[a : a + batch_size]
            batch = collate(part, cfg, max_tokens)
            top = torch.zeros_like(batch.ids)  # [B, T]
            for j, length in enumerate(batch.lengths.tolist()):
                top[j, :length] = argmax[a + j][:length]
            batches.append(batch)
            tops.append(top)
        return cls(batches, tops)


def greedy_targets(store, target: Target, n: int) -> list[torch.Tensor]:
    key = json.dumps([store.manifest.get("content_hash"), str(store.path), n, target.info.fingerprint])
    path = (
        assets.cache_dir()
        / "target_argmax"
        / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".safetensors")
    )
    if path.is_file():
        t = load_file(str(path))
        return [t[str(i)] for i in range(n)]
    head = target.model.lm_head.weight.detach()
    out = {}
    with torch.no_grad():
        for i in range(n):
            fh = store.sequence(i, ["final_hidden"])["final_hidden"].to(head.device, head.dtype)  # [T, H]
            out[str(i)] = torch.cat([(c @ head.T).argmax(-1).cpu() for c in fh.split(256)])  # [T]
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path.with_suffix(".tmp")))
    path.with_suffix(".tmp").rename(path)
    return [out[str(i)] for i in range(n)]


@dataclass
class BranchOutcome:
    """Draft step ``k`` of every counted branch of one held-out batch: what the drafter guessed and what the target
    wanted, one entry per branch (``M`` of them) whose predicted token is an assistant token."""

    batch_index: int
    k: int
    sequence: torch.Tensor  # [M] the branch's sequence within its batch
    token: torch.Tensor  # [M] the index of the predicted token in its sequence (branch i, step k: i + 2 + k)
    guess: torch.Tensor  # [M] the drafter's argmax, as a target id
    want: torch.Tensor  # [M] the target's full-vocabulary argmax
    cross_entropy: torch.Tensor  # [M] against the target's distribution over the draft vocabulary


@torch.no_grad()
def branch_outcomes(drafter: TrainableDrafter, evals: EvalSet, n_steps: int, branch_fraction: float = 1.0):
    """Yield a :class:`BranchOutcome` per batch and draft step: each branch unrolled ``n_steps`` on the
    ground-truth tokens, as in training. What :func:`evaluate_per_step` sums, and what the diagnostics break
    down by answer position or the target's confidence."""
    dev = drafter.head.device
    for b_i, (batch, top) in enumerate(zip(evals.batches, evals.target_argmax)):
        batch, top = batch.to(dev), top.to(dev)
        B, N = batch.ids.shape[0], batch.ids.shape[1] - 1
        picked = _on(sample_branches(N, branch_fraction, seed=b_i), dev)
        un = drafter(batch, n_steps, branches=picked)
        probs = target_probs(batch.final_hidden, drafter.head)  # [B, T, V_draft]
        seq = torch.arange(B, device=dev)[:, None].expand(B, N)  # [B, N]
        branch = torch.arange(N, device=dev)[None].expand(B, N)  # [B, N]
        for k, (h, rows) in enumerate(zip(un.outs, un.rows)):
            mask = at_rows(step_mask(batch, k), rows)  # [B, n]
            logits = drafter.logits(h[mask])  # [M, V_draft]
            soft = at_rows(shifted(probs, 1 + k, N), rows)[mask]  # [M, V_draft]
            yield BranchOutcome(
                b_i,
                k,
                at_rows(seq, rows)[mask],
                at_rows(branch, rows)[mask] + 2 + k,
                drafter.d2t[logits.argmax(-1)],
                at_rows(shifted(top, 1 + k, N), rows)[mask],
                -(soft * torch.log_softmax(logits.float(), -1)).sum(-1),
            )


@torch.no_grad()
def evaluate_per_step(
    drafter: TrainableDrafter, evals: EvalSet, n_steps: int, accelerator=None, branch_fraction: float = 1.0
) -> dict:
    """``acc_k`` (vs the target's full-vocabulary argmax), ``ce_k`` with its per-token spread ``ce_sd_k``, and
    ``n_k`` for k < n_steps, and ``ceiling``.

    ``branch_fraction < 1`` evaluates steps >= 1 on a fixed random subset of branches (step 0 on all).
    """
    dev = drafter.head.device
    hit = torch.zeros(n_steps, dtype=torch.float64)
    ce = torch.zeros(n_steps, dtype=torch.float64)
    ce_sq = torch.zeros(n_steps, dtype=torch.float64)  # for the per-token spread, ce_sd_k
    cnt = torch.zeros(n_steps, dtype=torch.float64)
    inside = torch.zeros(2, dtype=torch.float64)
    in_vocab = torch.zeros(drafter.cfg.target_vocab_size, dtype=torch.bool, device=dev)
    in_vocab[drafter.d2t] = True
    for o in branch_outcomes(drafter, evals, n_steps, branch_fraction):
        k, m = o.k, float(o.want.numel())
        hit[k] += float((o.guess == o.want).sum())
        ce[k] += float(o.cross_entropy.sum())
        ce_sq[k] += float(o.cross_entropy.double().square().sum())
        cnt[k] += m
        if k == 0:
            inside += torch.tensor([float(in_vocab[o.want].sum()), m], dtype=torch.float64)
    if accelerator is not None and accelerator.num_processes > 1:
        stacked = accelerator.reduce(
            torch.cat([hit, ce, ce_sq, cnt, inside]).to(accelerator.device), "sum"
        ).cpu()
        hit, ce, ce_sq, cnt, inside = stacked.split([n_steps, n_steps, n_steps, n_steps, 2])
    drafted = getattr(drafter, "max_steps", n_steps)  # a block drafter drafts at most its block: NaN past it
    out = {
        f"acc_{k}": float(hit[k] / max(cnt[k], 1)) if k < drafted else float("nan") for k in range(n_steps)
    }
    out.update(
        {f"ce_{k}": float(ce[k] / max(cnt[k], 1)) if k < drafted else float("nan") for k in range(n_steps)}
    )
    mean, n = ce / cnt.clamp(min=1), cnt.clamp(min=1)
    sd = (ce_sq / n - mean.square()).clamp(min=0).sqrt()  # [n_steps] per-token spread of the cross-entropy
    out.update({f"ce_sd_{k}": float(sd[k]) if k < drafted else float("nan") for k in range(n_steps)})
    out.update({f"n_{k}": int(cnt[k]) for k in range(n_steps)})
    out["ceiling"] = float(inside[0] / max(inside[1], 1))
    return out


def _on(x, dev):
    return None if x is None else x.to(dev)


def gate_summary(drafter: TrainableDrafter) -> dict:
    """Mean, spread and quantiles of the hybrid gate's last values (empty for other drafters)."""
    if not hasattr(drafter, "gate_values"):
        return {}
    vals = drafter.gate_values()
    if not vals:
        return {}
    g = torch.cat([v.flatten().float() for v in vals])
    q = torch.quantile(
        g[:: max(1, g.numel() // 100000)], torch.tensor([0.1, 0.5, 0.9], device=g.device)
    ).tolist()
    return dict(
        gate_mean=float(g.mean()), gate_std=float(g.std()), gate_p10=q[0], gate_p50=q[1], gate_p90=q[2]
    )


def per_step_table(results) -> pd.DataFrame:
    """Final held-out per-step accuracy of finished runs: one row per (drafter, draft step)."""
    rows = []
    for r in results:
        final = r.final_eval()
        c = r.config
        steps = sorted(int(k[4:]) for k in final if k.startswith("acc_"))
        for k in steps:
            rows.append(
                dict(
                    drafter=c.name,
                    paradigm=c.paradigm,
                    regime=c.regime,
                    target_kv=c.target_kv,
                    kv_mode=c.kv_mode,
                    n_layers=c.n_layers,
                    draft_step=k,
                    accuracy=final[f"acc_{k}"],
                    ce=final[f"ce_{k}"],
                    n=final[f"n_{k}"],
                    ceiling=final.get("ceiling"),
                    **machine_of(r),
                )
            )
    return pd.DataFrame(rows)


def machine_of(result) -> dict:
    """The precision, device, CPU model and bf16 ISA a finished run trained with (target/precision.py)."""
    return dict(result.drafter.cfg.extra.get("machine", {}))


def run_stretches(result) -> pd.DataFrame | None:
    """A run resumed from a carried position on other machines: its stretches, each with its machine
    (:mod:`.stretches`; a stretch its logs do not name takes it from ``result.known_stretches``, or stays
    unnamed). None for a run with no restart."""
    if not result.logs.get("restarts"):
        return None
    here = {k: v for k, v in machine_of(result).items() if k in MACHINE_COLS}
    progress = pd.DataFrame(stretches(result.logs, here)).assign(drafter=result.config.name)
    if result.known_stretches is not None:
        progress = known_machines(progress, result.known_stretches)
    return progress


def run_machine(result) -> dict:
    """:func:`machine_of`, with the precision, CPU and bf16 ISA of every stretch (``bf16+fp32``) where the run
    went on from a carried position on other machines: not the last machine's alone."""
    progress = run_stretches(result)
    return machine_of(result) | (row_machine(progress) if progress is not None else {})


def training_times(results) -> pd.DataFrame:
    """Wall-clock training time and throughput of finished runs."""
    rows = []
    for r in results:
        tokens = sum(h["tokens"] for h in r.logs.get("history", []))
        rows.append(
            dict(
                drafter=r.config.name,
                paradigm=r.config.paradigm,
                regime=r.config.regime,
                train_steps=r.config.train_steps,
                train_tokens=tokens,
                seconds=round(r.train_seconds, 1),
                tokens_per_second=round(tokens / max(r.train_seconds, 1e-9), 1),
                **run_machine(r),
            )
        )
    return pd.DataFrame(rows)


def budget_note(results_dir, drafters=None) -> str:
    """The caption words that say a run's drafters are budget-limited: the training tokens each one saw
    (from ``training_times.csv``, which notebook 02 writes), against the ~10^8 of published recipes. Where the
    table has ``unique_tokens`` (the reference run's), the token-passes, the unique tokens and the precision.
    ``drafters``: the names a figure shows (notebook 04 measures only the KV readers), so that its caption
    gives their budgets, not the run's whole range; None, or names the table lacks, keep every row. Names
    ``<row>@<run>`` (another run's committed checkpoints, measured beside this run's) are said apart."""
    others = sorted({d.split("@", 1)[1] for d in drafters or () if "@" in d})
    beside = "".join(f"; <row>@{run}: the {run} run's committed checkpoints, trained there" for run in others)
    path = Path(results_dir) / "training_times.csv"
    if not path.is_file():
        return "drafters: none trained in this run" + beside
    times = pd.read_csv(path)
    shown = times[times["drafter"].isin(list(drafters))] if drafters is not None else times
    if shown.empty and others:  # only other runs' checkpoints are shown
        return beside.removeprefix("; ")
    times = shown if len(shown) else times
    tokens = times["train_tokens"]
    lo, hi = tokens.min() / 1e6, tokens.max() / 1e6
    seen = f"{lo:.2f}M" if round(lo, 2) == round(hi, 2) else f"{lo:.2f}M–{hi:.2f}M"
    if "unique_tokens" in times and times["unique_tokens"].notna().any():  # the reference run says both
        unique = times["unique_tokens"].max() / 1e6
        note = f"{seen} token-passes per drafter over {unique:.2f}M unique tokens (published recipes: ~100M+)"
    else:
        note = f"budget-limited: each drafter trained on {seen} tokens (published recipes: ~100M+)"
    if "precision" in times:  # where it trained, so that an AMX number is never read as another CPU's
        where = times[["precision", "cpu", "bf16_isa"]].drop_duplicates().astype(str)
        note += "; trained in " + ", ".join(f"{p} on {c} ({i})" for p, c, i in where.itertuples(index=False))
    return note + beside


def combined_table(results, name: str) -> pd.DataFrame:
    """One log table (``history``, ``eval``, ``grad_probes``, ...) of several runs, stacked, each row with the
    machine that ran its step (:func:`run_stretches`; a curve point's is its branch's, ``budget_step``)."""
    frames = []
    for r in (r for r in results if r.logs.get(name)):
        df = r.table(name).assign(
            drafter=r.config.name,
            paradigm=r.config.paradigm,
            regime=r.config.regime,
            target_kv=r.config.target_kv,
            **{k: v for k, v in machine_of(r).items() if k in MACHINE_COLS},
        )
        progress, step = run_stretches(r), "budget_step" if "budget_step" in df else "step"
        frames.append(by_stretch(df, progress, step) if progress is not None and step in df else df)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
