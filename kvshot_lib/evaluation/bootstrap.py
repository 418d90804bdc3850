"""95% bootstrap intervals of acceptance by step, MAT and retention, resampling whole generations.

A generation (one MT-bench turn decoded by one drafter) is the unit: its cycles share a prompt, so they are
not independent. Each bootstrap sample draws as many generations as were measured, with replacement, and
recomputes the statistics from the pooled counts exactly as :func:`~.acceptance.acceptance_summary` does.
``tests/test_reference_outputs.py`` checks the point values against the summary and that the interval
contains them.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from . import metrics


def _stats(
    att: np.ndarray, acc: np.ndarray, cycles: np.ndarray, n_cycles: np.ndarray, steps: int
) -> list[float]:
    a, s = att.sum(0), acc.sum(0)  # [K]
    alpha = [float(s[k] / a[k]) if a[k] else math.nan for k in range(steps)]
    n = n_cycles.sum()
    mat = float((cycles.sum() + n) / n) if n else math.nan
    ret = metrics.retention(alpha, attempts=a.tolist()) if steps > 6 else math.nan
    return alpha + [mat, ret]


def bootstrap_acceptance(runs, n_boot: int = 1000, seed: int = 0, steps: int = 7) -> pd.DataFrame:
    """One row per run x metric (``alpha_0`` .. ``alpha_{steps-1}``, ``mat``, ``retention``): value, lo, hi."""
    names = [f"alpha_{k}" for k in range(steps)] + ["mat", "retention"]
    rows = []
    for run in runs:
        G = len(run.results)
        if not G:
            continue
        att = np.zeros((G, steps))
        acc = np.zeros((G, steps))
        for g, r in enumerate(run.results):
            k = min(steps, len(r.step_attempts))
            att[g, :k], acc[g, :k] = r.step_attempts[:k], r.step_accepts[:k]
        cycles = np.array([sum(r.accepted_per_cycle) for r in run.results], dtype=float)
        n_cycles = np.array([len(r.accepted_per_cycle) for r in run.results], dtype=float)
        point = _stats(att, acc, cycles, n_cycles, steps)
        rng = np.random.default_rng(seed)
        samples = []
        for _ in range(n_boot):
            idx = rng.integers(0, G, G)
            samples.append(_stats(att[idx], acc[idx], cycles[idx], n_cycles[idx], steps))
        samples = np.array(samples, dtype=float)  # [n_boot, metrics]
        for j, name in enumerate(names):
            col = samples[:, j]
            col = col[~np.isnan(col)]
            lo, hi = np.percentile(col, [2.5, 97.5]).tolist() if len(col) else (math.nan, math.nan)
            rows.append(dict(**run.labels(), metric=name, value=point[j], lo=lo, hi=hi, n_generations=G))
    return pd.DataFrame(rows)
