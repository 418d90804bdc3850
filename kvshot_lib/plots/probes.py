"""Figures of the K/V-gradient probes (notebook 05), one function each: gradient statistics by parameter group, the
K/V projections against the rest, gradients by key position, attention mass and the remedies' effect.

Every function takes the tables that :mod:`kvshot_lib.training.grad_probes` writes (pandas DataFrames, as read back
from the saved CSV files) and returns a matplotlib figure; :mod:`.figures` saves it.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.ticker import LogLocator, NullFormatter

from .series import drafter_rows
from .style import PAGE

_GROUP_PALETTE = sns.color_palette("colorblind", 10)
GROUP_COLORS = {  # parameter groups (notebook 05); the K/V projections in the KV paradigm's colour
    "kv_proj": _GROUP_PALETTE[3],
    "q_proj": _GROUP_PALETTE[0],
    "o_proj": _GROUP_PALETTE[4],
    "mlp": _GROUP_PALETTE[5],
    "fusion": _GROUP_PALETTE[2],
    "gate": _GROUP_PALETTE[1],
    "kv_inject": _GROUP_PALETTE[6],
    "norm": _GROUP_PALETTE[7],
}


def plot_grad_group_stats(probes: pd.DataFrame, stats=("rms", "frac_small", "hoyer", "position_share")):
    """Per drafter (columns), each gradient statistic (rows) of every parameter group over training."""
    probes = probes.assign(
        position_share=probes["n_positions"] / probes["n_positions_total"].replace(0, np.nan)
    )
    names = drafter_rows(probes)
    fig, axes = plt.subplots(
        len(stats),
        len(names),
        figsize=(max(PAGE, 2.0 * len(names)), 1.6 * len(stats)),
        sharex="col",
        squeeze=False,
    )
    labels = {
        "rms": "gradient RMS per entry",
        "l2": "gradient L2",
        "frac_small": "share of entries < 1% of RMS",
        "hoyer": "Hoyer sparsity",
        "position_share": "share of positions\nwith any gradient",
    }
    for j, (name, *_) in enumerate(names):
        d = probes[probes["drafter"] == name]
        for group, g in d.groupby("group"):
            g = g.sort_values("step")
            for i, stat in enumerate(stats):
                axes[i][j].plot(
                    g["step"],
                    g[stat],
                    color=GROUP_COLORS.get(group, "k"),
                    label=group,
                    lw=2.2 if group == "kv_proj" else 1.0,
                )
        axes[0][j].set_title(name)
        axes[-1][j].set_xlabel("optimizer step")
        for i, stat in enumerate(stats):
            if stat in ("rms", "l2"):
                axes[i][j].set_yscale("log")
            axes[i][0].set_ylabel(labels.get(stat, stat))
            axes[i][j].grid(alpha=0.3)
    legend = {}
    for ax in axes[0]:
        for h, lbl in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(lbl, h)
    handles, lbls = list(legend.values()), list(legend)
    fig.legend(handles, lbls, loc="upper center", ncol=len(lbls), frameon=False, bbox_to_anchor=(0.5, 1.02))
    fig.tight_layout()
    return fig


def plot_kv_vs_other_groups(probes: pd.DataFrame, stat: str = "rms"):
    """The K/V projections' gradient relative to the drafter's other groups (median over training), per drafter."""
    med = probes.groupby(["drafter", "group"])[stat].median().unstack("group")
    rel = med.div(med.drop(columns=["norm"], errors="ignore").median(axis=1), axis=0)
    fig, ax = plt.subplots(figsize=(max(PAGE / 2, 1.2 + 0.9 * len(rel)), 2.8))
    groups = [g for g in GROUP_COLORS if g in rel.columns and g != "norm"]
    width = 0.8 / len(groups)
    x = np.arange(len(rel))
    for i, g in enumerate(groups):
        ax.bar(x + i * width, rel[g], width, color=GROUP_COLORS[g], label=g)
    ax.set_xticks(x + 0.4 - width / 2, rel.index, rotation=20, ha="right")
    ax.set_yscale("log")
    ax.axhline(1, color="k", lw=0.8)
    ax.set_ylabel(f"gradient {stat} / drafter's median group {stat}")
    ax.legend(frameon=False, ncol=2)
    ax.set_title("How much gradient reaches each parameter group (median over training)")
    fig.tight_layout()
    return fig


def plot_kv_position_gradients(samples: pd.DataFrame, kv_positions: pd.DataFrame | None = None):
    """Per own-K/V position: attention received vs. the norm of its key gradient, colored by unrolled step.

    The legend gives, per step, the Spearman correlation between the two over all positions of the last probe.
    """
    names = drafter_rows(samples)
    ncols = min(5, len(names))
    nrows = -(-len(names) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(PAGE, 2.3 * nrows), squeeze=False)
    for ax in axes.flat[len(names) :]:
        ax.set_visible(False)
    cmap = plt.get_cmap("viridis")
    for ax, (name, *_) in zip(axes.flat, names):
        d = samples[(samples["drafter"] == name) & (samples["layer"] == 0)]
        rho = {}
        if kv_positions is not None:
            kp = kv_positions[(kv_positions["drafter"] == name) & (kv_positions["layer"] == 0)]
            rho = {r.own_step: r.spearman_k for r in kp[kp["step"] == kp["step"].max()].itertuples()}
        ax.set_title(name)
        ax.grid(alpha=0.3)
        if not ((d["received"] > 0) & (d["grad_k"] > 0)).any():
            # e.g. teacher forcing with a softmax of its own: each query has one own key, which gets all the
            # weight whatever its value, so no gradient reaches it
            ax.text(
                0.5,
                0.5,
                "no key gets\na gradient",
                ha="center",
                va="center",
                transform=ax.transAxes,
                fontsize=7,
            )
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        top = max(1, int(d["own_step"].max()))
        for step, g in d.groupby("own_step"):
            ok = (g["received"] > 0) & (g["grad_k"] > 0)
            label = f"made at step {step}" + (f" (ρ={rho[step]:.2f})" if step in rho else "")
            ax.scatter(
                g["received"][ok], g["grad_k"][ok], s=5, alpha=0.5, color=cmap(step / top), label=label
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(LogLocator(numticks=4))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.legend(frameon=False, markerscale=2, fontsize=4.5, handletextpad=0.1, borderaxespad=0.1)
    for row in axes:
        row[0].set_ylabel("‖∂L/∂k‖ at that position")
    fig.supxlabel("attention the position receives (sum over heads and queries)", fontsize=8)
    fig.suptitle("The drafter's own keys (layer 0, last probe): gradient follows the attention they receive")
    fig.tight_layout()
    return fig


def plot_attention_mass(mass: pd.DataFrame):
    """Share of the drafter's attention on the target's KV, its own KV, and the first (sink) key, layer 0."""
    last = mass[mass["step"] == mass.groupby("drafter")["step"].transform("max")]
    last = last[last["layer"] == 0]
    rows = []
    for (name, seg), g in last.groupby(["drafter", "segment"]):
        rows.append(dict(drafter=name, part=f"{seg} KV", share=g["share"].mean() - g["sink_share"].mean()))
        rows.append(dict(drafter=name, part=f"{seg} first key (sink)", share=g["sink_share"].mean()))
    t = pd.DataFrame(rows).pivot(index="drafter", columns="part", values="share").fillna(0)
    fig, ax = plt.subplots(figsize=(PAGE, 0.8 + 0.35 * len(t)))
    t.plot.barh(stacked=True, ax=ax, colormap="tab20c")
    ax.set_xlabel("share of attention mass (fraction per softmax; the hybrid has two)")
    ax.legend(frameon=False, bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig


def plot_remedies(per_step: pd.DataFrame, probes: pd.DataFrame | None = None):
    """The remedy experiment: held-out per-step accuracy per remedy (mean over seeds, with each seed's
    curve faint and the min–max band), and the K/V-projection gradient it saw (seed 0)."""
    n = 2 if probes is not None else 1
    fig, axes = plt.subplots(1, n, figsize=(PAGE / 2 * n, 2.6), squeeze=False)
    cmap = plt.get_cmap("tab10")  # remedies of one drafter: told apart by colour, not paradigm
    by = "remedy" if "remedy" in per_step else "drafter"
    for i, (name, d) in enumerate(per_step.groupby(by, sort=False)):
        steps = d.groupby("draft_step")["accuracy"]
        n_seeds = d["drafter"].nunique()
        mean = steps.mean()
        axes[0][0].plot(mean.index, mean.values, marker="o", color=cmap(i), label=f"{name} ({n_seeds} seeds)")
        if n_seeds > 1:
            axes[0][0].fill_between(
                mean.index, steps.min().values, steps.max().values, color=cmap(i), alpha=0.15, lw=0
            )
        if probes is not None:
            first = d["drafter"].iloc[0]
            p = probes[(probes["drafter"] == first) & (probes["group"] == "kv_proj")].sort_values("step")
            axes[0][1].plot(p["step"], p["rms"], color=cmap(i), label=name)
    axes[0][0].set_xlabel("draft step k")
    axes[0][0].set_ylabel("held-out accuracy\n(mean over seeds; band: min–max)")
    axes[0][0].legend(frameon=False)
    if probes is not None:
        axes[0][1].set_yscale("log")
        axes[0][1].set_xlabel("optimizer step")
        axes[0][1].set_ylabel("kv_proj gradient RMS (before any scaling)")
    fig.tight_layout()
    return fig
