"""Figures of drafter training (notebook 02), one function each (the K/V-gradient probes of notebook 05: :mod:`.probes`).

Every function takes the tables that :mod:`kvshot_lib.training` writes (pandas DataFrames, as read back from
the saved CSV files) and returns a matplotlib figure; :mod:`.figures` saves it.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import NullFormatter

from .series import MAX_SERIES, drafter_order, drafter_rows, left_out, paradigm_keys, pick_drafters
from .style import PAGE, REGIME_STYLES, drafter_color, shade_lookalikes


def _style(name: str, paradigm: str, regime: str, target_kv: str = "real") -> dict:
    """Colour by paradigm, line by regime; a control trained with the target KV zeroed is drawn faded, with
    hollow markers, beside the drafter it controls."""
    style = dict(color=drafter_color(name, paradigm), ls=REGIME_STYLES.get(regime, "-"))
    if target_kv == "zeroed":
        style.update(alpha=0.55, markerfacecolor="white")
    return style


def _styles(df: pd.DataFrame) -> dict[str, dict]:
    """:func:`_style` of the drafters of ``df`` that a figure draws (at most eight: :func:`~.series.pick_drafters`),
    look-alikes told apart (:func:`~.style.shade_lookalikes`)."""
    drawn = set(pick_drafters(df))
    return shade_lookalikes(
        {name: _style(name, *style) for name, *style in drafter_rows(df) if name in drawn}
    )


def wilson_interval(p, n, z: float = 1.96):
    """The 95% Wilson score interval of a proportion ``p`` measured on ``n`` trials (arrays)."""
    p, n = np.asarray(p, float), np.maximum(np.asarray(n, float), 1)
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def _legend_outside(fig, handles, labels, extra=()) -> None:
    """One legend for the figure, right of the axes, so that it never covers a curve; ``extra`` handles last
    (:func:`~.series.left_out`)."""
    handles, labels = [*handles, *extra], [*labels, *(h.get_label() for h in extra)]
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)


def plot_training_curves(history: pd.DataFrame, smooth: int = 10):
    """Training loss and training step-0 agreement with the target, per drafter, against optimizer steps: a rolling
    mean of ``smooth`` steps (of fewer rows where a row holds a block of ``steps``, as the reference runs' tables)."""
    fig, axes = plt.subplots(1, 2, figsize=(PAGE, 2.6))
    styles = _styles(history)
    for name, style in styles.items():
        h = history[history["drafter"] == name].sort_values("step")
        window = (
            max(1, smooth // int(h["steps"].max())) if "steps" in h and h["steps"].notna().all() else smooth
        )
        kw = dict(**style, label=name, lw=1.4)
        axes[0].plot(h["step"], h["loss"].rolling(window, min_periods=1).mean(), **kw)
        axes[1].plot(h["step"], h["acc_0"].rolling(window, min_periods=1).mean(), **kw)
    axes[0].set_yscale("log")
    axes[0].set_ylabel(f"training loss (rolling mean of {smooth})")
    axes[1].set_ylabel("step-0 top-1 agreement with the target (train)")
    for ax in axes:
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    fig.suptitle(
        "Drafter training (color: paradigm, line: regime — dotted tf, solid TTT, dashed TTT-dense, "
        "dash-dot parallel; faded: trained with the target KV zeroed)"
    )
    fig.tight_layout()
    _legend_outside(
        fig, *axes[1].get_legend_handles_labels(), left_out(history, styles, "training_history.csv")
    )
    return fig


def plot_per_step_accuracy(per_step: pd.DataFrame):
    """Held-out accuracy by draft step k (left) and retention acc_k / acc_0 (right), per drafter."""
    fig, axes = plt.subplots(1, 2, figsize=(PAGE, 2.7))
    styles = _styles(per_step)
    for name, style in styles.items():
        d = per_step[per_step["drafter"] == name].sort_values("draft_step")
        kw = dict(**style, marker="o", label=name)
        axes[0].plot(d["draft_step"], d["accuracy"], **kw)
        if "n" in d:
            lo, hi = wilson_interval(d["accuracy"], d["n"])
            axes[0].fill_between(d["draft_step"], lo, hi, color=kw["color"], alpha=0.12, lw=0)
        axes[1].plot(d["draft_step"], d["accuracy"] / d["accuracy"].iloc[0], **kw)
    if "ceiling" in per_step and per_step["ceiling"].notna().any():
        axes[0].set_title(
            f"ceiling (target token in the draft vocabulary): {per_step['ceiling'].max():.2f}", fontsize=9
        )
    axes[0].set_ylim(0, None)
    axes[0].set_ylabel("held-out accuracy at draft step k\n(draft argmax = target's greedy token)")
    axes[1].set_ylabel("retention  acc_k / acc_0")
    for ax in axes:
        ax.set_xlabel("draft step k")
        ax.grid(alpha=0.3)
    fig.suptitle("Long-range decay: per-step accuracy on held-out ShareGPT (teacher-forced prefix)")
    fig.tight_layout()
    _legend_outside(
        fig, *axes[0].get_legend_handles_labels(), left_out(per_step, styles, "per_step_accuracy.csv")
    )
    return fig


def _cross_drafters(table: pd.DataFrame) -> list[str]:
    """At most eight drafters, shared out between the kinds of answers they trained on (each kind's headlines
    first: :func:`~.series.pick_drafters`), grouped by paradigm and ordered by stage."""
    kinds = list(dict.fromkeys(table["trained_on"]))
    chosen = set()
    for i, kind in enumerate(kinds):
        share = MAX_SERIES // len(kinds) + (i < MAX_SERIES % len(kinds))
        chosen.update(pick_drafters(table[table["trained_on"] == kind], share))
    return [n for n in drafter_order(table) if n in chosen]


def plot_heldout_cross(table: pd.DataFrame):
    """One panel per held-out set (ShareGPT's original answers, the target's own, the target's with its loops cut):
    per-step accuracy of every drafter, solid where it trained on that panel's kind of answers and dashed where it
    trained on the other, with 95% Wilson bands and the token-passes each trained for in the legend."""
    sets = list(dict.fromkeys(table["heldout"]))
    fig, axes = plt.subplots(1, len(sets), figsize=(PAGE, 2.8), sharey=True, squeeze=False)
    paradigm = paradigm_keys(table)
    looks = shade_lookalikes(
        {
            name: dict(color=drafter_color(name, paradigm[name]), ls="-" if "@" not in name else "--")
            for name in _cross_drafters(table)
        }
    )
    for ax, held in zip(axes[0], sets):
        part = table[table["heldout"] == held]
        for name in looks:
            d = part[part["drafter"] == name].sort_values("draft_step")
            if d.empty:
                continue
            passes = d["token_passes"].iloc[0]
            label = f"{name} ({d['trained_on'].iloc[0]}, {passes / 1e6:.1f}M)" if pd.notna(passes) else name
            ax.plot(d["draft_step"], d["accuracy"], marker="o", ms=3, label=label, **looks[name])
            lo, hi = wilson_interval(d["accuracy"], d["n"])
            ax.fill_between(d["draft_step"], lo, hi, color=looks[name]["color"], alpha=0.12, lw=0)
        ceiling = f"{part['ceiling'].min():.2f}–{part['ceiling'].max():.2f}"
        ax.set_title(f"{held} answers\n(held out; ceiling {ceiling})", fontsize=9)
        ax.set_xlabel("draft step k")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylim(0, None)
    axes[0][0].set_ylabel("held-out accuracy at draft step k")
    fig.suptitle("Each drafter on each held-out set (legend: the answers it trained on, token-passes)")
    fig.tight_layout()
    _legend_outside(fig, *axes[0][0].get_legend_handles_labels(), left_out(table, looks, "heldout_cross.csv"))
    return fig


CONDITION_STYLES = {"real": "-", "shuffled": "--", "zeroed": ":"}


def _margin_over_control(real: pd.DataFrame, control: pd.DataFrame) -> str:
    """What a panel of ``plot_kv_ablation`` shows, in words: the drafter's lead over its control by step, and at
    how many steps their 95% Wilson intervals are apart."""
    r, c = (x.set_index("draft_step").sort_index() for x in (real, control))
    r, c = r.loc[r.index.intersection(c.index)], c.loc[r.index.intersection(c.index)]
    lead = r["accuracy"] - c["accuracy"]
    (r_lo, r_hi), (c_lo, c_hi) = (
        wilson_interval(r["accuracy"], r["n"]),
        wilson_interval(c["accuracy"], c["n"]),
    )
    apart = int(((r_lo > c_hi) | (r_hi < c_lo)).sum())
    return f"real − control: {lead.min():+.3f} to {lead.max():+.3f}\nintervals apart at {apart} of {len(lead)} steps"


def plot_kv_ablation(table: pd.DataFrame):
    """One panel per KV-reading drafter: held-out accuracy by draft step with the target KV real, shuffled
    (another conversation's) and zeroed, with 95% Wilson bands; a drafter trained with the KV zeroed (the
    control) is drawn in grey in the panel of the drafter it controls."""
    trained = table[table["trained_with"] == "real"]
    controls = table[(table["trained_with"] == "zeroed") & (table["condition"] == "real")]
    names = list(dict.fromkeys(trained["drafter"]))
    fig, axes = plt.subplots(1, max(1, len(names)), figsize=(PAGE, 2.6), sharey=True, squeeze=False)
    for ax, name in zip(axes[0], names):
        d = trained[trained["drafter"] == name]
        color = drafter_color(name, d["paradigm"].iloc[0])
        for condition, c in d.groupby("condition", sort=False):
            c = c.sort_values("draft_step")
            ax.plot(
                c["draft_step"],
                c["accuracy"],
                ls=CONDITION_STYLES.get(condition, "-"),
                color=color,
                marker="o",
                label=f"KV {condition}",
            )
            lo, hi = wilson_interval(c["accuracy"], c["n"])
            ax.fill_between(c["draft_step"], lo, hi, color=color, alpha=0.15, lw=0)
        same = controls[
            (controls["paradigm"] == d["paradigm"].iloc[0]) & (controls["regime"] == d["regime"].iloc[0])
        ]
        for _, c in same.groupby("drafter", sort=False):
            c = c.sort_values("draft_step")
            ax.plot(
                c["draft_step"],
                c["accuracy"],
                color=drafter_color("none"),
                marker="s",
                label="control (trained with KV zeroed)",
            )
            lo, hi = wilson_interval(c["accuracy"], c["n"])
            ax.fill_between(c["draft_step"], lo, hi, color=drafter_color("none"), alpha=0.2, lw=0)
            ax.text(
                0.03,
                0.03,
                _margin_over_control(d[d["condition"] == "real"], c),
                transform=ax.transAxes,
                fontsize=5.5,
            )
        ax.set_title(name)
        ax.set_xlabel("draft step k")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylim(0, max(1.08 * table["accuracy"].max(), 0.05))  # a smoke run may accept nothing
    axes[0][0].set_ylabel("held-out accuracy at draft step k")
    fig.suptitle("Does the drafter read what the target's KV holds? (same held-out positions)")
    fig.tight_layout()
    handles = {}  # one entry per label, in the colour of the first panel that has it
    for ax in axes[0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    _legend_outside(fig, list(handles.values()), list(handles))
    return fig


def plot_heldout_over_training(evals: pd.DataFrame, steps: tuple[int, ...] = (0, 3, 6)):
    """Held-out accuracy at a few draft steps over the course of training, per drafter."""
    steps = [k for k in steps if f"acc_{k}" in evals]
    fig, axes = plt.subplots(1, len(steps), figsize=(PAGE, 2.4), sharey=True, squeeze=False)
    styles = _styles(evals)
    for ax, k in zip(axes[0], steps):
        for name, style in styles.items():
            e = evals[evals["drafter"] == name].sort_values("step")
            ax.plot(e["step"], e[f"acc_{k}"], **style, marker=".", label=name)
        ax.set_title(f"draft step {k}")
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out accuracy")
    fig.tight_layout()
    _legend_outside(
        fig, *axes[0][-1].get_legend_handles_labels(), left_out(evals, styles, "heldout_eval.csv")
    )
    return fig


CURVE_TITLES = {"acc_0": "acc$_0$", "acc_3": "acc$_3$", "acc_6": "acc$_6$", "mat": "formula MAT"}


def plot_learning_curves(
    curves: pd.DataFrame, fits: pd.DataFrame | None = None, stopped: pd.DataFrame | None = None
):
    """Held-out acc_0, acc_3, acc_6 and the formula MAT against training tokens (log x), one panel each, with
    95% intervals, for every drafter and its control; the fitted asymptote ``a`` of ``a - b N^-c`` as a short
    tick at the right edge of each panel, where the points identify one (``fits["identified"]``).

    ``stopped``: the points of rows whose training stopped before their plateau or cap (the same columns), drawn
    beside the others as "<row> (stopped)", with no asymptote. At most eight drafters: the stopped rows, and as
    many finished ones as leave room (:func:`~.series.pick_drafters`)."""
    halted = [] if stopped is None else list(dict.fromkeys(stopped["drafter"] + " (stopped)"))[:MAX_SERIES]
    drawn = {*halted, *pick_drafters(curves, MAX_SERIES - len(halted))}
    if halted:
        curves = pd.concat(
            [curves, stopped.assign(drafter=stopped["drafter"] + " (stopped)")], ignore_index=True
        )
    metrics = [m for m in CURVE_TITLES if m in set(curves["metric"])]
    fig, axes = plt.subplots(1, len(metrics), figsize=(PAGE, 2.7), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        m = curves[(curves["metric"] == metric) & curves["drafter"].isin(drawn)]
        for name, kw in _styles(m).items():
            d = m[m["drafter"] == name].sort_values("tokens")
            ax.errorbar(
                d["tokens"],
                d["value"],
                yerr=[d["value"] - d["lo"], d["hi"] - d["value"]],
                marker="o",
                ms=3,
                capsize=1.5,
                lw=1.2,
                label=name,
                **kw,
            )
            if fits is not None and len(fits):
                f = fits[(fits["drafter"] == name) & (fits["metric"] == metric)]
                if len(f) and f["identified"].iloc[0]:
                    ax.plot(
                        [1.0], [f["a"].iloc[0]], marker="_", ms=9, mew=1.5, color=kw["color"],
                        alpha=kw.get("alpha", 1.0), transform=ax.get_yaxis_transform(), clip_on=False,
                    )  # fmt: skip
        ax.set_xscale("log")
        # under two decades matplotlib labels the minor ticks too, and they collide
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(CURVE_TITLES[metric])
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("held-out value after a WSD decay")
    fig.supxlabel("training tokens (token-passes, log scale)", fontsize=8)
    fig.suptitle(
        "Learning curves: each point is an annealed drafter at that budget (ticks: identified asymptotes)"
    )
    fig.tight_layout()
    _legend_outside(
        fig, *axes[0][0].get_legend_handles_labels(), left_out(curves, drawn, "learning_curves.csv")
    )
    return fig
