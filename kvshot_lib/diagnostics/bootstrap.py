"""Bootstrap intervals and paired tests over independent units (sequences, documents), seeded.

Every diagnostic compares estimates measured on the *same* units (two estimators on one sequence, two probes
on one document), so the tests resample units and keep the pairs together: the interval of a difference is
then the interval of the per-unit difference, and correlated noise cancels.
"""

from __future__ import annotations

import numpy as np

N_BOOT = 2000


def _resample(n_units: int, n_boot: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_units, size=(n_boot, n_units))  # [n_boot, n_units]


def ratio_ci(num: np.ndarray, den: np.ndarray, n_boot: int = N_BOOT, seed: int = 0, level: float = 0.95):
    """``Σ num / Σ den`` over units, and its percentile interval: ``(estimate, lo, hi, draws [n_boot, ...])``.

    ``num [n_units, ...]`` (any trailing shape, e.g. one column per draft step), ``den [n_units, ...]`` (the
    units' weights, e.g. example counts; ones for a plain mean of unit values)."""
    num, den = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    den = np.broadcast_to(den.reshape(den.shape + (1,) * (num.ndim - den.ndim)), num.shape)
    if num.shape[0] == 0:
        raise ValueError("bootstrap over zero units.")
    idx = _resample(num.shape[0], n_boot, seed)
    with np.errstate(invalid="ignore", divide="ignore"):
        est = num.sum(0) / den.sum(0)
        draws = num[idx].sum(1) / den[idx].sum(1)  # [n_boot, ...]
    a = (1 - level) / 2
    lo, hi = np.nanquantile(draws, a, axis=0), np.nanquantile(draws, 1 - a, axis=0)
    return est, lo, hi, draws


def mean_ci(values: np.ndarray, n_boot: int = N_BOOT, seed: int = 0, level: float = 0.95):
    """The mean of unit values ``[n_units, ...]`` (NaN units dropped per column) with its interval."""
    values = np.asarray(values, dtype=float)
    ok = ~np.isnan(values)
    return ratio_ci(np.where(ok, values, 0.0), ok.astype(float), n_boot, seed, level)


def two_sided_p(draws: np.ndarray) -> np.ndarray:
    """Bootstrap p-value of "the difference is 0": twice the smaller tail share of the draws around 0."""
    draws = np.asarray(draws, dtype=float)
    below = (draws <= 0).mean(0)
    above = (draws >= 0).mean(0)
    return np.minimum(1.0, 2 * np.minimum(below, above))


def slope(y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Least-squares slope of ``y [..., len(x)]`` on ``x`` along the last axis."""
    x = np.asarray(x, dtype=float)
    xc = x - x.mean()
    return ((y - y.mean(-1, keepdims=True)) * xc).sum(-1) / (xc**2).sum()
