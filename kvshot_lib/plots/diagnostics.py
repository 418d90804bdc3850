"""Figures of the diagnostics notebooks: information probes (01) and query-estimation error (04).

Each function takes the tables :mod:`kvshot_lib.diagnostics` writes (as read back from the saved CSV files)
and returns a matplotlib figure. Intervals over sequences come from seaborn's seeded bootstrap over the
per-sequence rows (``errorbar=("ci", 95)``, ``seed=0``), so a redraw is identical.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from .series import MAX_SERIES, pick_drafters
from .style import (
    COLUMN,
    PAGE,
    PARADIGM_COLORS,
    REGIME_STYLES,
    drafter_color,
    finish_figure,
    shade_lookalikes,
)

BASELINE_LOOKS = {  # the estimates every drafter is compared with
    "stale": dict(color="0.35", ls="--"),
    "uniform": dict(color="0.6", ls=":"),
    "oracle": dict(color="black", ls="-."),
}
PROBE_COLORS = {
    "emb": PARADIGM_COLORS["none"],
    "h": PARADIGM_COLORS["hidden"],
    "kv_static": PARADIGM_COLORS["ngram"],
    "kv_h": PARADIGM_COLORS["kv"],
    "h_kv": PARADIGM_COLORS["hybrid"],
    "kv_oracle": PARADIGM_COLORS["block"],
}
PROBE_LABELS = {
    "emb": "P_emb (token only)",
    "h": "P_h (hidden state)",
    "kv_static": "P_kv-static",
    "kv_h": "P_kv-h (query from h)",
    "h_kv": "P_h+kv",
    "kv_oracle": "P_kv-oracle (true query)",
}
ERROR_LABELS = {
    "out_err": "attention-output error\n|Σp̂v − Σp*v| / |Σp*v|",
    "kl_bits": "KL(p* ‖ p̂) (bits)",
    "unavailable_mass": "target mass on t+1..p\n(unavailable to the cache)",
}
SINK = {"with_sink": "sink kept", "without_sink": "sink removed, renormalized"}
CI = dict(errorbar=("ci", 95), n_boot=1000, seed=0)


def _looks(table: pd.DataFrame) -> dict[str, dict]:
    """Each drafter's look: colour by paradigm, line by regime (the name's suffix: ``kv-tf`` is dotted,
    ``kv-ttt`` solid), as in notebook 02's figures; a look-alike (``kv-ttt-tinit``) darker."""
    pairs = table[["drafter", "paradigm"]].drop_duplicates("drafter").itertuples(index=False, name=None)
    return shade_lookalikes(
        {
            n: dict(color=drafter_color(n, p), ls=REGIME_STYLES.get(n.rsplit("-", 1)[-1], "-"))
            for n, p in pairs
        }
    )


def _estimates(table: pd.DataFrame) -> pd.DataFrame:
    """The drafters' own rows (as many as leave room for the baselines within eight lines, grouped by paradigm
    and ordered by stage: :func:`~.series.pick_drafters`), plus the baselines once (from the first drafter: they
    do not depend on it)."""
    first = table["drafter"].iloc[0]
    own = table[table["estimator"] == "drafter"]
    drawn = pick_drafters(own, MAX_SERIES - len(BASELINE_LOOKS))
    own = own[own["drafter"].isin(drawn)].assign(line=lambda d: d["drafter"])
    own = own.iloc[own["drafter"].map({n: i for i, n in enumerate(drawn)}).argsort(kind="stable")]
    base = table[(table["estimator"] != "drafter") & (table["drafter"] == first)]
    return pd.concat([own, base.assign(line=base["estimator"])], ignore_index=True)


def _line_kw(line: str, looks: dict) -> dict:
    """A baseline's look, or a drafter's (:func:`_looks`), so that two drafters of one paradigm stay apart."""
    return BASELINE_LOOKS.get(line) or looks[line]


def plot_query_error_by_step(by_step: pd.DataFrame, metrics=("out_err", "kl_bits", "unavailable_mass")):
    """Error by draft step for each KV-reading drafter and the baselines, head level, with and without the
    sink; bands: 95% bootstrap intervals over sequences (a sequence's value averages its heads and anchors)."""
    d = _estimates(by_step[by_step["level"] == "head"] if "level" in by_step else by_step)
    looks = _looks(by_step)
    fig, axes = plt.subplots(2, len(metrics), figsize=(PAGE, 4.4), sharex=True, squeeze=False)
    for r, variant in enumerate(("with_sink", "without_sink")):
        v = d[d["variant"] == variant]
        for c, metric in enumerate(metrics):
            ax = axes[r][c]
            lines = ["oracle"] if metric == "unavailable_mass" else list(dict.fromkeys(v["line"]))
            for line in lines:
                sub = v[v["line"] == line]
                if sub[metric].notna().any():
                    kw = _line_kw(line, looks)
                    sns.lineplot(
                        data=sub,
                        x="step",
                        y=metric,
                        ax=ax,
                        label=line,
                        marker="o",
                        markersize=3,
                        color=kw["color"],
                        linestyle=kw["ls"],
                        **CI,
                    )
            ax.set_ylabel(
                ERROR_LABELS.get(metric, metric)
                if c
                else f"{SINK[variant]}\n{ERROR_LABELS.get(metric, metric)}"
            )
            ax.set_xlabel("draft step k" if r else "")
            if ax.get_legend():
                ax.get_legend().remove()
    title = "Query-estimation error by draft step: drafters vs stale query, uniform attention, oracle"
    return finish_figure(fig, title, axes[0][0], integer_steps=True)


def plot_query_error_by_head(by_head: pd.DataFrame, metric: str = "out_err"):
    """Mean error over draft steps, per target layer (columns) and query head, head level, sink kept."""
    d = by_head[(by_head["level"] == "head") & (by_head["variant"] == "with_sink")]
    d = _estimates(d)
    looks = _looks(by_head)
    layers = sorted(d["layer"].unique())
    fig, axes = plt.subplots(1, len(layers), figsize=(PAGE, 2.5), sharey=True, squeeze=False)
    for ax, layer in zip(axes[0], layers):
        sub = d[d["layer"] == layer]
        for line in dict.fromkeys(sub["line"]):
            g = sub[sub["line"] == line].groupby("head")[metric].mean()
            if g.notna().any() and line != "oracle":
                kw = _line_kw(line, looks)
                ax.plot(g.index, g.values, marker="o", label=line, color=kw["color"], ls=kw["ls"])
        matched = sub[(sub["estimator"] == "drafter") & sub["matched"].astype(bool)]
        for line, g in matched.groupby("drafter"):
            m = g.groupby("head")[metric].mean()
            ax.scatter(m.index, m.values, s=40, facecolors="none", edgecolors=_line_kw(line, looks)["color"])
        ax.set_title(f"target layer {layer}")
        ax.set_xlabel("target query head")
    axes[0][0].set_ylabel(ERROR_LABELS.get(metric, metric) + "\n(mean over steps)")
    title = "Error by layer and head (circled: the head a drafter query matches best)"
    return finish_figure(fig, title, axes[0][0], integer_steps=True)


def plot_query_error_vs_acceptance(vs_acc: pd.DataFrame, metric: str = "out_err"):
    """The drafter's error at the steps it got right (accepted) and wrong, by draft step, sink kept;
    the stale query's error on the same steps for reference. Bands: 95% bootstrap over sequences."""
    d = vs_acc[(vs_acc["variant"] == "with_sink") & vs_acc["estimator"].isin(["drafter", "stale"])]
    drafters = list(dict.fromkeys(d["drafter"]))
    fig, axes = plt.subplots(
        1, len(drafters), figsize=(max(COLUMN, 2.6 * len(drafters)), 2.6), squeeze=False, sharey=True
    )
    for ax, name in zip(axes[0], drafters):
        for (est, accepted), g in d[d["drafter"] == name].groupby(["estimator", "accepted"]):
            color = "C2" if accepted else "C3"
            sns.lineplot(
                data=g,
                x="step",
                y=metric,
                ax=ax,
                color=color,
                linestyle="-" if est == "drafter" else "--",
                marker="o" if est == "drafter" else None,
                markersize=3,
                label=f"{est}, {'accepted' if accepted else 'rejected'} steps",
                **CI,
            )
        ax.set_title(name)
        ax.set_xlabel("draft step k")
        ax.set_ylabel(ERROR_LABELS.get(metric, metric))
        ax.legend(frameon=False, fontsize=6)
    return finish_figure(fig, "Query error at accepted vs rejected draft steps", integer_steps=True)


def plot_causal_check(causal: pd.DataFrame):
    """α_k with the drafter's query replaced by (1−λ)q̂ + λq*, for each λ; bars: 95% bootstrap intervals."""
    drafters = list(dict.fromkeys(causal["drafter"]))
    fig, axes = plt.subplots(
        1, len(drafters), figsize=(max(COLUMN, 2.8 * len(drafters)), 2.6), squeeze=False, sharey=True
    )
    lams = sorted(causal["lam"].unique())
    colors = sns.color_palette("rocket_r", len(lams) + 1)[1:]
    for ax, name in zip(axes[0], drafters):
        for color, lam in zip(colors, lams):
            g = causal[(causal["drafter"] == name) & (causal["lam"] == lam) & (causal["n_attempts"] >= 20)]
            g = g.sort_values("step")
            mat = g["mat"].iloc[0] if len(g) else np.nan
            ax.errorbar(
                g["step"],
                g["alpha_conditional"],
                yerr=[g["alpha_conditional"] - g["ci_lo"], g["ci_hi"] - g["alpha_conditional"]],
                color=color,
                marker="o",
                capsize=2,
                label=f"λ = {lam:g} (MAT {mat:.2f})",
            )
        ax.set_title(name)
        ax.set_xlabel("draft step k")
        ax.set_ylabel("conditional acceptance $\\alpha_k$")
        ax.legend(frameon=False, fontsize=6)
    title = "Causal check: acceptance with the query moved towards the target's (chain, T=0)"
    return finish_figure(fig, title, integer_steps=True)


def plot_probe_results(results: pd.DataFrame):
    """Top-1 agreement, cross-entropy and information gain over the token-only probe, by step, per probe
    (real task); bands: 95% bootstrap intervals over test documents (seeds averaged)."""
    d = results[results["task"] == "real"]
    metrics = [
        ("top1", "top-1 agreement with the target"),
        ("ce_bits", "cross-entropy (bits/token)"),
        ("ig_bits", "information gain over P_emb (bits)"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(PAGE, 2.6), sharex=True)
    for ax, (metric, label) in zip(axes, metrics):
        for kind in PROBE_COLORS:
            g = d[(d["kind"] == kind) & (d["metric"] == metric)].sort_values("step")
            if g.empty:
                continue
            ax.plot(g["step"], g["value"], marker="o", color=PROBE_COLORS[kind], label=PROBE_LABELS[kind])
            ax.fill_between(g["step"], g["ci_lo"], g["ci_hi"], color=PROBE_COLORS[kind], alpha=0.15, lw=0)
        ax.set_xlabel("k (predicting the token at t+1+k)")
        ax.set_ylabel(label)
    axes[2].axhline(0, color="0.5", lw=0.8)
    title = "What the target holds at t about its token at t+1+k (probes of equal size, frozen LM head)"
    return finish_figure(fig, title, axes[0], integer_steps=True)


def plot_information_gap(gap: pd.DataFrame):
    """IG(P_kv) − IG(P_h) by step for each KV reader, with 95% bootstrap intervals over test documents;
    the legend gives the slope over k and the verdict."""
    fig, ax = plt.subplots(figsize=(COLUMN * 1.4, 2.6))
    for kind, g in gap.groupby("kv_probe", sort=False):
        by_step, trend = g[g["step"] >= 0].sort_values("step"), g[g["step"] < 0]
        label = PROBE_LABELS.get(kind, kind)
        if len(trend):
            t = trend.iloc[0]
            label += f": slope {t['gap_bits']:+.3f} [{t['ci_lo']:+.3f}, {t['ci_hi']:+.3f}] bits/step, {t['verdict'].split(';')[0]}"
        color = PROBE_COLORS.get(kind, "C0")
        ax.plot(by_step["step"], by_step["gap_bits"], marker="o", color=color, label=label)
        ax.fill_between(by_step["step"], by_step["ci_lo"], by_step["ci_hi"], color=color, alpha=0.15, lw=0)
    ax.axhline(0, color="0.4", lw=0.8)
    ax.set_xlabel("k (predicting the token at t+1+k)")
    ax.set_ylabel("IG(P_kv) − IG(P_h) (bits)")
    ax.legend(frameon=False, fontsize=5.5, loc="upper left", bbox_to_anchor=(0, -0.32))
    ax.set_title("Information gap, KV cache vs hidden state")
    return finish_figure(fig, integer_steps=True)
