"""Bootstrap intervals over independent units, seeded: the one resampling every table of the suite uses.

A unit is what can be drawn independently: a generation (one MT-bench turn decoded by one drafter, whose cycles
share a prompt), a sequence, a document. Each of ``n_boot`` samples draws as many units as were measured, with
replacement (:func:`resample`), and recomputes the statistic from the drawn units' pooled counts.

* :func:`ratio_ci` / :func:`mean_ci`: a pooled ratio (or mean) and its percentile interval. The diagnostics
  compare estimates measured on the *same* units, so their draws keep each unit's pair together: the interval of
  a difference is then the interval of the per-unit difference, and correlated noise cancels;
  :func:`two_sided_p` turns such draws into a p-value.
* :func:`paired_mat_difference`: one drafter's MAT minus another's on the same MT-bench turns, resampled in
  pairs (from :func:`generation_table`).
* :func:`bootstrap_acceptance`: acceptance by step, MAT and retention of decoding runs, resampling generations,
  each recomputed exactly as :func:`~.acceptance.acceptance_summary` computes it
  (``tests/test_metrics.py`` checks the point values against the summary and that the interval
  contains them).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from . import metrics

N_BOOT = 2000


def resample(n_units: int, n_boot: int, seed: int) -> np.ndarray:
    """``[n_boot, n_units]`` unit indices drawn with replacement."""
    return np.random.default_rng(seed).integers(0, n_units, size=(n_boot, n_units))


def ratio_ci(num: np.ndarray, den: np.ndarray, n_boot: int = N_BOOT, seed: int = 0, level: float = 0.95):
    """``Σ num / Σ den`` over units, and its percentile interval: ``(estimate, lo, hi, draws [n_boot, ...])``.

    ``num [n_units, ...]`` (any trailing shape, e.g. one column per draft step), ``den [n_units, ...]`` (the
    units' weights, e.g. example counts; ones for a plain mean of unit values)."""
    num, den = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    den = np.broadcast_to(den.reshape(den.shape + (1,) * (num.ndim - den.ndim)), num.shape)
    if num.shape[0] == 0:
        raise ValueError("bootstrap over zero units.")
    idx = resample(num.shape[0], n_boot, seed)
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


def _acceptance_stats(
    att: np.ndarray, acc: np.ndarray, accepted: np.ndarray, cycles: np.ndarray
) -> list[float]:
    """alpha_0..alpha_{K-1}, MAT and retention of the pooled generations (``att``/``acc`` ``[G, K]``)."""
    a, s = att.sum(0), acc.sum(0)  # [K]
    alpha = [float(s[k] / a[k]) if a[k] else math.nan for k in range(att.shape[1])]
    mat = float(metrics.mat_from_counts(accepted.sum(), cycles.sum()))
    ret = metrics.retention(alpha, attempts=a.tolist()) if att.shape[1] > 6 else math.nan
    return alpha + [mat, ret]


def bootstrap_acceptance(runs, n_boot: int = 1000, seed: int = 0, steps: int = 7) -> pd.DataFrame:
    """One row per run x metric (``alpha_0`` .. ``alpha_{steps-1}``, ``mat``, ``retention``): value, lo, hi
    (the 2.5 and 97.5 percentiles of ``n_boot`` resamples of the run's generations)."""
    names = [f"alpha_{k}" for k in range(steps)] + ["mat", "retention"]
    rows = []
    for run in runs:
        G = len(run.results)
        if not G:
            continue
        att, acc = np.zeros((G, steps)), np.zeros((G, steps))
        for g, r in enumerate(run.results):
            k = min(steps, len(r.step_attempts))
            att[g, :k], acc[g, :k] = r.step_attempts[:k], r.step_accepts[:k]
        accepted = np.array([sum(r.accepted_per_cycle) for r in run.results], dtype=float)
        cycles = np.array([len(r.accepted_per_cycle) for r in run.results], dtype=float)
        point = _acceptance_stats(att, acc, accepted, cycles)
        draws = np.array(
            [_acceptance_stats(att[i], acc[i], accepted[i], cycles[i]) for i in resample(G, n_boot, seed)],
            dtype=float,
        )  # [n_boot, metrics]
        for j, name in enumerate(names):
            col = draws[:, j][~np.isnan(draws[:, j])]
            # no interval around an undefined value (retention on < MIN_ATTEMPTS pooled attempts), even where
            # some resamples happen to reach the minimum
            defined = len(col) and not math.isnan(point[j])
            lo, hi = np.percentile(col, [2.5, 97.5]).tolist() if defined else (math.nan, math.nan)
            rows.append(dict(**run.labels(), metric=name, value=point[j], lo=lo, hi=hi, n_generations=G))
    return pd.DataFrame(rows)


def generation_table(runs) -> pd.DataFrame:
    """One row per generation of each run: its index in the run, prompt length, accepted drafts and cycles; what a
    paired comparison of two drafters on the same MT-bench turns needs (:func:`paired_mat_difference`)."""
    rows = [
        dict(
            **run.labels(),
            generation=g,
            prompt_len=r.prompt_len,
            accepted=sum(r.accepted_per_cycle),
            cycles=len(r.accepted_per_cycle),
        )
        for run in runs
        for g, r in enumerate(run.results)
    ]
    return pd.DataFrame(rows)


def paired_mat_difference(
    generations: pd.DataFrame, pairs, n_boot: int = N_BOOT, seed: int = 0
) -> pd.DataFrame:
    """MAT of ``drafter`` minus MAT of ``minus`` for each ``(comparison, drafter, minus)`` of ``pairs``, per mode and
    temperature, on the same generations (one :func:`generation_table`): the point difference, its 95% interval
    and two-sided p from resampling generations in pairs, so that what the two share (a turn that is easy for
    both) cancels. Runs whose generations do not pair up (other turns, another count: at T=1 a sampled first
    turn changes the second turn's prompt) are left out."""
    rows = []
    for (mode, temperature), d in generations.groupby(["mode", "temperature"], sort=False):
        runs = {name: run.sort_values("generation") for name, run in d.groupby("drafter", sort=False)}
        for comparison, name, minus in pairs:
            a, b = runs.get(name), runs.get(minus)
            if a is None or b is None or list(a["prompt_len"]) != list(b["prompt_len"]):
                continue
            # MAT = 1 + accepted / cycles, so the difference of MATs is the difference of the two ratios
            est, _, _, draws = ratio_ci(
                np.stack([a["accepted"], b["accepted"]], 1),
                np.stack([a["cycles"], b["cycles"]], 1),
                n_boot,
                seed,
            )
            diff = draws[:, 0] - draws[:, 1]
            lo, hi = np.percentile(diff, [2.5, 97.5]).tolist()
            rows.append(
                dict(
                    comparison=comparison,
                    drafter=name,
                    minus=minus,
                    mode=mode,
                    temperature=temperature,
                    mat_diff=float(est[0] - est[1]),
                    lo=lo,
                    hi=hi,
                    p=float(two_sided_p(diff)),
                    n_generations=len(a),
                )
            )
    return pd.DataFrame(rows)
