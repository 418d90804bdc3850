"""The probes' results by draft step, their paired comparisons, and the verdict on the information gap.

Input: the per-document test table of :func:`~.probe_training.train_probes` (``kind, task, seed, doc, step,
n, ce_bits, top1, top5``). Seeds are averaged within each document (every seed tests the same examples), and
every interval is a 95% bootstrap over test documents, resampled together for all probes and steps so that
differences are paired.

* :func:`probe_results`: per kind, task and step, top-1 / top-5 agreement with the target, cross-entropy
  (bits per token), the information gain over the embedding-only probe ``IG = CE(emb) - CE(probe)``, the
  spread over seeds, and the selectivity ``top-1(real) - top-1(control)`` where a control task was run;
* :func:`pairwise_tests`: ``CE(a) - CE(b)`` for every pair of kinds at each step, with interval and p-value;
* :func:`information_gap`: ``IG(P_kv) - IG(P_h) = CE(P_h) - CE(P_kv)`` by step for each KV reader, and the
  least-squares slope of that gap over the steps; the gap *grows with k* when the slope's interval lies above 0.
  The verdict also names the steps where either side is ahead (interval clear of 0): a gap can grow from
  negative to zero without the KV cache ever holding more.
"""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd

from ..evaluation.bootstrap import N_BOOT, ratio_ci, two_sided_p

KV_READERS = ("kv_h", "kv_static", "h_kv", "kv_oracle")


def slope(y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Least-squares slope of ``y [..., len(x)]`` on ``x`` along the last axis."""
    x = np.asarray(x, dtype=float)
    xc = x - x.mean()
    return ((y - y.mean(-1, keepdims=True)) * xc).sum(-1) / (xc**2).sum()


def per_doc(table: pd.DataFrame, task: str = "real") -> dict[str, pd.DataFrame]:
    """Per metric, a wide table ``[doc, (kind, step)]`` of sums over seeds; ``n`` holds the example counts."""
    d = table[table["task"] == task]
    out = {}
    for col in ("n", "ce_bits", "top1", "top5"):
        out[col] = d.pivot_table(
            index="doc", columns=["kind", "step"], values=col, aggfunc="sum", fill_value=0
        )
    return out


def probe_results(table: pd.DataFrame, n_boot: int = N_BOOT, seed: int = 0) -> pd.DataFrame:
    """Long table: ``kind, task, step, metric, value, ci_lo, ci_hi, seed_sd, n_examples, n_docs, n_seeds``."""
    rows = []
    for task in sorted(table["task"].unique()):
        docs = per_doc(table, task)
        n = docs["n"]
        columns = list(n.columns)
        for metric in ("ce_bits", "top1", "top5"):
            est, lo, hi, _ = ratio_ci(docs[metric].to_numpy(), n.to_numpy(), n_boot, seed)
            sd = _seed_sd(table[table["task"] == task], metric)
            for c, (kind, step) in enumerate(columns):
                rows.append(
                    _row(table, task, kind, step, metric, est[c], lo[c], hi[c], sd.get((kind, step)), n)
                )
        if "emb" in n.columns.get_level_values(0):
            ce = docs["ce_bits"].to_numpy() / np.maximum(n.to_numpy(), 1)  # [docs, columns] per-doc CE
            emb = docs["ce_bits"]["emb"].to_numpy() / np.maximum(docs["n"]["emb"].to_numpy(), 1)
            for c, (kind, step) in enumerate(columns):
                steps = list(docs["n"]["emb"].columns)
                diff = emb[:, steps.index(step)] - ce[:, c]  # per-doc IG in bits
                w = n.to_numpy()[:, c]
                est, lo, hi, _ = ratio_ci((diff * w)[:, None], w[:, None], n_boot, seed)
                rows.append(_row(table, task, kind, step, "ig_bits", est[0], lo[0], hi[0], None, n))
    out = pd.DataFrame(rows)
    return pd.concat([out, _selectivity(out)], ignore_index=True)


def _row(table, task, kind, step, metric, est, lo, hi, sd, n) -> dict:
    sel = table[(table["task"] == task) & (table["kind"] == kind) & (table["step"] == step)]
    return dict(
        kind=kind,
        task=task,
        step=int(step),
        metric=metric,
        value=float(est),
        ci_lo=float(lo),
        ci_hi=float(hi),
        seed_sd=float(sd) if sd is not None else np.nan,
        n_examples=int(sel["n"].sum() / max(sel["seed"].nunique(), 1)),
        n_docs=int(sel["doc"].nunique()),
        n_seeds=int(sel["seed"].nunique()),
    )


def _seed_sd(d: pd.DataFrame, metric: str) -> dict:
    """The standard deviation over seeds of the per-seed value (sum / n over all test documents)."""
    g = d.groupby(["kind", "step", "seed"])[[metric, "n"]].sum()
    per_seed = (g[metric] / g["n"]).groupby(["kind", "step"]).std(ddof=1)
    return per_seed.to_dict()


def _selectivity(results: pd.DataFrame) -> pd.DataFrame:
    """``top-1(real) - top-1(control)`` per kind and step, where both tasks were run."""
    top1 = results[results["metric"] == "top1"].set_index(["kind", "task", "step"])["value"]
    rows = []
    for kind, task, step in top1.index:
        if task == "control" and (kind, "real", step) in top1.index:
            rows.append(
                dict(
                    kind=kind,
                    task="real",
                    step=step,
                    metric="selectivity",
                    value=float(top1[(kind, "real", step)] - top1[(kind, "control", step)]),
                )
            )
    return pd.DataFrame(rows)


def ce_difference(docs: dict[str, pd.DataFrame], a: str, b: str, n_boot: int, seed: int):
    """``CE(a) - CE(b)`` per step, paired over documents: the steps and ``ratio_ci``'s ``est, lo, hi, draws``."""
    ce_a = docs["ce_bits"][a] / docs["n"][a].clip(lower=1)
    ce_b = docs["ce_bits"][b] / docs["n"][b].clip(lower=1)
    w = docs["n"][a].to_numpy()
    return list(ce_a.columns), *ratio_ci((ce_a - ce_b).to_numpy() * w, w, n_boot, seed)


def pairwise_tests(table: pd.DataFrame, n_boot: int = N_BOOT, seed: int = 0) -> pd.DataFrame:
    """``CE(a) - CE(b)`` (bits) for every pair of kinds at every step, paired over test documents."""
    docs = per_doc(table, "real")
    kinds = list(dict.fromkeys(docs["n"].columns.get_level_values(0)))
    rows = []
    for a, b in itertools.combinations(kinds, 2):
        steps, est, lo, hi, draws = ce_difference(docs, a, b, n_boot, seed)
        p = two_sided_p(draws)
        for c, step in enumerate(steps):
            rows.append(
                dict(
                    kind_a=a,
                    kind_b=b,
                    step=int(step),
                    ce_diff_bits=float(est[c]),
                    ci_lo=float(lo[c]),
                    ci_hi=float(hi[c]),
                    p_value=float(p[c]),
                    n_docs=len(docs["n"]),
                )
            )
    return pd.DataFrame(rows)


def information_gap(table: pd.DataFrame, n_boot: int = N_BOOT, seed: int = 0) -> pd.DataFrame:
    """``IG(kv) - IG(h) = CE(h) - CE(kv)`` by step for every KV reader run, plus a ``step = -1`` row per
    reader holding the slope of the gap over the steps (bits per step) and the verdict."""
    docs = per_doc(table, "real")
    kinds = set(docs["n"].columns.get_level_values(0))
    rows = []
    for kv in [k for k in KV_READERS if k in kinds and "h" in kinds]:
        columns, est, lo, hi, draws = ce_difference(docs, "h", kv, n_boot, seed)
        p = two_sided_p(draws)
        steps = np.asarray(columns, dtype=float)
        for c, step in enumerate(columns):
            rows.append(
                dict(
                    kv_probe=kv,
                    step=int(step),
                    gap_bits=float(est[c]),
                    ci_lo=float(lo[c]),
                    ci_hi=float(hi[c]),
                    p_value=float(p[c]),
                    verdict="",
                )
            )
        s_draws = slope(draws, steps)
        s_lo, s_hi = np.nanquantile(s_draws, [0.025, 0.975])
        grows = "grows with k" if s_lo > 0 else ("shrinks with k" if s_hi < 0 else "does not grow with k")
        ahead = [int(k) for k, a in zip(columns, lo) if a > 0]  # the KV probe significantly better
        behind = [int(k) for k, b in zip(columns, hi) if b < 0]
        grows += f"; KV ahead at k = {ahead or 'none'}, hidden state ahead at k = {behind or 'none'}"
        rows.append(
            dict(
                kv_probe=kv,
                step=-1,
                gap_bits=float(slope(est, steps)),
                ci_lo=float(s_lo),
                ci_hi=float(s_hi),
                p_value=float(two_sided_p(s_draws)),
                verdict=grows,
            )
        )
    return pd.DataFrame(rows)
