"""Figures of notebook 07 (SpecPV at long context): fidelity over budget × P, drift since the last full pass,
decode speed, per-phase time, and the cost model's crossover.

Each function takes the tables notebook 07 writes (as read back from the saved CSV) and returns a figure.
Line colour = the full-verification period P, line style = the context length (or the mode in the speed
figure); budgets are on a log2 axis.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from .style import PAGE, finish_figure

_STYLES = ["-", "--", ":", "-."]
PHASES = [
    ("draft_ms_per_token", "draft"),
    ("partial_ms_per_token", "partial verify"),
    ("full_ms_per_token", "full verify + re-feed"),
    ("refresh_ms_per_token", "block scoring"),
]


def _budget_axis(ax, budgets) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(budgets), [str(int(b)) for b in sorted(budgets)])
    ax.minorticks_off()
    ax.set_xlabel("KV budget (tokens)")


def _palette(values) -> dict:
    return dict(zip(sorted(values), sns.color_palette("viridis", len(set(values)))))


def plot_fidelity(runs: pd.DataFrame):
    """Exact match, teacher-forced top-1 agreement and ROUGE-L against lossless decoding, by budget; one
    line per full_every (colour) and context (style), 95% bootstrap interval over prompts where there are several
    (the ``specpv`` variant)."""
    d = runs[runs["mode"] == "specpv"].copy()
    d["P"] = d["full_every"].astype(str)
    d["context"] = d["context"].astype(str)
    panels = [
        ("exact_match", "exact match"),
        ("top1_agreement", "top-1 agreement\n(teacher-forced)"),
        ("rouge_l", "ROUGE-L vs lossless"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(PAGE, 2.4), sharex=True)
    pal = {str(k): v for k, v in _palette(d["full_every"].unique()).items()}
    for ax, (col, label) in zip(axes, panels):
        sns.lineplot(
            d,
            x="budget",
            y=col,
            hue="P",
            style="context",
            palette=pal,
            marker="o",
            errorbar=("ci", 95),
            seed=0,  # the bootstrap is seeded: a redraw gives the same bytes
            ax=ax,
            legend=ax is axes[-1],
        )
        ax.set_ylabel(label)
        ax.set_ylim(-0.03, 1.03)
        _budget_axis(ax, d["budget"].unique())
    axes[-1].legend(frameon=False, fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return finish_figure(fig, "SpecPV against lossless decoding (greedy)")


def plot_drift(steps: pd.DataFrame):
    """Cosine of partial- and full-cache last hidden states, and top-1 agreement, by distance since the
    last full pass; one line per budget, 95% bootstrap interval over verified rows."""
    d = steps[steps["mode"] == "specpv"].copy()
    d["budget"] = d["budget"].astype(int)
    pal = _palette(d["budget"].unique())
    fig, axes = plt.subplots(1, 2, figsize=(PAGE * 0.8, 2.4), sharex=True)
    for ax, (col, label) in zip(
        axes, [("cosine", "cosine(partial, full) of\nlast hidden state"), ("top1_agree", "top-1 agreement")]
    ):
        sns.lineplot(
            d,
            x="distance",
            y=col,
            hue="budget",
            palette=pal,
            errorbar=("ci", 95),
            seed=0,  # the bootstrap is seeded: a redraw gives the same bytes
            ax=ax,
            legend=ax is axes[-1],
        )
        ax.set_xlabel("tokens since the last full pass")
        ax.set_ylabel(label)
    axes[-1].legend(title="budget", frameon=False, fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return finish_figure(fig, "Drift of partial verification between full passes")


def _first_drafter(table: pd.DataFrame) -> pd.DataFrame:
    return table[table["drafter"] == table["drafter"].iloc[0]] if "drafter" in table else table


def plot_speed(table: pd.DataFrame):
    """Decode tokens/s by budget for each P (colour) and mode (style), one panel per context; plain
    decoding and lossless speculative decoding with the same drafter as horizontal lines (same run).
    The table's first drafter only (the others are in the table)."""
    table = _first_drafter(table)
    contexts = sorted(table["context"].unique())
    fig, axes = plt.subplots(1, len(contexts), figsize=(PAGE, 2.5), squeeze=False, sharey=True)
    spv = table[table["method"].isin(["specpv", "strict"])]
    pal = _palette(spv["full_every"].unique()) if len(spv) else {}
    for ax, ctx in zip(axes[0], contexts):
        t = table[table["context"] == ctx]
        for method, ls in (("specpv", "-"), ("strict", "--")):
            for p, g in t[t["method"] == method].groupby("full_every"):
                g = g.sort_values("budget")
                ax.plot(
                    g["budget"], g["tokens_per_s"], ls, marker="o", color=pal[p], label=f"{method}, P={p}"
                )
        for method, color in (("ar", "black"), ("lossless", "grey")):
            v = t.loc[t["method"] == method, "tokens_per_s"]
            if len(v):
                ax.axhline(
                    float(v.iloc[0]),
                    color=color,
                    ls=":",
                    lw=1,
                    label=f"{'plain' if method == 'ar' else 'lossless spec.'}",
                )
        ax.set_title(f"context {ctx} tokens")
        if len(spv):
            _budget_axis(ax, spv["budget"].unique())
    axes[0][0].set_ylabel("decode tokens/s")
    drafter = table["drafter"].iloc[0] if "drafter" in table else ""
    title = f"Decode speed with the {drafter} drafter on {table['machine'].iloc[0]}"
    return finish_figure(fig, title, axes[0][-1], fontsize=6)


def plot_phases(table: pd.DataFrame):
    """Milliseconds per generated token in each phase, stacked, for every method; one panel per context
    (the table's first drafter)."""
    table = _first_drafter(table)
    contexts = sorted(table["context"].unique())
    fig, axes = plt.subplots(len(contexts), 1, figsize=(PAGE, 1.9 * len(contexts)), squeeze=False)
    colors = sns.color_palette("colorblind", len(PHASES) + 1)
    for ax, ctx in zip(axes[:, 0], contexts):
        t = table[table["context"] == ctx].reset_index(drop=True)
        labels = [
            m if m in ("ar", "lossless") else f"{m}\nB={b} P={p}"
            for m, b, p in zip(t["method"], t["budget"], t["full_every"])
        ]
        bottom = pd.Series(0.0, index=t.index)
        for (col, name), c in zip(PHASES, colors):
            ax.bar(range(len(t)), t[col], bottom=bottom, color=c, label=name)
            bottom += t[col]
        other = 1000 / t["tokens_per_s"] - bottom
        ax.bar(
            range(len(t)),
            other.clip(lower=0),
            bottom=bottom,
            color=colors[-1],
            label="other (commit, drafter view)",
        )
        ax.set_xticks(range(len(t)), labels, fontsize=5, rotation=0)
        ax.set_ylabel(f"{ctx} tokens\nms per token")
    axes[0, 0].legend(frameon=False, fontsize=6, ncols=5, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    return finish_figure(fig)


def plot_cost_model(curves: pd.DataFrame, crossover: pd.DataFrame, measured: pd.DataFrame):
    """Predicted speedup of SpecPV over lossless speculative decoding (per-token time ratio) against the
    context length, per machine model; one line per budget × P, the crossover (ratio 1) marked; measured
    ratios on this CPU as dots (the first drafter's)."""
    measured = _first_drafter(measured)
    machines = list(dict.fromkeys(curves["machine"]))
    fig, axes = plt.subplots(1, len(machines), figsize=(PAGE, 2.5), squeeze=False, sharey=True)
    keys = list(dict.fromkeys(zip(curves["budget"], curves["full_every"])))
    pal = dict(zip(keys, sns.color_palette("viridis", len(keys))))
    for ax, machine in zip(axes[0], machines):
        c = curves[curves["machine"] == machine]
        for (b, p), g in c.groupby(["budget", "full_every"], sort=False):
            ax.plot(g["length"], g["ratio"], color=pal[(b, p)], label=f"B={b}, P={p}")
            x = crossover[
                (crossover["machine"] == machine)
                & (crossover["budget"] == b)
                & (crossover["full_every"] == p)
            ]
            if len(x) and pd.notna(x["crossover_tokens"].iloc[0]):
                ax.axvline(x["crossover_tokens"].iloc[0], color=pal[(b, p)], ls=":", lw=0.8)
            if machine.startswith("this CPU"):
                m = measured[
                    (measured["method"] == "specpv")
                    & (measured["budget"] == b)
                    & (measured["full_every"] == p)
                ]
                ax.scatter(m["context"], m["speedup_vs_lossless"], color=pal[(b, p)], s=14, zorder=3)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_title(machine, fontsize=7)
    axes[0][0].set_ylabel("SpecPV speedup over\nlossless (model; dots measured)")
    return finish_figure(fig, legend_from=axes[0][-1], fontsize=6)
