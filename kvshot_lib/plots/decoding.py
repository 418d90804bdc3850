"""Figures of the decoding notebooks: MAT by drafter (03), speedup vs MAT and the measured cost model (06); acceptance
by draft step (03) is :mod:`.acceptance`'s.

Each function takes the table its notebook writes (as read back from the saved CSV) and returns a matplotlib
figure; :mod:`.figures` saves it (PDF + PNG).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from .series import drafter_order, paradigm_keys
from .style import PAGE, drafter_color, finish_figure

_MARKERS = "osD^vP*Xhp<>"


def _looks(table: pd.DataFrame) -> dict:
    """Per drafter, grouped by paradigm and ordered by stage: its paradigm's colour, and a marker that tells apart
    drafters of one paradigm."""
    keys = paradigm_keys(table)
    return {
        name: dict(color=drafter_color(name, keys[name]), marker=_MARKERS[i % len(_MARKERS)])
        for i, name in enumerate(drafter_order(table))
    }


def plot_mat_by_drafter(
    summary: pd.DataFrame,
    bootstrap: pd.DataFrame | None = None,
    title: str = "Mean accepted tokens per cycle (MAT, τ)",
):
    """One panel per mode x temperature, a horizontal bar per drafter in its paradigm's colour, drafters grouped
    by paradigm and ordered by stage (:func:`drafter_order`), each with its 95% bootstrap interval where
    ``bootstrap`` (``acceptance_bootstrap.csv``) has one."""
    keys, drafters = paradigm_keys(summary), drafter_order(summary)
    y, gap = [], 0.0  # a gap between paradigms
    for i, name in enumerate(drafters):
        gap += 0.6 if i and keys[name] != keys[drafters[i - 1]] else 0.0
        y.append(i + gap)
    has_intervals = bootstrap is not None and not bootstrap.empty
    where = ["drafter", "mode", "temperature"]
    mats = bootstrap[bootstrap["metric"] == "mat"].set_index(where) if has_intervals else pd.DataFrame()
    panels = sorted(summary.groupby(["mode", "temperature"]).groups, key=lambda mt: (mt[1], mt[0]))
    fig, axes = plt.subplots(
        1, len(panels), figsize=(PAGE, 1.3 + 0.17 * y[-1]), sharex=True, sharey=True, squeeze=False
    )
    for ax, (mode, temp) in zip(axes[0], panels):
        d = summary[(summary["mode"] == mode) & (summary["temperature"] == temp)].set_index("drafter")
        for yi, name in zip(y, drafters):
            if name not in d.index:
                continue
            mat = float(d.at[name, "mat"])
            color = drafter_color(name, keys[name])
            ax.barh(yi, mat, 0.8, color=color, alpha=0.9 if temp == 0 else 0.55)
            if (name, mode, temp) in mats.index:
                lo, hi = mats.loc[(name, mode, temp), ["lo", "hi"]]
                err = [[max(0.0, mat - lo)], [max(0.0, hi - mat)]]
                ax.errorbar(mat, yi, xerr=err, color="0.15", lw=0.8, capsize=1.5)
        ax.axvline(1.0, color="gray", lw=0.8, ls=":")
        ax.set_title(f"{mode}, T = {temp:g}")
        ax.set_xlabel("MAT τ (tokens per cycle)")
        ax.grid(axis="y", visible=False)
    axes[0][0].set_yticks(y, drafters)
    axes[0][0].invert_yaxis()
    interval = " · bars: 95% bootstrap interval" if has_intervals else ""
    return finish_figure(fig, title + interval)


SPECULATIVE = ("chain", "tree", "chain_chosen", "tree_chosen", "combined")
_METHOD_MARKERS = {"chain": "o", "tree": "^", "chain_chosen": "s", "tree_chosen": "D", "combined": "*"}


def plot_speedup_vs_mat(table: pd.DataFrame, title: str | None = None):
    """Speedup over our plain decoding (same precision, same run) against MAT: one point per speculative method
    and drafter, filled in bf16 and hollow in float32, with the min-max range over repetitions where the table
    has one; HF generate baselines (which have no MAT here) as horizontal lines."""
    fig, ax = plt.subplots(figsize=(PAGE * 0.7, 3.2))
    precision = table["precision"] if "precision" in table else pd.Series("fp32", index=table.index)
    spec = table[table["method"].isin(SPECULATIVE)]
    looks = _looks(spec)
    for i, r in spec.iterrows():
        bf16 = precision[i] != "fp32"
        color = looks[r["drafter"]]["color"]
        y = r["speedup_vs_ar"]
        if "speedup_min" in r and r["speedup_min"] == r["speedup_min"]:
            ax.errorbar(r["mat"], y, [[y - r["speedup_min"]], [r["speedup_max"] - y]], color=color, lw=0.8)
        ax.scatter(
            r["mat"],
            y,
            marker=_METHOD_MARKERS[r["method"]],
            s=60 if r["method"] == "combined" else 40,
            facecolors=color if bf16 else "none",
            edgecolors=color,
            alpha=1.0 if r["temperature"] == 0 else 0.5,
        )
    for i, (_, r) in enumerate(table[table["method"].str.startswith("hf_")].iterrows()):
        label = f"{r['method']} {precision[r.name]} (T={r['temperature']:g}): {r['speedup_vs_ar']:.2f}x"
        ax.axhline(
            r["speedup_vs_ar"],
            color=f"C{i + 3}",
            lw=1,
            ls="--" if precision[r.name] == "fp32" else ":",
            label=label,
        )
    ax.axhline(1.0, color="black", lw=0.8, label="plain decoding (ours), each precision")
    # the legend names what colour (drafter) and shape (method) mean, instead of a label beside each point:
    # points of one drafter and method in both precisions sit close, and their labels collided
    for name, look in looks.items():
        ax.scatter([], [], marker="o", facecolors=look["color"], edgecolors=look["color"], label=name)
    for method, marker in _METHOD_MARKERS.items():
        if (spec["method"] == method).any():
            ax.scatter([], [], marker=marker, facecolors="0.85", edgecolors="0.2", label=method)  # shape only
    ax.set_xlabel("MAT τ (tokens per cycle)")
    ax.set_ylabel("speedup vs plain decoding (×, same run)")
    machine = table["machine"].iloc[0] if "machine" in table and len(table) else ""
    ax.set_title(title or f"End-to-end speedup on {machine} (filled: bf16, hollow: fp32)")
    return finish_figure(fig, legend_from=ax, fontsize=5.5)


def plot_cost_model(costs: pd.DataFrame, title: str = "What one cycle costs: the measured cost model"):
    """Milliseconds of one target forward over a k-token block (chain: causal; tree: tree mask) for each
    precision, and each drafter's call costs as dotted levels: from the long-form table
    ``precision, part, drafter, n, seconds`` that notebook 06 saves."""
    fig, ax = plt.subplots(figsize=(PAGE * 0.6, 2.8))
    colors = {p: f"C{i}" for i, p in enumerate(dict.fromkeys(costs["precision"]))}
    for (p, part), d in costs[costs["part"].isin(["verify_chain", "verify_tree"])].groupby(
        ["precision", "part"]
    ):
        d = d.sort_values("n")
        style = "-" if part == "verify_chain" else "--"
        ax.plot(
            d["n"], 1e3 * d["seconds"], style, color=colors[p], marker=".", label=f"verify {part[7:]}, {p}"
        )
    starts = costs[costs["part"] == "draft_start"]
    for i, r in enumerate(starts.itertuples()):
        ax.axhline(1e3 * r.seconds, color=colors[r.precision], ls=":", lw=0.8)
        ax.annotate(
            f"{r.drafter} draft call, {r.precision}",
            (1, 1e3 * r.seconds),
            fontsize=5,
            xytext=(2, 2 + 6 * (i % 2)),
            textcoords="offset points",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block tokens k (root + drafts)")
    ax.set_ylabel("ms per target forward")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a table with drafter calls only has no lines to name
        ax.legend(frameon=False, fontsize=6)
    ax.set_title(title)
    return finish_figure(fig)
