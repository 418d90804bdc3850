"""Figures of the decoding notebooks: acceptance by draft step (03), MAT by drafter (03), speedup vs MAT and the
measured cost model (06).

Each function takes the table its notebook writes (as read back from the saved CSV) and returns a matplotlib
figure; :mod:`.figures` saves it (PDF + PNG).
"""

from __future__ import annotations

import re

import matplotlib.pyplot as plt
import pandas as pd

from .style import MODE_STYLES, PAGE, drafter_color, finish_figure, paradigm_of

_MARKERS = "osD^vP*Xhp<>"


def paradigm_keys(table: pd.DataFrame) -> dict[str, str]:
    """Per drafter, in the table's order: its paradigm's key (its recorded paradigm, or a baseline's name)."""
    recorded = {}
    if "paradigm" in table:
        recorded = dict(
            table[["drafter", "paradigm"]].drop_duplicates("drafter").itertuples(index=False, name=None)
        )
    return {name: paradigm_of(name, recorded.get(name)) for name in dict.fromkeys(table["drafter"])}


def _looks(table: pd.DataFrame) -> dict:
    """Per drafter: its paradigm's colour, and a marker that tells apart drafters of one paradigm."""
    keys = paradigm_keys(table)
    return {
        name: dict(color=drafter_color(name, key), marker=_MARKERS[i % len(_MARKERS)])
        for i, (name, key) in enumerate(keys.items())
    }


def plot_acceptance_by_step(
    table: pd.DataFrame, title: str = "Acceptance by draft step", min_attempts: int = 20
):
    """Left: alpha_k, acceptance at step k given steps 0..k-1 accepted. Right: P(steps 0..k all accepted).
    One row of panels per temperature; color = drafter, line style = chain (solid) / tree (dashed).
    Steps attempted fewer than ``min_attempts`` times are not drawn (their alpha is noise); the table
    keeps them with their ``n_attempts``."""
    temps = sorted(table["temperature"].unique())
    looks = _looks(table)
    fig, axes = plt.subplots(len(temps), 2, figsize=(PAGE, 2.4 * len(temps)), squeeze=False, sharex=True)
    for row, temp in zip(axes, temps):
        sub = table[table["temperature"] == temp]
        for (drafter, mode), d in sub.groupby(["drafter", "mode"], sort=False):
            d = d[d["n_attempts"] >= min_attempts].sort_values("step")
            kw = dict(**looks[drafter], linestyle=MODE_STYLES.get(mode, ":"))
            row[0].plot(d["step"], d["alpha_conditional"], label=f"{drafter} ({mode})", **kw)
            row[1].plot(d["step"], d["p_reach"], **kw)
        row[0].set_ylabel(f"T = {temp:g}\nconditional acceptance $\\alpha_k$")
        row[1].set_ylabel("P(first k+1 drafts accepted)")
        for ax in row:
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("draft step k")
    axes[0][0].set_title("conditional: $\\alpha_k$")
    axes[0][1].set_title("unconditional: reach probability")
    return finish_figure(fig, f"{title}  (steps with < {min_attempts} attempts not drawn)", axes[0][0])


# left to right in the MAT figure: the baselines, the control without the target, then the target readers
PARADIGM_ORDER = ("ngram", "random", "self", "early-exit", "none", "kv", "hidden", "cross", "hybrid", "block")


def stage_of(name: str) -> int:
    """A drafter's stage, from its name: 0 for another run's checkpoint (``row@run``), ``n`` for a ``-s<n>`` row
    (``hidden31-ttt-noloop-s2``), else 1."""
    if "@" in name:
        return 0
    m = re.search(r"-s(\d+)(?=-|$)", name)
    return int(m.group(1)) if m else 1


def drafter_order(table: pd.DataFrame) -> list[str]:
    """The drafters of ``table``, grouped by paradigm (:data:`PARADIGM_ORDER`, unknown ones last) and ordered by
    stage within a paradigm, a zeroed-KV control after the drafters of its stage, EAGLE-3 before EAGLE 3.1 (a
    ``31`` row: ``hidden31-ttt``); the table's order breaks ties."""
    keys, rank = paradigm_keys(table), {p: i for i, p in enumerate(PARADIGM_ORDER)}

    def key(i_name):
        i, name = i_name
        eagle31 = name.split("-")[0].endswith("31")
        return rank.get(keys[name], len(rank)), stage_of(name), "zeroed" in name, eagle31, i

    return [name for _, name in sorted(enumerate(keys), key=key)]


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
    ax.legend(frameon=False, fontsize=6)
    ax.set_title(title)
    return finish_figure(fig)
