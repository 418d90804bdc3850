"""SpecPV's speed at long context: plain decoding, lossless speculative decoding and SpecPV, in one run.

For each long prompt the target prefills once (:meth:`~kvshot_lib.decoding.cycle.Prefill.run`) and
every method starts from a private copy of that cache, so the 4k-8k-token prefill (tens of seconds on a
CPU) is paid once per prompt, not once per method. Methods, interleaved per prompt so that a slow spell of
a shared machine hits them alike (one untimed warm-up first):

* ``ar``: plain decoding (the engine's loop), the baseline of every ratio;
* ``lossless``: the engine's speculative decoding with the drafter (full verification every cycle);
* ``specpv`` / ``strict``: partial verification, in each of its variants, for each budget × ``full_every``.

Speeds are **decode** tokens/s: new tokens over wall time after the prefill (the prefill is the same for
every method and would hide the difference at 8k tokens). Per-phase times (draft, partial verification,
full verification with the re-feed, block scoring) are summed per method; MAT is given separately over
partial and full verification cycles, the bonus token counted in both.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..decoding.config import DecodeConfig
from ..decoding.cycle import Prefill
from ..decoding.generate import generate
from ..decoding.specpv import SpecPVConfig
from . import metrics
from .specpv_fidelity import first_divergence, mat_by_kind


def speed_plan(budgets, full_everys, variants) -> list[tuple[str, int | None, int | None]]:
    """The methods to time, as (method, budget, full_every): ``ar``, ``lossless``, then SpecPV's grid over its
    ``variants`` (``specpv``, ``strict``)."""
    return [("ar", None, None), ("lossless", None, None)] + [
        (v, b, p) for v in variants for b in budgets for p in full_everys
    ]


def _run(target, drafter, ids, cfg: DecodeConfig, method, budget, full_every, base, pre):
    if method == "ar":
        return generate(target, ids, replace(cfg, mode="ar"), prefill=pre)
    if method == "lossless":
        return generate(target, ids, cfg, drafter, prefill=pre)
    pv = replace(base, budget=budget, full_every=full_every, strict=method == "strict")
    return generate(target, ids, cfg, drafter, partial=pv, prefill=pre)


@torch.inference_mode()
def run_speed(
    target,
    drafter,
    prompts: dict[int, list[list[int]]],
    cfg: DecodeConfig,
    budgets,
    full_everys,
    variants=("specpv",),
    base: SpecPVConfig | None = None,
    progress: bool = True,
    on_prefill=None,
    prefills: dict | None = None,
) -> pd.DataFrame:
    """One row per (context, prompt, method, budget, full_every): tokens, decode seconds, phase times, cycles.
    ``on_prefill(context, prompt index, Prefill)`` runs after each prompt's prefill (e.g. to time forwards
    on that real cache for the cost model). ``prefills``: shared with :func:`~.specpv_fidelity.run_fidelity`
    so that each prompt is prefilled once (the prefill is timed where it ran and charged to every method)."""
    base = base or SpecPVConfig()
    plan = speed_plan(budgets, full_everys, variants)
    for _m, b, p in plan:  # validate every setting before the first prefill
        if b is not None:
            replace(base, budget=b, full_every=p).validate()
    layers = tuple(drafter.new_session().hidden_layers) if drafter is not None else ()
    todo = [(ctx, i, ids) for ctx, group in prompts.items() for i, ids in enumerate(group)]
    rows = []
    for n, (ctx, i, ids) in enumerate(tqdm(todo, desc="SpecPV speed", disable=not progress)):
        pre = Prefill.run(target, ids, layers, store=prefills)
        if on_prefill is not None:
            on_prefill(ctx, i, pre)
        if n == 0:  # untimed warm-up of every code path
            for m, b, p in plan:
                _run(target, drafter, ids, replace(cfg, max_new_tokens=4), m, b, p, base, pre)
        reference = None
        for m, b, p in plan:
            out = _run(target, drafter, ids, cfg, m, b, p, base, pre)
            reference = out.token_ids if m == "ar" else reference
            rows.append(_row(out, ctx, i, m, b, p, reference))
        del pre
    rows = pd.DataFrame(rows)
    rows.insert(0, "drafter", getattr(drafter, "name", "none"))
    return rows


def _row(out, ctx, i, method, budget, full_every, reference) -> dict:
    partial = hasattr(out, "cycle_kind")
    kinds = out.cycle_kind if partial else ["full"] * out.n_cycles
    row = dict(
        context=ctx,
        prompt=i,
        method=method,
        budget=budget if budget is not None else -1,
        full_every=full_every if full_every is not None else -1,
        n_tokens=len(out.token_ids),
        decode_s=out.total_s - out.prefill_s,
        prefill_s=out.prefill_s,
        draft_s=out.draft_s,
        partial_s=out.partial_s if partial else 0.0,
        full_s=out.full_s if partial else out.verify_s,  # plain decoding: every forward is a full one
        refresh_s=out.refresh_s if partial else 0.0,
        n_partial=out.n_partial if partial else 0,
        n_full=out.n_full if partial else (out.n_cycles or len(out.token_ids) - 1),
        refed_tokens=out.refed_tokens if partial else 0,
        n_rollbacks=len(out.rollbacks) if partial else 0,
        rollback_tokens=sum(out.rollbacks) if partial else 0,
        drafted=sum(out.drafted_per_cycle),
        exact_match_vs_ar=out.token_ids == reference,
        first_divergence=first_divergence(out.token_ids, reference),
    )
    row.update(mat_by_kind(out.accepted_per_cycle, kinds))
    row["accepted_partial"] = sum(a for a, k in zip(out.accepted_per_cycle, kinds) if k == "partial")
    row["accepted_full"] = sum(a for a, k in zip(out.accepted_per_cycle, kinds) if k == "full")
    return row


def speed_table(rows: pd.DataFrame, machine: str) -> pd.DataFrame:
    """One row per drafter × context × method × budget × full_every: decode tokens/s, ratios to ``ar`` and
    ``lossless`` of the same drafter and context (same run), phase milliseconds per token, MAT over partial
    and over full cycles (bonus counted in both)."""
    keys = ["drafter", "context", "method", "budget", "full_every"]
    sums = rows.groupby(keys, as_index=False, sort=False)[
        [
            "n_tokens",
            "decode_s",
            "draft_s",
            "partial_s",
            "full_s",
            "refresh_s",
            "n_partial",
            "n_full",
            "refed_tokens",
            "n_rollbacks",
            "rollback_tokens",
            "cycles_partial",
            "cycles_full",
            "accepted_partial",
            "accepted_full",
            "drafted",
        ]
    ].sum()
    sums["n_prompts"] = rows.groupby(keys, sort=False).size().values
    sums["exact_match_vs_ar"] = rows.groupby(keys, sort=False)["exact_match_vs_ar"].mean().values
    sums["tokens_per_s"] = [metrics.tokens_per_second(n, s) for n, s in zip(sums.n_tokens, sums.decode_s)]
    for base in ("ar", "lossless"):
        ref = sums[sums.method == base].set_index(["drafter", "context"])["tokens_per_s"]
        sums[f"speedup_vs_{base}"] = [
            tps / ref.get((d, c), math.nan)
            for d, c, tps in zip(sums.drafter, sums.context, sums.tokens_per_s)
        ]
    for phase in ("draft_s", "partial_s", "full_s", "refresh_s"):
        sums[f"{phase[:-2]}_ms_per_token"] = 1000 * sums[phase] / sums.n_tokens
    for kind in ("partial", "full"):
        c = sums[f"cycles_{kind}"]
        sums[f"mat_{kind}"] = [metrics.mat_from_counts(a, k) for a, k in zip(sums[f"accepted_{kind}"], c)]
    sums["machine"] = machine
    return sums
