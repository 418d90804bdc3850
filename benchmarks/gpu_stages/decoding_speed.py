"""The target's decoding speed on the fast path, and what a cycle costs around it: the ``plain_decoding``,
``verification_cost``, ``cycle_overhead`` and ``compiled_forward`` stages."""

from __future__ import annotations

import time
import traceback
from dataclasses import replace

from kvshot_lib.decoding import (
    DecodeConfig,
    autoregressive_generate,
    draft_capture_seconds,
    generate,
    measure_verification,
)
from kvshot_lib.target import Target, capture_seconds, static_cache_for, width_for

from .scales import Scale


def verification_cost(target: Target, scale: Scale) -> dict:
    """c_v(k) on the fast path (graph replays at the padded widths on a GPU), and the eager c_v(1) beside it."""
    args = (target, scale.cv_context, scale.cv_sizes, scale.cv_reps)
    chain, tree, commit = measure_verification(*args, static=True)
    eager, _, _ = measure_verification(target, scale.cv_context, (1,), scale.cv_reps, static=False)
    rows = [
        dict(k=k, chain_s=chain[k], tree_s=tree[k], chain_rel=chain[k] / chain[1], tree_rel=tree[k] / tree[1])
        for k in scale.cv_sizes
    ]
    return dict(
        context=scale.cv_context, commit_s=commit, k1_ms=1e3 * chain[1], eager_k1_ms=1e3 * eager[1], rows=rows
    )


def fast_path(device: str) -> str:
    return "CUDA graphs over a static cache" if device.startswith("cuda") else "static cache, eager (no GPU)"


def plain_decoding(target: Target, prompts: list[list[int]], scale: Scale) -> dict:
    """Plain decoding tokens/s, eagerly on a DynamicCache (``tokens_per_s``) and on the fast path
    (``graphs_tokens_per_s``); the first call of each warms up, and captures the fast path's graph."""
    row = dict(prompts=len(prompts), new_tokens=scale.decode_tokens, prompt_tokens=[len(p) for p in prompts])
    for key, cache in (("", "dynamic"), ("graphs_", "static")):
        cfg = DecodeConfig(
            mode="ar", max_new_tokens=scale.decode_tokens, stop_token_ids=(), target_cache=cache
        )
        t0 = time.perf_counter()
        for p in prompts:  # warm-up; captures the graph of each prompt's cache size
            autoregressive_generate(target, p, replace(cfg, max_new_tokens=4))
        warm = time.perf_counter() - t0
        runs = [autoregressive_generate(target, p, cfg) for p in prompts]
        steps = sum(len(r.token_ids) - 1 for r in runs)
        row[f"{key}tokens_per_s"] = round(steps / sum(r.verify_s for r in runs), 2)
        row[f"{key}end_to_end_tokens_per_s"] = round(
            sum(len(r.token_ids) for r in runs) / sum(r.total_s for r in runs), 2
        )
        row[f"{key}warmup_s"] = round(warm, 2)
        row[f"{key}outputs"] = [r.token_ids for r in runs]
    row["graphs_speedup"] = round(row["graphs_tokens_per_s"] / row["tokens_per_s"], 3)
    row["fast_path"] = fast_path(str(target.model.device))
    row["same_tokens"] = sum(a == b for a, b in zip(row.pop("outputs"), row.pop("graphs_outputs")))
    cache = static_cache_for(
        target.model, max(map(len, prompts)) + scale.decode_tokens + 1
    )  # the one they shared
    row["capture_s"] = round(capture_seconds(cache), 2)  # inside graphs_warmup_s: the graph's capture alone
    return row


def cycle_overhead(target: Target, drafter, prompts: list[list[int]], scale: Scale, cv: dict) -> dict:
    """Per speculative cycle on the fast path: drafting, the verify step (forward and acceptance rule) and the
    commit, and what is left once the verify forward's own c_v (at the block's padded width) is taken out; for the
    draft loop on the device (``chain``, ``tree``: a CUDA graph replay on a GPU) and on the host (``*_host``)."""
    step_s = {r["k"]: r["chain_s"] for r in cv["rows"]}
    base = DecodeConfig(
        max_new_tokens=scale.equality_tokens, stop_token_ids=(), chain_depth=scale.chain_depth, **scale.tree
    )
    out = {}
    for mode, loop in (("chain", "device"), ("tree", "device"), ("chain", "host"), ("tree", "host")):
        key = mode if loop == "device" else f"{mode}_host"
        try:
            out[key] = one_cycle_overhead(
                target, drafter, prompts, replace(base, mode=mode, draft_loop=loop), step_s
            )
        except Exception as e:  # the other rows still run
            traceback.print_exc()
            out[key] = dict(error=f"{type(e).__name__}: {e}")
    out["draft_capture_s"] = round(draft_capture_seconds(drafter), 2)
    return out


def one_cycle_overhead(
    target: Target, drafter, prompts: list[list[int]], cfg: DecodeConfig, step_s: dict
) -> dict:
    """:func:`cycle_overhead`'s row of one mode and draft loop."""
    cfg = replace(cfg, target_cache="static")
    for p in prompts:  # warm-up; captures the graphs of each prompt's cache size, and the draft loop's
        generate(target, p, replace(cfg, max_new_tokens=8), drafter=drafter)
    runs = [generate(target, p, cfg, drafter=drafter) for p in prompts]
    cycles = sum(r.n_cycles for r in runs)
    forward_s = sum(
        step_s.get(width_for(n + 1), step_s[max(step_s)]) for r in runs for n in r.drafted_per_cycle
    )
    spent = {k: sum(getattr(r, f"{k}_s") for r in runs) for k in ("draft", "verify", "commit")}
    overhead = sum(spent.values()) - forward_s
    return dict(
        draft_loop=cfg.draft_loop,
        cycles=cycles,
        nodes_per_cycle=round(sum(sum(r.drafted_per_cycle) for r in runs) / max(1, cycles), 2),
        **{f"{k}_ms": round(1e3 * v / max(1, cycles), 3) for k, v in spent.items()},
        verify_forward_ms=round(1e3 * forward_s / max(1, cycles), 3),
        overhead_ms=round(1e3 * overhead / max(1, cycles), 3),
        overhead_over_cv1=round(overhead / max(1, cycles) / step_s[1], 3),
    )


def compiled_forward(
    target: Target, prompts: list[list[int]], scale: Scale, uncompiled_tps: float | None
) -> dict:
    """Plain decoding on the fast path with the target's norms and MLPs compiled inside its captured graphs
    (``DecodeConfig.compile_target``): tokens/s, the warm-up's seconds (the compile and the capture), and whether it
    decodes the uncompiled fast path's tokens."""
    cfg = DecodeConfig(
        mode="ar", max_new_tokens=scale.compile_tokens, stop_token_ids=(), target_cache="static"
    )
    t0 = time.perf_counter()
    for p in prompts:  # compiles and captures each cache size's width-1 graph
        autoregressive_generate(target, p, replace(cfg, max_new_tokens=4, compile_target=True))
    warm = time.perf_counter() - t0
    runs = [autoregressive_generate(target, p, replace(cfg, compile_target=True)) for p in prompts]
    plain = [autoregressive_generate(target, p, cfg).token_ids for p in prompts]
    tps = sum(len(r.token_ids) - 1 for r in runs) / sum(r.verify_s for r in runs)
    return dict(
        tokens_per_s=round(tps, 2),
        over_uncompiled=round(tps / uncompiled_tps, 3) if uncompiled_tps else None,
        compile_and_capture_s=round(warm, 2),
        same_tokens=sum(r.token_ids == q for r, q in zip(runs, plain)),
        prompts=len(prompts),
        compiled="every decoder layer's RMSNorms and MLP (torch.compile, fixed shapes), inside the width-1 graph",
    )
