"""The rules every figure of the registry keeps, checked by drawing each one from a small table of many drafters:

* at most :data:`MAX_SERIES` series (drawn lines) per axis, however many drafters the run has;
* its legend grouped by paradigm and ordered by stage, as the MAT figure's y axis is
  (:func:`kvshot_lib.plots.series.drafter_order`).

The small table: a committed figure folder's table of the figure, cut to one drafter's rows, and those rows copied
under the names of a run of :data:`RUN` (14 drafters of five paradigms and four stages, listed in no order), so that
the figure meets as many drafters as the on-policy run has. Before issue 66 the acceptance figure drew 28 series on
an axis of this table (38 on the on-policy run's), and this test failed on it.
"""

from __future__ import annotations

import matplotlib
import pandas as pd
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from conftest import MANY_DRAFTERS  # noqa: E402

from kvshot_lib.plots import FIGURES, load_tables, paper_style, series  # noqa: E402
from kvshot_lib.target import REPO_ROOT  # noqa: E402

MAX_SERIES = 8  # the number (kvshot_lib.plots.series.MAX_SERIES is what the figures keep)
RUN = MANY_DRAFTERS  # (drafter, paradigm): the order a run's evaluation might write them in
FOLDERS = [REPO_ROOT / "figures" / p / "data" for p in ("onpolicy", "reference", "full", "default")]


def _source(spec) -> tuple:
    """A committed folder holding every table of ``spec``."""
    for folder in FOLDERS:
        if all((folder / t).is_file() for t in spec.tables):
            return folder
    pytest.skip(f"no committed folder holds the tables of {spec.name}")


def _widen(tables: dict) -> dict:
    """Every table with a drafter column cut to one drafter's rows (one that all of them have) and copied under
    the names of :data:`RUN`; the others as they are."""
    frames = {t: d for t, d in tables.items() if isinstance(d, pd.DataFrame) and "drafter" in d}
    if not frames:
        return tables
    common = set.intersection(*(set(d["drafter"]) for d in frames.values()))
    if not common:
        return tables
    first = next(iter(frames.values()))
    source = next((n for n in first["drafter"] if n in common and n != "-"), None)  # "-": plain decoding
    if source is None:
        return tables
    out = dict(tables)
    for t, d in frames.items():
        rows = d[d["drafter"] == source]
        copies = []
        for name, paradigm in RUN:
            c = rows.assign(drafter=name)
            if "paradigm" in c:
                c = c.assign(paradigm=paradigm)
            if "target_kv" in c:
                c = c.assign(target_kv="zeroed" if "zeroed" in name else "real")
            copies.append(c)
        out[t] = pd.concat(copies, ignore_index=True)
    return out


def _series(ax) -> int:
    """Drawn lines of data on ``ax``: not reference lines (axhline, ticks in axes coordinates), nor markers alone."""
    return sum(
        line.get_transform() is ax.transData
        and line.get_linestyle() not in ("None", "none", "", " ")
        and len(line.get_xdata()) >= 2
        for line in ax.lines
    )


def _legend_drafters(fig) -> list[list[str]]:
    """Per legend of the figure, the drafters it names, in its order (a label is a drafter's name, or starts with
    it and a space: "kv-ttt (chain)")."""
    names = sorted((n for n, _ in RUN), key=len, reverse=True)
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
    found = []
    for legend in legends:
        labels = [t.get_text() for t in legend.get_texts()]
        hits = [next((n for n in names if lb == n or lb.startswith(n + " ")), None) for lb in labels]
        found.append([h for h in hits if h])
    return found


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_every_figure_keeps_the_series_rule(name):
    spec = FIGURES[name]
    tables = _widen(load_tables(name, _source(spec)))
    with paper_style():
        fig = spec.draw(tables)
    try:
        crowded = {
            ax.get_title() or i: _series(ax) for i, ax in enumerate(fig.axes) if _series(ax) > MAX_SERIES
        }
        assert not crowded, f"{name}: more than {MAX_SERIES} series on an axis: {crowded}"
        order = {
            n: i
            for i, n in enumerate(series.drafter_order(pd.DataFrame(RUN, columns=["drafter", "paradigm"])))
        }
        for named in _legend_drafters(fig):
            ranks = [order[n] for n in named]
            assert ranks == sorted(ranks), (
                f"{name}: legend not grouped by paradigm and ordered by stage: {named}"
            )
    finally:
        plt.close(fig)


def test_the_rule_counts_what_a_reader_sees():
    """Two lines of data count; a reference line, an error bar's caps and a lone marker do not."""
    fig, ax = plt.subplots()
    ax.plot([0, 1, 2], [1, 2, 3])
    ax.plot([0, 1], [3, 1], ls="--")
    ax.axhline(1.0)
    ax.errorbar([0, 1], [1, 2], yerr=0.1, fmt="o", capsize=2)
    ax.plot([1], [1], marker="o")
    assert _series(ax) == 2
    plt.close(fig)
