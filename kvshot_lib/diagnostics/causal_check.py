"""Is query error the bottleneck? Replace the drafter's query by ``(1-λ) q̂ + λ q*`` and measure α_k.

At decode time a hook on the drafter (:func:`~.drafter_hooks.drafter_queries` with ``replace``) mixes every
target-reading query with the target's own post-RoPE query at the same position, for the target (layer,
head) the drafter head stands for (:func:`~.drafter_hooks.head_map`; with one drafter query per GQA group,
the group's head it matches best, ``matched`` in the ``by_head`` table). λ = 0 is the drafter itself, λ = 1
gives it the target's exact attention over the reused cache. α_k is then measured on MT-bench by the exact
greedy replay of :mod:`kvshot_lib.evaluation.acceptance` in chain mode; the target's queries come from one
forward over the prompt and its greedy answer, so at step k they are the ground truth exactly when steps
0..k-1 were accepted, which is when step k counts towards α_k.

Only head concatenation has a drafter query in the target's key space to mix (:func:`query_in_key_space`);
other injection modes are reported as skipped.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..decoding import DecodeConfig
from ..evaluation import acceptance, metrics
from ..evaluation.acceptance import Reference
from ..evaluation.bootstrap import ratio_ci
from ..target import capture
from .drafter_hooks import drafter_queries


def sequence_id(ref: Reference) -> str:
    return f"q{ref.question_id}-t{ref.turn + 1}"


def substitutes(drafter, by_head: pd.DataFrame) -> dict[tuple[int, int], tuple[int, int]]:
    """``{(drafter layer, drafter head): (target layer, target head)}`` from the ``matched`` rows of ``by_head``."""
    rows = by_head[
        (by_head["drafter"] == drafter.name)
        & by_head["matched"]
        & (by_head["estimator"] == "drafter")
        & (by_head["variant"] == "with_sink")
    ].drop_duplicates(["drafter_layer", "drafter_head"])
    return {
        (int(r.drafter_layer), int(r.drafter_head)): (int(r.layer), int(r.head)) for r in rows.itertuples()
    }


def mixing_hook(queries: dict[int, torch.Tensor], subs: dict, lam: float):
    """``replace`` for :func:`drafter_queries`: ``q <- (1-λ) q + λ q*`` head by head (``queries[layer] [H, T, D]``)."""

    def replace(li: int, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if lam == 0:
            return q
        out = q.clone()
        pos = positions.cpu().clamp(
            max=next(iter(queries.values())).shape[1] - 1
        )  # training pads past the end
        for a in range(q.shape[1]):
            layer, head = subs[(li, a)]
            q_star = queries[layer][head][pos].to(q.device, q.dtype)  # [n, D]
            out[:, a] = (1 - lam) * q[:, a] + lam * q_star
        return out

    return replace


def causal_alpha(target, drafter, refs, subs: dict, lambdas, cfg: DecodeConfig, progress: bool = True):
    """Per reference and λ: attempts and accepts at every draft step of the exact greedy chain replay."""
    if drafter.cfg.kv_mode != "concat":
        raise ValueError(
            f"{drafter.name}: the causal check mixes queries of head-concatenating drafters only."
        )
    cfg = dataclasses.replace(cfg, mode="chain", temperature=0.0).validate()
    rows = []
    layers = tuple(drafter.new_session().hidden_layers)
    for ref in tqdm(refs, desc=f"{drafter.name}: λ mix", disable=not progress):
        kv_layers = drafter.cfg.kv_layers
        with capture(target.model, kv_layers, hidden=False, kv=False, queries=True) as rec:  # one forward
            states = acceptance.target_states(target, ref, layers)
        queries = {lay: rec.queries_at(lay)[0].float().cpu() for lay in kv_layers}  # [H, T, D]
        for lam in lambdas:
            with drafter_queries(drafter, replace=mixing_hook(queries, subs, float(lam)), keep=False):
                res = acceptance.replay_greedy(target, drafter, ref, cfg, states)
            for k, (att, acc) in enumerate(zip(res.step_attempts, res.step_accepts)):
                rows.append(
                    dict(sequence=sequence_id(ref), lam=float(lam), step=k, attempts=att, accepts=acc)
                )
    return pd.DataFrame(rows)


def causal_summary(by_sequence: pd.DataFrame, n_boot: int = 2000, seed: int = 0) -> pd.DataFrame:
    """α_k per drafter and λ with a 95% bootstrap interval over sequences, and the MAT its αs imply."""
    rows = []
    for (drafter, lam), d in by_sequence.groupby(["drafter", "lam"]):
        wide_att = d.pivot_table(index="sequence", columns="step", values="attempts", fill_value=0)
        wide_acc = d.pivot_table(index="sequence", columns="step", values="accepts", fill_value=0)
        est, lo, hi, _ = ratio_ci(wide_acc.to_numpy(), wide_att.to_numpy(), n_boot, seed)
        alpha = list(est)
        for c, step in enumerate(wide_att.columns):
            rows.append(
                dict(
                    drafter=drafter,
                    lam=lam,
                    step=int(step),
                    alpha_conditional=float(est[c]),
                    ci_lo=float(lo[c]),
                    ci_hi=float(hi[c]),
                    n_attempts=int(wide_att[step].sum()),
                    n_accepts=int(wide_acc[step].sum()),
                    mat=metrics.mat_from_alpha([a if np.isfinite(a) else float("nan") for a in alpha]),
                )
            )
    return pd.DataFrame(rows)


def run_causal_check(
    target, drafters: dict, refs, by_head: pd.DataFrame, lambdas, cfg: DecodeConfig, progress=True
):
    """The λ sweep for every head-concatenating drafter: (per-sequence counts, summary, note on skipped ones)."""
    frames, skipped = [], []
    for name, drafter in drafters.items():
        if drafter.cfg.kv_mode != "concat":
            skipped.append(
                f"{name} ({drafter.cfg.kv_mode}: no drafter query in the target's key space to mix)"
            )
            continue
        subs = substitutes(drafter, by_head)
        frames.append(causal_alpha(target, drafter, refs, subs, lambdas, cfg, progress).assign(drafter=name))
    if not frames:
        raise ValueError(f"no drafter the causal check can run on: {'; '.join(skipped)}.")
    by_seq = pd.concat(frames, ignore_index=True)
    note = "skipped: " + "; ".join(skipped) if skipped else ""
    return by_seq, causal_summary(by_seq), note
