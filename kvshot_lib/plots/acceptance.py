"""Acceptance by draft step, drawn as a paper prints it (03), and our held-out per-step accuracy beside the KVShot
paper's Table 5 (02).

:func:`plot_acceptance_by_step` answers one question: which paradigm keeps the most acceptance at deep steps, at
the same stage and data? One panel per paradigm that reads the target (KV, hidden, cross, hybrid, block), each
with at most :data:`PANEL_SERIES` lines (:func:`panel_drafters`): the paradigm's headline drafter strong, its
zeroed-KV control dashed, one drafter of each earlier stage lighter, and the no-target control and the n-gram
drafter faint, as a reference in every panel.

* The top row of a temperature is the **reach probability** P(first k+1 drafts accepted), the product of the
  conditional rates, whose sum over k is MAT - 1; on a log scale, so that the rate of decay reads as a slope.
* The row below is the **conditional** alpha_k, drawn only where step k was attempted at least ``min_attempts``
  times. It rises with k because only the chains that are easy to draft (a quoted passage, a list, code) reach
  deep steps: alpha_6 is measured on those chains alone, which is why the reach probability is the main measure.
* Bands: the 95% bootstrap interval over MT-bench turns from ``acceptance_bootstrap.csv`` (alpha_k), and for the
  reach probability those per-step intervals combined along the chain in log space as independent (Greenwood's
  rule for a product of conditional rates; for the on-policy run's trained drafters it implies chain MAT intervals
  72-100% as wide as the bootstrap's own: ``tests/test_acceptance_figure.py``).
* T=0 on top; a higher temperature below only where the bootstrap table has its intervals.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from .series import (
    MAX_SERIES,
    PARADIGM_ORDER,
    by_priority,
    drafter_order,
    headline,
    is_control,
    paradigm_keys,
    stage_of,
)
from .style import PAGE, drafter_color, finish_figure
from .training import wilson_interval

PANEL_SERIES = 6  # lines in one panel, the faint references included
READERS = ("kv", "hidden", "cross", "hybrid", "block")  # paradigms that read the target: one panel each
REFERENCES = ("none", "ngram")  # drawn faint in every panel
PANEL_TITLES = {
    "kv": "KV-only",
    "hidden": "hidden-only",
    "cross": "cross-only",
    "hybrid": "hybrid",
    "block": "block-wise",
}
REACH_MIN = (
    20  # a reach point needs this many attempts at its step (its interval is the step's alpha interval)
)
Z = 1.96


def panel_drafters(table: pd.DataFrame, paradigm: str, limit: int = PANEL_SERIES) -> list[str]:
    """The drafters of ``paradigm``'s panel, in :func:`~.series.drafter_order`: the references' headlines (the
    no-target control, n-gram), then the paradigm's drafters by priority, ``limit`` in all."""
    keys = paradigm_keys(table)
    order = drafter_order(table)
    refs = [headline([n for n in order if keys[n] == r]) for r in REFERENCES if r != paradigm]
    refs = [r for r in refs if r]
    own = by_priority([n for n in order if keys[n] == paradigm])[: max(0, limit - len(refs))]
    chosen = {*refs, *own}
    return [n for n in order if n in chosen]


def _looks(names: list[str], keys: dict[str, str]) -> dict[str, dict]:
    """Per drafter of a panel: the headline strong, its control dashed, other drafters lighter the earlier their
    stage, the references faint."""
    looks = {}
    for name in names:
        color = np.array(drafter_color(name, keys[name]))
        top = headline([n for n in names if keys[n] == keys[name]])
        if keys[name] in REFERENCES and len({keys[n] for n in names}) > 1:
            looks[name] = dict(color=tuple(color), lw=0.9, alpha=0.55, band=False, marker="")
        elif name == top:
            looks[name] = dict(color=tuple(color), lw=1.9, marker="o", band=True)
        elif is_control(name):
            looks[name] = dict(color=tuple(color), lw=1.1, ls="--", marker="s", mfc="white", band=True)
        else:  # another row of the headline's stage, or an earlier stage: toward white, the more the earlier
            mix = min(0.3 + 0.2 * (stage_of(top) - stage_of(name)), 0.75)
            looks[name] = dict(color=tuple(color + (1 - color) * mix), lw=1.0, marker=".", band=False)
    return looks


def _intervals(boot: pd.DataFrame | None, drafter: str, mode: str, temperature: float) -> pd.DataFrame:
    """alpha_k intervals of one run, indexed by step: ``lo, hi`` (empty where the table has none)."""
    if boot is None or boot.empty:
        return pd.DataFrame(columns=["lo", "hi"])
    b = boot[(boot["drafter"] == drafter) & (boot["mode"] == mode) & (boot["temperature"] == temperature)]
    b = b[b["metric"].str.fullmatch(r"alpha_\d+")]
    return b.assign(step=b["metric"].str[6:].astype(int)).set_index("step")[["lo", "hi"]]


def reach_band(alpha: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 95% band of the reach probability prod_{j<=k} alpha_j from each step's 95% interval ``[lo, hi]``: the
    intervals' log-scale variances ((hi - lo) / 2z / alpha)^2 summed over j <= k, as if independent (Greenwood)."""
    alpha = np.asarray(alpha, float)  # [K]
    var = ((np.asarray(hi, float) - np.asarray(lo, float)) / (2 * Z) / np.maximum(alpha, 1e-12)) ** 2  # [K]
    reach = np.cumprod(alpha)  # [K]
    half = Z * np.sqrt(np.cumsum(var))  # [K]
    return reach * np.exp(-half), np.minimum(1.0, reach * np.exp(half))


def _draw(ax_reach, ax_alpha, d: pd.DataFrame, ci: pd.DataFrame, look: dict, label: str, min_attempts: int):
    d = d.sort_values("step").set_index("step")
    line = {k: v for k, v in look.items() if k not in ("band", "marker")}
    marker = dict(marker=look["marker"], ms=3.2 if look["marker"] == "o" else 3) if look["marker"] else {}
    reach = d[(d["n_attempts"] >= REACH_MIN) & (d["p_reach"] > 0)]
    ax_reach.plot(reach.index, reach["p_reach"], label=label, **line, **marker)
    cond = d[d["n_attempts"] >= min_attempts]
    if ax_alpha is not None:
        ax_alpha.plot(cond.index, cond["alpha_conditional"], **line, **marker)
    if not look["band"] or ci.empty:
        return
    steps = [k for k in d.index if k in ci.index]
    steps = steps[: next((i for i, k in enumerate(steps) if k != i), len(steps))]  # 0..K-1 without a gap
    if not steps:
        return
    lo, hi = reach_band(d.loc[steps, "alpha_conditional"], ci.loc[steps, "lo"], ci.loc[steps, "hi"])
    keep = np.isin(steps, reach.index)
    fill = dict(color=look["color"], alpha=0.18 if look.get("ls") != "--" else 0.1, lw=0)
    ax_reach.fill_between(np.array(steps)[keep], lo[keep], hi[keep], **fill)
    c = ci.loc[[k for k in steps if k in cond.index]]
    if ax_alpha is not None:
        ax_alpha.fill_between(c.index, c["lo"], c["hi"], **fill)


def plot_acceptance_by_step(
    table: pd.DataFrame,
    bootstrap: pd.DataFrame | None = None,
    min_attempts: int = 200,
    title: str = "Acceptance by draft step",
):
    """One column per target-reading paradigm, two rows per temperature (reach probability, then conditional
    alpha_k); the chain of drafts (the tree's MAT is in ``03_mat_by_drafter``). See the module's docstring."""
    mode = "chain" if (table["mode"] == "chain").any() else str(table["mode"].iloc[0])
    table = table[table["mode"] == mode]
    keys = paradigm_keys(table)
    paradigms = [p for p in PARADIGM_ORDER if p in READERS and p in keys.values()]
    paradigms = paradigms or [p for p in PARADIGM_ORDER if p in keys.values()][:1]
    has_ci = bootstrap is not None and not bootstrap.empty
    temps = sorted(table["temperature"].unique())
    temps = [t for i, t in enumerate(temps) if i == 0 or (has_ci and (bootstrap["temperature"] == t).any())]
    rows = []  # (temperature, measure): reach for every temperature, alpha_k where 3 steps have its attempts
    for i, temp in enumerate(temps):
        enough = table[(table["temperature"] == temp) & (table["n_attempts"] >= min_attempts)]
        rows += [(temp, "reach")] + ([(temp, "alpha")] if i == 0 or enough["step"].nunique() >= 3 else [])
    fig, axes = plt.subplots(
        len(rows), len(paradigms), figsize=(PAGE, 0.6 + 1.75 * len(rows)), sharex=True, sharey="row",
        squeeze=False,
    )  # fmt: skip
    handles = {}
    for col, paradigm in enumerate(paradigms):
        names = panel_drafters(table, paradigm)
        looks = _looks(names, keys)
        for temp in temps:
            ax_reach = axes[rows.index((temp, "reach"))][col]
            ax_alpha = axes[rows.index((temp, "alpha"))][col] if (temp, "alpha") in rows else None
            for name in names:
                d = table[(table["drafter"] == name) & (table["temperature"] == temp)]
                if d.empty:
                    continue
                label = f"{name} (control)" if is_control(name) else name
                ci = _intervals(bootstrap, name, mode, temp)
                _draw(ax_reach, ax_alpha, d, ci, looks[name], label, min_attempts)
            for h, lb in zip(*ax_reach.get_legend_handles_labels()):
                handles.setdefault(lb, h)
            ax_reach.set_yscale("log")
            ax_reach.set_ylim(1e-3, 1.0)
            if ax_alpha is not None:
                ax_alpha.set_ylim(0.0, 1.0)
        axes[0][col].set_title(PANEL_TITLES.get(paradigm, paradigm))
        axes[-1][col].set_xlabel("draft step k")
    for row, (temp, measure) in enumerate(rows):
        what = (
            "P(first k+1 drafts\naccepted)"
            if measure == "reach"
            else f"conditional $\\alpha_k$\n(≥ {min_attempts} attempts)"
        )
        axes[row][0].set_ylabel(f"T = {temp:g}\n{what}")
    rank = {n: i for i, n in enumerate(drafter_order(table))}
    labels = sorted(handles, key=lambda lb: rank[lb.split(" ")[0]])
    fig.legend(
        [handles[lb] for lb in labels], labels, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False
    )
    band = "bands: 95% bootstrap over turns" if has_ci else "no interval: this run saved no bootstrap table"
    return finish_figure(fig, f"{title}, chain of drafts ({band})", integer_steps=True)


def caption(min_attempts: int = 200) -> str:
    """What the acceptance figure's caption line adds to its counts: the two measures and why alpha_k rises."""
    return (
        "rows: P(first k+1 drafts accepted), summing to MAT - 1, then conditional α_k where step k had "
        f"≥ {min_attempts} attempts (at T > 0 only where 3 steps had them). α_k rises with k because only easy chains "
        "get deep and it is measured on them alone, while the reach falls. Reach band: the α_k bootstrap intervals "
        "combined along the chain (Greenwood)"
    )


# the paper's row each of our paradigms stands for (the rows the reference plan names with ``paper:``)
PAPER_ROWS = {
    "none": "no target information (control)",
    "kv": "KV 1L, head concatenation",
    "hidden": "EAGLE-3, 1 layer (hidden-only)",
    "hybrid": "hybrid, random init",
}
OURS, PAPERS = "SmolLM2-135M, ours", "paper (Qwen3-8B)"


def plot_paper_table5(per_step: pd.DataFrame, paper: pd.DataFrame):
    """Held-out accuracy by draft step (left) and retention acc_k / acc_0 (right): each paradigm's headline drafter
    of this run (solid, 95% Wilson band) and the paper's Table 5 row it stands for (dashed, same colour). Two
    targets: our SmolLM2-135M rows against the paper's Qwen3-8B rows, so levels differ; compare shapes."""
    keys = paradigm_keys(per_step)
    order = drafter_order(per_step)
    ours = [h for p in PARADIGM_ORDER if (h := headline([n for n in order if keys[n] == p]))]
    if (
        len(ours) + sum(keys[n] in PAPER_ROWS for n in ours) > MAX_SERIES
    ):  # a paradigm without a paper row goes
        ours = [n for n in ours if keys[n] in PAPER_ROWS]
    fig, axes = plt.subplots(1, 2, figsize=(PAGE, 2.8), sharex=True, squeeze=False)
    rows = paper.set_index("paper_row")
    for name in ours:
        color = drafter_color(name, keys[name])
        d = per_step[per_step["drafter"] == name].sort_values("draft_step")
        acc = d["accuracy"].to_numpy()
        axes[0][0].plot(d["draft_step"], acc, color=color, marker="o", ms=3, label=f"{name} ({OURS})")
        if "n" in d:
            lo, hi = wilson_interval(acc, d["n"])
            axes[0][0].fill_between(d["draft_step"], lo, hi, color=color, alpha=0.15, lw=0)
        with np.errstate(invalid="ignore", divide="ignore"):  # a smoke run's drafter may get nothing right
            axes[0][1].plot(d["draft_step"], acc / acc[0], color=color, marker="o", ms=3)
        row = PAPER_ROWS.get(keys[name])
        if row in rows.index:
            steps = [k for k in range(7) if f"alpha_{k}" in rows]
            a = rows.loc[row, [f"alpha_{k}" for k in steps]].to_numpy(float)
            kw = dict(color=color, ls="--", marker="^", ms=3, mfc="white")
            axes[0][0].plot(steps, a, label=f"{PAPERS}: {row}", **kw)
            axes[0][1].plot(steps, a / a[0], **kw)
    axes[0][0].set_ylim(0, 1)
    axes[0][0].set_ylabel("held-out accuracy at draft step k\n(paper: α_k of its Table 5)")
    axes[0][1].set_ylabel("retention  acc_k / acc_0")
    for ax in axes[0]:
        ax.set_xlabel("draft step k")
    handles, labels = axes[0][0].get_legend_handles_labels()
    by = sorted(range(len(labels)), key=lambda i: _legend_rank(labels[i], ours, keys))
    fig.legend([handles[i] for i in by], [labels[i] for i in by], loc="center left", bbox_to_anchor=(1.0, 0.5),
               frameon=False)  # fmt: skip
    title = "Two targets: ours on SmolLM2-135M solid, the paper's on Qwen3-8B dashed (held-out, teacher-forced prefix; paper: Table 5)"
    return finish_figure(fig, title, integer_steps=True)


def _legend_rank(label: str, ours: list[str], keys: dict[str, str]) -> tuple:
    """A legend label's place: by our drafter's paradigm (in :func:`drafter_order`), ours before the paper's."""
    for i, name in enumerate(ours):
        if label == f"{name} ({OURS})":
            return i, 0
        if label == f"{PAPERS}: {PAPER_ROWS.get(keys[name])}":
            return i, 1
    return len(ours), 2
