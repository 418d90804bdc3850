"""A cost model of SpecPV against lossless speculative decoding, and where it starts to pay.

**Forward cost.** One target forward of ``n`` rows on a cache of ``L`` tokens is fitted, on this machine,
as ``t(L, n) = c0 + c1 n + c2 L + c3 L n`` (weights: ``c0``, ``c1``; reading and copying the cache: ``c2``;
attention: ``c3``) from forwards timed on a real prefilled cache (:func:`forward_costs`). The partial
cache's rebuild (block scoring and gathering) is fitted as ``r(L) = r0 + r1 L``.

**Per-token time** at context ``L``, given the drafting time per cycle ``d``, the draft nodes per cycle
``N``, and the MAT of full and partial cycles ``m_f``, ``m_p`` (bonus counted):

* lossless: ``(d + t(L, N+1)) / m_f``;
* SpecPV with budget ``B`` and period ``P``: ``k = ceil(P / m_p)`` partial cycles on a compact cache of
  ``B' = B + 8 + k m_p / 2`` tokens (budget, half a tail block, the mean buffer), then one full pass that
  re-feeds the ``k m_p`` pending tokens with the draft, and a rebuild:
  ``[k (d + t(B', N+1)) + d + t(L, k m_p + N + 1) + r(L)] / (k m_p + m_f)``.

The **crossover** is the smallest ``L > B`` where SpecPV's per-token time falls below lossless's.

**A GPU with a Qwen3-8B-sized target**, by the model only: a forward is memory-bound, ``t(L, n) =
overhead + max(weights / BW, 2 params n / FLOPs) + L kv_bytes / BW + attention FLOPs``; the rebuild reads
the block summaries and gathers ``B`` tokens. The constants are in :data:`QWEN3_8B_H100` (bf16 weights;
80% of the H100's 3.35 TB/s; 50% of its 989 TFLOP/s; ``overhead`` 0.73 ms per layer as this suite measured
for SmolLM2 under transformers on an H100, or 0 for a CUDA-graph runtime).
"""

from __future__ import annotations

import math
import time

import numpy as np
import pandas as pd
import torch

from ..decoding.cycle import Prefill
from ..decoding.partial_kv import PartialKVCache, PartialKVConfig
from ..target.forward import cache_length, crop, forward

QWEN3_8B_H100 = dict(
    params=8.19e9,
    bytes_per_param=2,
    n_layers=36,
    n_heads=32,
    head_dim=128,
    kv_bytes_per_token=36 * 2 * 8 * 128 * 2,  # layers x (K, V) x KV heads x head dim x bf16
    bandwidth=0.8 * 3.35e12,
    flops=0.5 * 989e12,
    overhead_per_layer=0.73e-3,
)


@torch.inference_mode()
def forward_costs(
    target,
    pre: Prefill,
    lengths,
    rows=(1, 4, 16, 32),
    reps: int = 3,
    block_cfg: PartialKVConfig | None = None,
) -> pd.DataFrame:
    """Median seconds of an ``n``-row forward on the first ``L`` tokens of ``pre``'s cache for every
    ``L`` x ``n``, and of a partial-cache rebuild at each ``L`` (``n = 0`` rows in the table)."""
    model = target.model
    cache = pre.copy(pre.ids, (), model.config).cache
    block_cfg = (block_cfg or PartialKVConfig(budget=1024)).validate()
    g = torch.Generator().manual_seed(0)
    cfg = model.config
    out = []
    for L in sorted((x for x in lengths if x <= cache_length(cache)), reverse=True):
        crop(cache, L)
        for n in rows:
            x = torch.randint(100, 1000, (1, n), generator=g).to(model.device)
            pos = torch.arange(L, L + n, device=model.device)[None]
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                forward(model, x, cache, positions=pos)
                times.append(time.perf_counter() - t0)
                crop(cache, L)
            out.append(dict(length=L, rows=n, seconds=sorted(times)[reps // 2], what="forward"))
        H, D = cfg.num_attention_heads, getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
        queries = {
            li: torch.randn(1, H, 5, D, generator=g).to(model.device) for li in range(cfg.num_hidden_layers)
        }
        times = []
        for _ in range(reps):
            partial = PartialKVCache(block_cfg)
            t0 = time.perf_counter()
            partial.refresh(cache, queries, cfg)
            times.append(time.perf_counter() - t0)
        out.append(dict(length=L, rows=0, seconds=sorted(times)[reps // 2], what="refresh"))
    return pd.DataFrame(out)


class ForwardCostProbe:
    """An ``on_prefill`` hook for :func:`~kvshot_lib.evaluation.specpv_speed.run_speed`: times
    :func:`forward_costs` once, on the cache of the first prompt of ``context`` tokens (``table``)."""

    def __init__(self, target, lengths, context: int, block_cfg: PartialKVConfig | None = None):
        self.target, self.lengths, self.context, self.block_cfg = target, list(lengths), context, block_cfg
        self.table: pd.DataFrame | None = None

    def __call__(self, context: int, prompt: int, pre: Prefill) -> None:
        if context == self.context and self.table is None:
            self.table = forward_costs(self.target, pre, self.lengths, block_cfg=self.block_cfg)


def fit_costs(costs: pd.DataFrame) -> dict:
    """Non-negative least-squares fit of ``t(L, n) = c0 + c1 n + c2 L + c3 L n`` and ``r(L) = r0 + r1 L``
    (every term is a cost, so none may be negative; that also keeps extrapolation to long contexts sane)."""
    from scipy.optimize import nnls

    f = costs[costs.what == "forward"]
    X = np.stack([np.ones(len(f)), f.rows, f.length, f.length * f.rows], 1).astype(float)
    scale = X.max(0)  # columns of very different sizes: fit on columns scaled to [0, 1]
    c = nnls(X / scale, f.seconds.to_numpy(float))[0] / scale
    r = costs[costs.what == "refresh"]
    R = np.stack([np.ones(len(r)), r.length], 1).astype(float)
    rr = nnls(R / R.max(0), r.seconds.to_numpy(float))[0] / R.max(0)
    return dict(c0=c[0], c1=c[1], c2=c[2], c3=c[3], r0=rr[0], r1=rr[1])


def cpu_forward(fit: dict):
    return lambda L, n: fit["c0"] + fit["c1"] * n + fit["c2"] * L + fit["c3"] * L * n


def cpu_refresh(fit: dict):
    return lambda L: fit["r0"] + fit["r1"] * L


def gpu_forward(spec: dict = QWEN3_8B_H100, overhead: bool = True):
    def t(L, n):
        weights = max(
            spec["params"] * spec["bytes_per_param"] / spec["bandwidth"],
            2 * spec["params"] * n / spec["flops"],
        )
        attention = 4 * n * L * spec["n_heads"] * spec["head_dim"] * spec["n_layers"] / spec["flops"]
        kv = L * spec["kv_bytes_per_token"] / spec["bandwidth"]
        return (spec["overhead_per_layer"] * spec["n_layers"] if overhead else 0.0) + weights + kv + attention

    return t


def gpu_refresh(budget: int, block_size: int = 16, spec: dict = QWEN3_8B_H100):
    return lambda L: (2 * L / block_size + budget) * spec["kv_bytes_per_token"] / spec["bandwidth"]


def per_token_seconds(L, forward, refresh, budget, full_every, draft_s, drafted, mat_full, mat_partial):
    """(lossless, SpecPV) seconds per token at context ``L`` (module docstring)."""
    lossless = (draft_s + forward(L, drafted + 1)) / mat_full
    if full_every == 0 or L <= budget:
        return lossless, lossless
    k = math.ceil(full_every / mat_partial)
    pend = k * mat_partial
    period = k * (draft_s + forward(budget + 8 + pend / 2, drafted + 1))
    period += draft_s + forward(L, pend + drafted + 1) + refresh(L)
    return lossless, period / (pend + mat_full)


def crossover(forward, refresh, budget, full_every, draft_s, drafted, mat_full, mat_partial, max_len=2**20):
    """The smallest context length above ``budget`` where SpecPV beats lossless per token (NaN if none up
    to ``max_len``), searched on a grid of 1/64 octave then bisected to the token."""
    args = (budget, full_every, draft_s, drafted, mat_full, mat_partial)
    wins = lambda L: (lambda a, b: b < a)(*per_token_seconds(L, forward, refresh, *args))  # noqa: E731
    grid = np.unique(np.geomspace(budget + 1, max_len, 64 * 20).astype(int))
    hit = next((int(L) for L in grid if wins(L)), None)
    if hit is None:
        return math.nan
    lo = int(grid[max(0, np.searchsorted(grid, hit) - 1)])
    if wins(lo):
        return lo
    while hit - lo > 1:
        mid = (lo + hit) // 2
        lo, hit = (lo, mid) if wins(mid) else (mid, hit)
    return hit


def cost_model_table(speed: pd.DataFrame, fit: dict, lengths) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per SpecPV setting of the speed table: the crossover on this CPU and, by the model, on an H100 with
    a Qwen3-8B-sized target (with and without framework overhead); and the predicted per-token times over
    ``lengths`` (long form, for the figure). Drafting time, draft nodes and MATs come from the measured
    rows of the table's first drafter, pooled over contexts."""
    rows, curves = [], []
    speed = speed[speed.drafter == speed.drafter.iloc[0]] if "drafter" in speed else speed
    lossless = speed[speed.method == "lossless"]
    cycles = max(lossless.cycles_full.sum(), 1)
    mat_full = float((lossless.accepted_full.sum() + cycles) / cycles)
    draft_s = float(lossless.draft_s.sum() / cycles)
    drafted = float(lossless.drafted.sum() / cycles)
    for (budget, full_every), g in speed[speed.method == "specpv"].groupby(["budget", "full_every"]):
        mat_p = float(g.accepted_partial.sum() / max(g.cycles_partial.sum(), 1) + 1)
        models = {
            "this CPU (fitted)": (cpu_forward(fit), cpu_refresh(fit), draft_s),
            "H100 Qwen3-8B, HF overhead": (
                gpu_forward(overhead=True),
                gpu_refresh(budget),
                0.15 * gpu_forward()(0, 1),
            ),
            "H100 Qwen3-8B, no overhead": (
                gpu_forward(overhead=False),
                gpu_refresh(budget),
                0.15 * gpu_forward(overhead=False)(0, 1),
            ),
        }
        for name, (fwd, ref, d) in models.items():
            L_star = crossover(fwd, ref, budget, full_every, d, drafted, mat_full, mat_p)
            rows.append(
                dict(
                    budget=budget,
                    full_every=full_every,
                    machine=name,
                    crossover_tokens=L_star,
                    mat_full=mat_full,
                    mat_partial=mat_p,
                    drafted=drafted,
                    draft_s=d,
                )
            )
            for L in lengths:
                a, b = per_token_seconds(L, fwd, ref, budget, full_every, d, drafted, mat_full, mat_p)
                curves.append(
                    dict(
                        budget=budget,
                        full_every=full_every,
                        machine=name,
                        length=L,
                        lossless_ms=1000 * a,
                        specpv_ms=1000 * b,
                        ratio=a / b,
                    )
                )
    return pd.DataFrame(rows), pd.DataFrame(curves)
