"""The MT-bench acceptance gap, decomposed (:mod:`kvshot_lib.diagnostics.mtbench_gap`): where held-out accuracy
is lost on the way to MT-bench chain alpha_0, and where on the answer and at what confidence the drafters miss.

Drawn from ``mtbench_gap.csv`` (the parts with 95% bootstrap intervals) and ``mtbench_gap_bins.csv`` (accuracy by
answer position and by the target's top-1 probability, on both sets).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from .series import MAX_SERIES, left_out, pick_drafters
from .style import PAGE, drafter_color, finish_figure, shade_lookalikes

PARTS = {  # the decomposition's parts, in the order the gap is crossed (the caption says what each compares)
    "answer_position": "answer\nposition",
    "prompt_distribution": "prompts",
    "cycle_selection": "cycle\nstarts",
    "cycle_residual": "residual",
    "total": "total",
}
SETS = {"heldout": "-", "mtbench": "--"}  # held-out conversations, MT-bench references


def _looks(drafters) -> dict[str, dict]:
    return shade_lookalikes({d: dict(color=drafter_color(d)) for d in drafters})


def plot_mtbench_gap(gap: pd.DataFrame, bins: pd.DataFrame):
    """Three panels: the gap's parts per drafter (bars, 95% intervals), then step-0 accuracy by answer position and
    by the target's top-1 probability, held-out (solid) against MT-bench (dashed)."""
    drafters = pick_drafters(gap[["drafter"]].drop_duplicates(), MAX_SERIES // len(SETS))  # two lines each
    looks = _looks(drafters)
    fig, axes = plt.subplots(1, 3, figsize=(PAGE * 1.15, 2.6), gridspec_kw=dict(width_ratios=[1.5, 1, 1]))
    ax = axes[0]
    comp = gap[gap["kind"] == "component"]
    x, width = np.arange(len(PARTS)), 0.8 / max(len(drafters), 1)
    for i, d in enumerate(drafters):
        part = comp[comp["drafter"] == d].set_index("name").reindex(list(PARTS))
        err = np.vstack([part["value"] - part["lo"], part["hi"] - part["value"]])  # [2, parts]
        ax.bar(x + (i - (len(drafters) - 1) / 2) * width, part["value"], width, yerr=err, capsize=1.5,
               label=d, **looks[d])  # fmt: skip
    ax.axhline(0, color="0.3", lw=0.6)
    ax.set_xticks(x, list(PARTS.values()), fontsize=6.5)
    ax.set_ylabel("acc_0 lost")
    ax.set_title("held-out acc_0 to MT-bench alpha_0")
    for ax, by, label in (
        (axes[1], "answer_pos", "answer position of the token"),
        (axes[2], "p1", "target top-1 prob."),
    ):
        b = bins[(bins["by"] == by) & (bins["k"] == 0)]
        order = list(dict.fromkeys(b.sort_values("bin", key=_bin_start)["bin"]))
        for d in drafters:
            for s, ls in SETS.items():
                one = b[(b["drafter"] == d) & (b["set"] == s)].set_index("bin").reindex(order)
                ax.plot(range(len(order)), one["accuracy"], ls=ls, marker="o", color=looks[d]["color"])
        ax.set_xticks(range(len(order)), [_short(o) for o in order], fontsize=6)
        ax.set_xlabel(label)
        ax.set_ylabel("teacher-forced acc_0")
        ax.set_ylim(0, 1)
    axes[1].set_title("where on the answer")
    axes[2].set_title("how sure the target was")
    for s, ls in SETS.items():
        axes[0].plot(
            [],
            [],
            ls=ls,
            color="0.3",
            label={"heldout": "held-out (lines)", "mtbench": "MT-bench (lines)"}[s],
        )
    for extra in left_out(gap, drafters, "mtbench_gap.csv"):
        axes[0].plot([], [], ls="none", label=extra.get_label())
    return finish_figure(fig, legend_from=axes[0])


def _bin_start(col: pd.Series) -> pd.Series:
    """Sort bins such as ``[0.3, 0.5)`` or ``[16, 32)`` by their lower edge (a turn, ``1``, by its number)."""
    return col.map(lambda s: float(str(s).strip("[(").split(",")[0]))


def _short(label: str) -> str:
    """``[16, 32)`` -> ``16-31``; ``[0.3, 0.5)`` -> ``.3-.5``; ``[64, 1000000000)`` -> ``64+``."""
    lo, hi = (v.strip() for v in label.strip("[)").split(","))
    if float(hi) >= 1e9:
        return f"{lo}+"
    if "." in lo or "." in hi:
        return f"{float(lo):.1f}-{min(float(hi), 1.0):.1f}".replace("0.", ".")
    return f"{lo}-{int(hi) - 1}"


UNSEEN = {"later training conversations": ("o", "-"), "held-out split": ("s", ":")}  # marker, line style
PAIR_LOOKS = (("0.2", "D"), ("0.55", "^"), ("0.2", "v"))  # color, marker of each paired series


def plot_memorization_gap(gap: pd.DataFrame, paired: pd.DataFrame | None = None):
    """Seen minus unseen conversations per draft step, accuracy and cross-entropy, 95% intervals: one line per
    drafter and unseen set (later training conversations solid, the held-out split dotted); a memorizing drafter
    sits above zero in accuracy and below it in cross-entropy. With ``paired`` (``memorization_paired.csv``), a
    third panel: how much more one drafter gains on its seen conversations than another, paired by conversation."""
    series = gap[["drafter", "unseen_set"]].drop_duplicates()  # one line each
    limit = series["drafter"].nunique() if len(series) <= MAX_SERIES else MAX_SERIES // len(UNSEEN)
    drafters = pick_drafters(gap[["drafter"]].drop_duplicates(), limit)
    looks = _looks(drafters)
    panels = [("acc", "accuracy, seen - unseen"), ("ce", "cross-entropy, seen - unseen")]
    fig, axes = plt.subplots(
        1, 2 + (paired is not None), figsize=(PAGE * (0.9 if paired is None else 1.15), 2.5)
    )
    for ax, (measure, label) in zip(axes, panels):
        for d in drafters:
            for j, (unseen, (marker, ls)) in enumerate(UNSEEN.items()):
                one = gap[(gap["drafter"] == d) & (gap["unseen_set"] == unseen) & (gap["measure"] == measure)]
                if not one.empty:
                    _gap_line(ax, one, "gap", j, color=looks[d]["color"], marker=marker, ls=ls,
                              label=f"{d} vs {unseen}")  # fmt: skip
        ax.set_ylabel(label)
        ax.set_title(f"memorized? {label.split(',')[0]}")
    if paired is not None:
        ax = axes[2]
        pairs = list(paired[paired["measure"] == "acc"].groupby(["drafter", "minus"], sort=False))
        for j, ((x, y), one) in enumerate(pairs[: len(PAIR_LOOKS)]):
            color, marker = PAIR_LOOKS[j]
            _gap_line(ax, one, "did", j, color=color, marker=marker, ls="-")
            axes[0].plot([], [], color=color, marker=marker, label=f"paired (right): {x} - {y}")
        ax.set_ylabel("x - y: seen minus held-out")
        ax.set_title("paired: accuracy, x - y")
    for ax in axes:
        ax.axhline(0, color="0.3", lw=0.6)
        ax.set_xlabel("draft step k")
    for extra in left_out(gap, drafters, "memorization_gap.csv"):
        axes[0].plot([], [], ls="none", label=extra.get_label())
    return finish_figure(fig, legend_from=axes[0], integer_steps=True)


def _gap_line(ax, one: pd.DataFrame, column: str, j: int, **style) -> None:
    """``one``'s ``column`` by draft step with its 95% interval (``lo``, ``hi``), nudged by ``j`` sideways."""
    one = one.sort_values("k")
    err = np.vstack([one[column] - one["lo"], one["hi"] - one[column]])  # [2, steps]
    ax.errorbar(one["k"] + (j - 0.5) * 0.12, one[column], yerr=err, ms=3, capsize=1.5, **style)
