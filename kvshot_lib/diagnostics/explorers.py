"""Interactive explorers (ipywidgets) for notebook 04, each one library call in one cell.

* :class:`AttentionExplorer`: pick a drafter, a target layer and head, a draft step and an anchor in an
  MT-bench answer; it draws the target's attention at ``p = t+1+k`` over ``0..p`` (the positions no reused
  cache holds shaded) above the drafter's attention over the reused cache ``0..t``, with the tokens, and
  lists the part-1 metrics of that choice for the drafter and the baselines, read from the saved per-position
  table (``query_error_positions.csv``).
* :class:`AcceptanceExplorer`: pick drafters, a temperature and a mode; it draws α_k and the reach
  probability from notebook 03's saved ``acceptance_by_step.csv``.

:func:`show` displays an explorer's widget when a notebook frontend can render it (a kernel started by a
Jupyter server, which sets ``JPY_SESSION_NAME``), and otherwise (papermill, ``KVSHOT_STATIC_EXPLORERS=1``)
its default view as a static figure, so batch runs keep a picture and pass. Every control's change redraws
the view (``tests/test_explorers.py``; ``scripts/browser_check_explorers.py`` checks it in a real browser).
"""

from __future__ import annotations

import os

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

SHOWN_METRICS = (
    "out_err",
    "kl_bits",
    "js_bits",
    "recall@4",
    "mass@4",
    "cosine",
    "norm_ratio",
    "unavailable_mass",
)


def has_widget_frontend() -> bool:
    """Whether this kernel was started by a Jupyter server (JupyterLab, Notebook) rather than a batch runner."""
    if os.environ.get("KVSHOT_STATIC_EXPLORERS", "") not in ("", "0"):
        return False
    return bool(os.environ.get("JPY_SESSION_NAME"))


def show(explorer, interactive: bool | None = None):
    """Display ``explorer``: its widget under a notebook frontend, else its current view as a static figure."""
    from IPython.display import display

    interactive = has_widget_frontend() if interactive is None else interactive
    if interactive:
        display(explorer.widget)
    else:
        fig = explorer.figure()
        display(fig)
        plt.close(fig)
    return explorer


class _Explorer:
    """Controls + an output area; every control change redraws. Subclasses define ``controls`` and ``figure``."""

    title = ""

    def _build(self, controls: dict) -> None:
        import ipywidgets as w

        self.controls = controls
        self.caption = w.HTML()
        self.output = w.Output()
        for c in controls.values():
            c.observe(lambda _change: self.redraw(), names="value")
        self.widget = w.VBox(
            [
                w.HBox(list(controls.values())[:3]),
                w.HBox(list(controls.values())[3:]),
                self.caption,
                self.output,
            ]
        )
        self.n_draws = 0
        self.redraw()

    def value(self, name: str):
        return self.controls[name].value

    def redraw(self) -> None:
        from IPython.display import display

        self.caption.value = self.describe()
        self.output.clear_output(wait=True)
        fig = self.figure()
        with self.output:
            display(fig)
        plt.close(fig)
        self.n_draws += 1


# ------------------------------------------------------------------------------------------ attention


class AttentionExplorer(_Explorer):
    """``maps``: ``{drafter: SequenceErrors with maps}`` of one sequence; ``tokens``: its token strings;
    ``positions``: the saved per-position table of that sequence (rows of every drafter)."""

    def __init__(self, maps: dict, tokens: list[str], positions: pd.DataFrame, window: int = 40, color=None):
        import ipywidgets as w

        self.maps, self.tokens, self.window, self.color = maps, tokens, window, color
        self.positions = positions
        first = next(iter(maps.values()))
        layers = sorted({p[1] for p in first.pairs})
        heads = sorted({p[2] for p in first.pairs})
        anchors = [int(a) for a in first.anchors]
        self._anchor_index = {a: i for i, a in enumerate(anchors)}
        options = [(f"t={a}: {tokens[a]!r}", a) for a in anchors]
        self._build(
            dict(
                drafter=w.Dropdown(options=list(maps), description="drafter"),
                layer=w.Dropdown(options=layers, description="layer"),
                head=w.Dropdown(options=heads, description="head"),
                step=w.IntSlider(min=0, max=first.valid.shape[0] - 1, value=0, description="draft step"),
                anchor=w.Dropdown(options=options, value=anchors[len(anchors) // 2], description="anchor"),
            )
        )

    def selection(self) -> dict:
        return {name: self.value(name) for name in ("drafter", "layer", "head", "step", "anchor")}

    def distributions(self) -> tuple[np.ndarray, np.ndarray, int, int]:
        """The drawn distributions: target over ``0..p`` and drafter over ``0..t`` (``[T]`` each), ``t``, ``p``."""
        s = self.selection()
        se = self.maps[s["drafter"]]
        pair = next(p for p in se.pairs if p[0] == 0 and p[1] == s["layer"] and p[2] == s["head"])
        a = self._anchor_index[s["anchor"]]
        t, p = s["anchor"], s["anchor"] + 1 + s["step"]
        target = se.maps["target"][s["layer"]][s["head"], s["step"], a].numpy()
        drafter = se.maps["drafter"][0][pair[4], s["step"], a].numpy()
        return target, drafter, t, p

    def metrics(self) -> pd.DataFrame:
        """The saved per-position metrics of the current choice: one row per estimator and sink variant."""
        s = self.selection()
        d = self.positions
        sel = d[
            (d["drafter"] == s["drafter"])
            & (d["level"] == "head")
            & (d["drafter_layer"] == 0)
            & (d["layer"] == s["layer"])
            & (d["head"] == s["head"])
            & (d["step"] == s["step"])
            & (d["anchor"] == s["anchor"])
        ]
        return sel.set_index(["estimator", "variant"])[list(SHOWN_METRICS)]

    def describe(self) -> str:
        s = self.selection()
        m = self.metrics()
        valid = len(m) > 0
        table = (
            m.round(3).to_html(classes="kvshot-metrics", border=0)
            if valid
            else "<i>no label at this step</i>"
        )
        return (
            f"<b>{s['drafter']}</b> · layer {s['layer']} · head {s['head']} · step {s['step']} · "
            f"anchor t={s['anchor']} (p={s['anchor'] + 1 + s['step']}){table}"
        )

    def figure(self):
        s = self.selection()
        target, drafter, t, p = self.distributions()
        lo = max(1, p - self.window)
        cols = [0, *range(lo, p + 1)]
        x = np.arange(len(cols))
        fig, axes = plt.subplots(2, 1, figsize=(7.0, 3.6), sharex=True)
        rows = self.positions[self.positions["drafter"] == s["drafter"]]
        paradigm = rows["paradigm"].iloc[0] if "paradigm" in rows and len(rows) else "kv"
        kv = self.color(s["drafter"], paradigm) if self.color else "C3"
        axes[0].bar(x, target[cols], color="0.3")
        unavailable = [i for i, c in enumerate(cols) if c > t]
        if unavailable:
            axes[0].axvspan(
                unavailable[0] - 0.5, unavailable[-1] + 0.5, color="0.85", zorder=0, label="not in cache"
            )
            axes[0].legend(frameon=False, loc="upper left")
        axes[0].set_ylabel(f"target at p={p}")
        axes[1].bar(x, drafter[cols], color=kv)
        axes[1].set_ylabel("drafter (cache)")
        labels = [self.tokens[c] if c < len(self.tokens) else "" for c in cols]
        axes[1].set_xticks(x, [f"{lab!r}"[1:-1][:8] for lab in labels], rotation=90, fontsize=6)
        m = self.metrics()
        err = (
            m.loc[("drafter", "with_sink"), "out_err"]
            if ("drafter", "with_sink") in m.index
            else float("nan")
        )
        fig.suptitle(
            f"{s['drafter']} · layer {s['layer']} head {s['head']} · step {s['step']} · t={t}: "
            f"output error {err:.3f}",
            fontsize=8,
        )
        fig.tight_layout()
        return fig


# ------------------------------------------------------------------------------------------ acceptance


class AcceptanceExplorer(_Explorer):
    """``table``: notebook 03's ``acceptance_by_step.csv``; ``min_attempts`` hides steps tried too rarely."""

    def __init__(self, table: pd.DataFrame, min_attempts: int = 20, color=None, drafters=None):
        import ipywidgets as w

        self.table, self.min_attempts, self.color = table, min_attempts, color
        names = list(dict.fromkeys(table["drafter"]))
        temps = sorted(float(x) for x in table["temperature"].unique())
        modes = sorted(table["mode"].unique())
        self._build(
            dict(
                drafters=w.SelectMultiple(
                    options=names, value=tuple(drafters or names), description="drafters"
                ),
                temperature=w.Dropdown(options=temps, value=temps[0], description="temperature"),
                mode=w.Dropdown(
                    options=modes, value="chain" if "chain" in modes else modes[0], description="mode"
                ),
            )
        )

    def lines(self) -> dict[str, pd.DataFrame]:
        """Per chosen drafter, the rows drawn: ``step, alpha_conditional, p_reach, n_attempts``."""
        t = self.table
        sel = t[
            t["drafter"].isin(self.value("drafters"))
            & np.isclose(t["temperature"].astype(float), self.value("temperature"))
            & (t["mode"] == self.value("mode"))
            & (t["n_attempts"] >= self.min_attempts)
        ]
        return {d: g.sort_values("step") for d, g in sel.groupby("drafter", sort=False)}

    def describe(self) -> str:
        lines = self.lines()
        parts = [f"{d}: α₀={g['alpha_conditional'].iloc[0]:.3f}" for d, g in lines.items() if len(g)]
        return f"<b>{self.value('mode')}</b>, T={self.value('temperature'):g} · " + (
            " · ".join(parts) if parts else "<i>no drafter chosen</i>"
        )

    def figure(self):
        fig, axes = plt.subplots(1, 2, figsize=(7.0, 2.6), sharex=True)
        for d, g in self.lines().items():
            paradigm = g["paradigm"].iloc[0] if "paradigm" in g else None
            kw = {"color": self.color(d, paradigm)} if self.color else {}
            axes[0].plot(g["step"], g["alpha_conditional"], marker="o", label=d, **kw)
            axes[1].plot(g["step"], g["p_reach"], marker="o", **kw)
        axes[0].set_ylabel("conditional acceptance $\\alpha_k$")
        axes[1].set_ylabel("P(first k+1 drafts accepted)")
        for ax in axes:
            ax.set_xlabel("draft step k")
            ax.set_ylim(-0.02, 1.02)
        if self.lines():
            axes[0].legend(frameon=False, fontsize=6)
        fig.suptitle(
            f"{self.value('mode')}, T={self.value('temperature'):g} (steps with < {self.min_attempts} attempts hidden)",
            fontsize=8,
        )
        fig.tight_layout()
        return fig
