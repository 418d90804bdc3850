"""The one paper style every figure shares, and the one way a figure is saved.

* Sizes for a two-column paper: :data:`COLUMN` (3.4 in) and :data:`PAGE` (7.0 in) wide.
* seaborn's colour-blind palette, with one colour per paradigm in every notebook
  (:func:`drafter_color`): hidden, KV, hybrid, block, the no-target control, n-gram, self, random.
* :func:`finish_figure` ends every figure alike: one legend right of the axes, the title, whole-number
  step axes, a tight layout;
* :func:`add_caption` writes the line under a figure that says the target, the data and what each
  point averages.
* :func:`save_figure` writes a vector PDF and a PNG whose bytes depend only on the figure: no dates, no
  software version in the metadata, so a redraw from the saved tables is byte-identical.
"""

from __future__ import annotations

import re
import textwrap
from contextlib import contextmanager
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import seaborn as sns
from matplotlib.ticker import MaxNLocator

COLUMN, PAGE = 3.4, 7.0  # figure widths in inches: one column, the full page
CAPTION_PT = 6.5

_PALETTE = sns.color_palette("colorblind", 10)
PARADIGM_COLORS = {
    "hidden": _PALETTE[0],  # blue
    "kv": _PALETTE[3],  # vermilion
    "hybrid": _PALETTE[2],  # green
    "block": _PALETTE[4],  # purple
    "none": _PALETTE[7],  # grey: the no-target control
    "cross": _PALETTE[5],  # brown: cross-only (the hybrid's cross-attention path alone)
    "ngram": _PALETTE[1],  # orange
    "self": _PALETTE[9],  # sky blue
    "early-exit": _PALETTE[8],  # yellow
    "random": (0.0, 0.0, 0.0),
}
REGIME_STYLES = {"tf": ":", "ttt": "-", "ttt_dense": "--", "parallel": "-."}
MODE_STYLES = {"chain": "-", "tree": "--"}

RC = {
    "font.size": 8,
    "axes.titlesize": 8,
    "axes.labelsize": 8,
    "xtick.labelsize": 7,
    "ytick.labelsize": 7,
    "legend.fontsize": 7,
    "figure.titlesize": 9,
    "lines.linewidth": 1.3,
    "lines.markersize": 3.5,
    "pdf.fonttype": 42,  # TrueType in the PDF: editable text, accepted by publishers
    "svg.hashsalt": "kvshot",
    "axes.grid": True,
    "grid.alpha": 0.35,
}


def paper_theme() -> None:
    """Apply the suite's theme globally (seaborn ``whitegrid``, colour-blind palette, paper font sizes)."""
    sns.set_theme(context="paper", style="whitegrid", palette="colorblind", rc=RC)


@contextmanager
def paper_style():
    """The theme for the figures drawn inside the block only; the caller's rcParams come back after."""
    with matplotlib.rc_context():
        paper_theme()
        yield


def paradigm_of(name: str, paradigm: str | None = None) -> str:
    """A drafter's paradigm key for colours: its recorded paradigm, a baseline's name, or where a table records
    none, the paradigm its name starts with (``hidden31-ttt-s3``: hidden)."""
    if isinstance(paradigm, str) and paradigm in PARADIGM_COLORS:
        return paradigm
    if name.startswith("early-exit"):
        return "early-exit"
    stem = re.match(r"[a-z]+", name)
    return name if name in PARADIGM_COLORS else stem[0] if stem and stem[0] in PARADIGM_COLORS else ""


def drafter_color(name: str, paradigm: str | None = None):
    """The colour of a drafter: its paradigm's, so that every notebook colours a paradigm alike."""
    return PARADIGM_COLORS.get(paradigm_of(name, paradigm), (0.4, 0.4, 0.4))


def shade_lookalikes(looks: dict[str, dict], factor: float = 0.6) -> dict[str, dict]:
    """``looks`` (``{drafter: plot keywords}``, in drawing order) with every drafter that would look like an
    earlier one (the same colour, line and alpha: e.g. ``kv-ttt-tinit`` beside ``kv-ttt``) in another shade of
    its colour, darker and lighter in turn: the n-th look-alike is ``factor ** ceil(n / 2)`` of its colour for
    odd n, and that far toward white for even n, so that a paradigm's seventh drafter is not black. Changes and
    returns ``looks``."""
    seen: dict[tuple, int] = {}
    for kw in looks.values():
        key = (tuple(kw["color"]), kw.get("ls"), kw.get("alpha"))
        n = seen[key] = seen.get(key, -1) + 1
        if n:
            f = factor ** -(-n // 2)
            kw["color"] = tuple(c * f if n % 2 else 1 - (1 - c) * f for c in kw["color"])
    return looks


def finish_figure(fig, title: str | None = None, legend_from=None, integer_steps: bool = False, **legend):
    """The end of every figure: one legend right of the axes with ``legend_from``'s entries (an axis; ``legend``
    overrides its keywords), the ``title``, whole-number ticks on every x axis (``integer_steps``: draft steps,
    k) and a tight layout. Returns ``fig``."""
    if legend_from is not None:
        kw = dict(loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False, **legend)
        fig.legend(*legend_from.get_legend_handles_labels(), **kw)
    if title:
        fig.suptitle(title)
    if integer_steps:
        for ax in fig.axes:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return fig


def add_caption(fig, text: str) -> None:
    """A small caption line under the axes: the target, the data and what each point averages."""
    # wrapped here, to the figure's width: matplotlib's own wrap=True measures against the bbox of the
    # "tight" save, which an outside legend widens, and the last line then runs off the image
    chars = int(fig.get_figwidth() * 72 / (0.5 * CAPTION_PT))  # a 6.5 pt character is about half as wide
    fig.text(0.01, -0.01, textwrap.fill(text, chars), ha="left", va="top", fontsize=CAPTION_PT, color="0.25")


def save_figure(fig, figure_dir: str | Path, name: str) -> list[Path]:
    """Write ``fig`` as ``<figure_dir>/<name>.pdf`` (vector) and ``.png`` (200 dpi); returns both paths.

    The metadata carry no date or version, so the same figure drawn twice gives the same bytes."""
    figure_dir = Path(figure_dir)
    figure_dir.mkdir(parents=True, exist_ok=True)
    paths = [figure_dir / f"{name}.png", figure_dir / f"{name}.pdf"]
    tmp = [p.with_name(f".{p.name}.tmp") for p in paths]  # drawn beside, then renamed: never half a file
    fig.savefig(tmp[0], format="png", dpi=200, bbox_inches="tight", metadata={"Software": None})
    fig.savefig(
        tmp[1],
        format="pdf",
        bbox_inches="tight",
        metadata={"CreationDate": None, "Producer": None, "Creator": None},
    )
    for t, p in zip(tmp, paths):
        t.replace(p)
    plt.close(fig)
    return paths
