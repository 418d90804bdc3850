"""The plots stage: every figure, drawn from a saved table, in one paper style.

* :mod:`.style`: the theme (seaborn, colour-blind palette, one colour per paradigm), sizes for a two-column
  paper, the caption line, and :func:`save_figure` (PDF + PNG with no dates, so redraws are byte-identical);
* :mod:`.series`: which drafters a figure draws and in what order: at most eight lines an axis, legends grouped
  by paradigm and ordered by stage (``tests/test_figure_rules.py`` holds every registered figure to it);
* one module per notebook family: :mod:`.corpus` (00), :mod:`.diagnostics` (01, 04), :mod:`.training` (02), :mod:`.probes` (05), :mod:`.gap` (04's MT-bench gap and memorization),
  :mod:`.acceptance` (03's acceptance by step, and 02's held-out accuracy beside the paper's Table 5),
  :mod:`.decoding` (03's MAT, 06), :mod:`.specpv` (07);
  their functions take the saved tables (DataFrames), never live objects;
* :mod:`.registry`: every figure with the tables it reads (:data:`FIGURES`); :mod:`.counts`: what each
  caption line counts;
* :mod:`.figures`: :func:`publish` (a notebook keeps the tables beside the figure and draws it from them) and
  :func:`redraw` (``kvshot figures``).
"""

from . import acceptance, corpus, decoding, diagnostics, figures, probes, registry, series, specpv, training
from .figures import FigureDataError, draw, load_tables, publish, redraw, set_caption
from .registry import FIGURES, FigureSpec
from .style import (
    COLUMN,
    PAGE,
    PARADIGM_COLORS,
    add_caption,
    drafter_color,
    finish_figure,
    paper_style,
    paper_theme,
    save_figure,
    shade_lookalikes,
)

__all__ = [
    "COLUMN",
    "FIGURES",
    "PAGE",
    "PARADIGM_COLORS",
    "FigureDataError",
    "FigureSpec",
    "acceptance",
    "add_caption",
    "corpus",
    "decoding",
    "diagnostics",
    "draw",
    "drafter_color",
    "figures",
    "finish_figure",
    "load_tables",
    "paper_style",
    "paper_theme",
    "probes",
    "publish",
    "redraw",
    "registry",
    "save_figure",
    "series",
    "set_caption",
    "shade_lookalikes",
    "specpv",
    "training",
]
