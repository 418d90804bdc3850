"""Learning curves: where each paradigm is heading, not only where a budget left it (notebook 02).

The training loop logs a ``curve`` table: held-out per-step accuracy at log-spaced token budgets, each
point after a WSD decay branch (``training/schedule.py``). From it:

* :func:`curve_table`: long form, one row per (drafter, budget, metric) for ``acc_0``, ``acc_3``, ``acc_6``
  and the formula MAT ``1 + sum_k prod_{j<=k} acc_j``, each with its standard error and 95% interval
  (Wilson for accuracies; a parametric bootstrap of the per-step binomials for MAT);
* :func:`fit_saturating`: ``v(N) = a - b N^(-c)`` by weighted least squares, the asymptote ``a`` with a
  parametric-bootstrap 95% interval (``tests/test_learning_curves.py`` recovers a known one);
* :func:`gap_by_budget`: at each budget, the difference of two drafters (hybrid - hidden, a KV reader -
  its zeroed-KV control, every drafter - the no-target control) with its interval, and
  :func:`gap_trend`: the slope of a gap against log10(tokens) with its interval, read as grows / holds /
  shrinks.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy.optimize import curve_fit

CURVE_METRICS = ("acc_0", "acc_3", "acc_6", "mat")
Z95 = 1.96


def _mat(accs: np.ndarray) -> np.ndarray:
    """``1 + sum_k prod_{j<=k} acc_j`` along the last axis."""
    return 1.0 + np.cumprod(accs, axis=-1).sum(-1)


def curve_table(curve: pd.DataFrame, n_boot: int = 2000, seed: int = 0) -> pd.DataFrame:
    """Long form of the loop's ``curve`` log (stacked over drafters): drafter, paradigm, regime, target_kv,
    budget_step, tokens, metric, value, se, lo, hi, n."""
    rng = np.random.default_rng(seed)
    steps = sorted(int(c[4:]) for c in curve.columns if c.startswith("acc_") and c[4:].isdigit())
    rows = []
    for _, r in curve.iterrows():
        acc = np.array([r[f"acc_{k}"] for k in steps], float)
        n = np.array([r[f"n_{k}"] for k in steps], float)
        ok = np.isfinite(acc)
        base = dict(
            drafter=r["drafter"],
            paradigm=r["paradigm"],
            regime=r["regime"],
            target_kv=r.get("target_kv", "real"),
            budget_step=int(r["budget_step"]),
            tokens=int(r["tokens"]),
            **{k: r[k] for k in ("precision", "cpu", "bf16_isa") if k in r},
        )
        for k in steps:
            if f"acc_{k}" not in CURVE_METRICS or not ok[k]:
                continue
            p, m = acc[k], max(n[k], 1)
            se = float(np.sqrt(max(p * (1 - p), 1e-12) / m))
            lo, hi = _wilson(p, m)
            rows.append(dict(base, metric=f"acc_{k}", value=p, se=se, lo=lo, hi=hi, n=int(n[k])))
        draws = rng.binomial(np.maximum(n[ok], 1).astype(int), acc[ok], size=(n_boot, int(ok.sum())))
        boot = _mat(draws / np.maximum(n[ok], 1))
        rows.append(
            dict(
                base,
                metric="mat",
                value=float(_mat(acc[ok])),
                se=float(boot.std()),
                lo=float(np.quantile(boot, 0.025)),
                hi=float(np.quantile(boot, 0.975)),
                n=int(n[0]),
            )
        )
    return pd.DataFrame(rows)


def _wilson(p: float, n: float) -> tuple[float, float]:
    z = Z95
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return float(centre - half), float(centre + half)


MIN_BEND = 0.25  # the share of its remaining gap a fitted curve must close within the data to identify its a


def _saturating(x, a, b, c):
    return a - b * x ** (-c)


def _fit(x: np.ndarray, v: np.ndarray, se: np.ndarray, upper: float) -> tuple[float, float, float]:
    span = max(float(np.ptp(v)), 1e-3)
    top = min(float(v.max()) + 10 * span, upper)
    p0 = (min(float(v[-1]) + 0.1 * span, top), span, 0.5)
    lo, hi = (float(v.min()) - 10 * span, -50 * span, 0.02), (top, 50 * span, 3.0)
    popt, _ = curve_fit(
        _saturating, x, v, p0=p0, sigma=se, absolute_sigma=True, bounds=(lo, hi), maxfev=20000
    )
    return tuple(float(p) for p in popt)


def fit_saturating(
    tokens, values, n=None, se=None, upper: float = 1.0, n_boot: int = 1000, seed: int = 0
) -> dict:
    """Fit ``v(N) = a - b N^(-c)`` to points (``tokens``, ``values``); ``n`` (trials, for proportions) or
    ``se`` gives each point's standard error, ``upper`` caps ``a`` (1 for an accuracy). Returns a, b, c, the
    asymptote's 95% interval (a parametric bootstrap: each point redrawn from its error, refitted) and how
    many refits converged. With points far from saturation the exponent is weakly identified, so the upper
    end of the interval is loose: read the lower end (what the curve has already nearly reached).

    ``identified`` says whether the points pin ``a`` down at all: the fitted curve rises, bends within the data
    (its ``N^-c`` term shrinks by at least ``MIN_BEND`` from the first budget to the last) and its interval stays
    below ``upper``. A curve that is still straight on a log axis fits any far-off asymptote equally well."""
    x = np.asarray(tokens, float)
    v = np.asarray(values, float)
    keep = np.isfinite(v)
    x, v = x[keep], v[keep]
    if se is None:
        m = np.maximum(np.asarray(n, float)[keep], 1)
        se = np.sqrt(np.clip(v * (1 - v), 1e-4, None) / m)
    se = np.maximum(np.asarray(se, float)[keep] if np.ndim(se) else np.full(len(v), float(se)), 1e-4)
    out = dict(
        a=np.nan, b=np.nan, c=np.nan, a_lo=np.nan, a_hi=np.nan, n_points=len(v), boot_ok=0, identified=False
    )
    if len(v) < 4:
        return out
    scale = float(np.median(x))
    xs = x / scale
    try:
        a, b, c = _fit(xs, v, se, upper)
    except (RuntimeError, ValueError):
        return out
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n_boot):
        try:
            boots.append(_fit(xs, v + rng.normal(0, se), se, upper)[0])
        except (RuntimeError, ValueError):
            continue
    out.update(a=a, b=b * scale ** (-c), c=c, boot_ok=len(boots))
    if boots:
        out.update(a_lo=float(np.quantile(boots, 0.025)), a_hi=float(np.quantile(boots, 0.975)))
        bend = 1 - (x.max() / x.min()) ** (-c)
        out["identified"] = bool(b > 0 and bend >= MIN_BEND and out["a_hi"] < upper - 1e-6)
    return out


def asymptotes(table: pd.DataFrame, n_boot: int = 500) -> pd.DataFrame:
    """:func:`fit_saturating` per drafter and metric of a :func:`curve_table`."""
    rows = []
    for (drafter, metric), d in table.groupby(["drafter", "metric"], sort=False):
        d = d.sort_values("tokens")
        upper = 1.0 if metric.startswith("acc_") else 8.0  # MAT over 7 evaluated steps is at most 8
        fit = fit_saturating(d["tokens"], d["value"], se=d["se"].to_numpy(), upper=upper, n_boot=n_boot)
        last = d.iloc[-1]
        rows.append(
            dict(
                drafter=drafter,
                paradigm=last["paradigm"],
                regime=last["regime"],
                target_kv=last["target_kv"],
                metric=metric,
                last_tokens=int(last["tokens"]),
                last_value=float(last["value"]),
                **fit,
            )
        )
    return pd.DataFrame(rows)


def comparison_pairs(drafters: pd.DataFrame) -> list[tuple[str, str, str]]:
    """(kind, drafter, minus): hybrid - hidden (same regime), each KV reader - its zeroed-KV control, and every
    drafter - the no-target control. ``drafters`` has columns drafter, paradigm, regime, target_kv."""
    d = drafters.drop_duplicates("drafter")
    names = set(d["drafter"])
    pairs = []
    for r in d.itertuples():
        if r.paradigm == "hybrid" and r.target_kv == "real":
            hidden = d[(d["paradigm"] == "hidden") & (d["regime"] == r.regime)]
            pairs += [("hybrid - hidden", r.drafter, h) for h in hidden["drafter"]]
        if r.target_kv == "real" and f"{r.drafter}-zeroed" in names:
            pairs.append(("KV - zeroed control", r.drafter, f"{r.drafter}-zeroed"))
    controls = d[d["paradigm"] == "none"]["drafter"].tolist()
    for r in d.itertuples():
        if r.paradigm != "none":
            pairs += [("drafter - no-target control", r.drafter, c) for c in controls]
    return pairs


def gap_by_budget(table: pd.DataFrame, pairs) -> pd.DataFrame:
    """At each budget step, ``drafter - minus`` for every pair and metric, with a 95% normal interval."""
    idx = table.set_index(["drafter", "metric", "budget_step"])
    rows = []
    for kind, a, b in pairs:
        for metric in CURVE_METRICS:
            for step in sorted(set(table["budget_step"])):
                if (a, metric, step) not in idx.index or (b, metric, step) not in idx.index:
                    continue
                ra, rb = idx.loc[(a, metric, step)], idx.loc[(b, metric, step)]
                gap = float(ra["value"] - rb["value"])
                se = float(np.hypot(ra["se"], rb["se"]))
                rows.append(
                    dict(
                        comparison=kind,
                        drafter=a,
                        minus=b,
                        metric=metric,
                        budget_step=int(step),
                        tokens=int(ra["tokens"]),
                        gap=gap,
                        se=se,
                        lo=gap - Z95 * se,
                        hi=gap + Z95 * se,
                    )
                )
    return pd.DataFrame(rows)


def gap_trend(tokens, gap, se) -> dict:
    """Weighted least-squares slope of ``gap`` against log10(tokens), per decade, with a 95% interval (the
    larger of the points' own errors and the residual scatter); ``trend`` is grows / holds / shrinks."""
    x = np.log10(np.asarray(tokens, float))
    y, s = np.asarray(gap, float), np.maximum(np.asarray(se, float), 1e-6)
    w = 1 / s**2
    xm, ym = np.average(x, weights=w), np.average(y, weights=w)
    sxx = float((w * (x - xm) ** 2).sum())
    slope = float((w * (x - xm) * (y - ym)).sum() / sxx)
    resid = y - (ym + slope * (x - xm))
    dof = max(len(x) - 2, 1)
    chi2 = float((w * resid**2).sum() / dof)
    half = Z95 * np.sqrt(max(chi2, 1.0) / sxx)
    lo, hi = slope - half, slope + half
    trend = "grows" if lo > 0 else "shrinks" if hi < 0 else "holds"
    return dict(slope=slope, slope_lo=float(lo), slope_hi=float(hi), trend=trend, n_points=len(x))


TREND_KEYS = ("slope", "slope_lo", "slope_hi", "trend", "n_points")  # what gap_trend returns


def gap_trends(gaps: pd.DataFrame) -> pd.DataFrame:
    """:func:`gap_trend` per comparison and metric of a :func:`gap_by_budget` table, with the last gap."""
    rows = []
    for (kind, a, b, metric), d in gaps.groupby(["comparison", "drafter", "minus", "metric"], sort=False):
        d = d.sort_values("tokens")
        if len(d) < 3:
            continue
        last = d.iloc[-1]
        rows.append(
            dict(
                comparison=kind,
                drafter=a,
                minus=b,
                metric=metric,
                last_gap=float(last["gap"]),
                last_lo=float(last["lo"]),
                last_hi=float(last["hi"]),
                **gap_trend(d["tokens"], d["gap"], d["se"]),
            )
        )
    # no pair with 3 budgets: an empty table that still names its columns (a CSV reader then reads 0 rows)
    columns = ["comparison", "drafter", "minus", "metric", "last_gap", "last_lo", "last_hi"]
    return pd.DataFrame(rows) if rows else pd.DataFrame(columns=[*columns, *TREND_KEYS])
