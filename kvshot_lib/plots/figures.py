"""Publishing and redrawing the figures of :mod:`.registry` (each named once there with its tables).

A notebook saves its result tables under ``runs/<profile>/results/`` first, then calls :func:`publish`,
which copies the figure's tables into ``figures/<profile>/data/`` and draws the figure from that copy. So
the committed figures of a profile sit beside the exact tables they were drawn from, and::

    kvshot figures --profile default [--out DIR]

redraws all of them from ``figures/default/data/`` without loading a model, byte for byte (the figure
files carry no dates; see :func:`~kvshot_lib.plots.style.save_figure`). To restyle a figure in JupyterLab,
read its tables (:func:`load_tables`) and call its plotting function, or edit the style and redraw.

A figure's caption line (the target, the data, what a point averages) is built from ``captions.json``,
which :func:`publish` writes beside the tables from what the notebook knows (target, data), plus counts
taken from the tables themselves.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from ..user_errors import EXIT_FAILURE, EXIT_USAGE
from .registry import FIGURES, FigureSpec
from .style import add_caption, paper_style, save_figure

CAPTIONS = "captions.json"


class FigureDataError(ValueError):
    """A figure's table is missing or malformed; the message names the figure, the table and its notebook."""


def _read(path: Path, spec: FigureSpec, table: str):
    where = f"figure {spec.name!r} needs the table {table!r}, which {spec.writer} writes"
    if not path.is_file():
        raise FigureDataError(
            f"{where}; it is missing from {path.parent}. Run `{spec.rerun}` or restore the file."
        )
    try:
        data = json.loads(path.read_text()) if path.suffix == ".json" else pd.read_csv(path)
    except (ValueError, pd.errors.ParserError) as e:
        raise FigureDataError(f"{where}; {path} is malformed: {e}") from None
    missing = [c for c in spec.columns.get(table, []) if c not in getattr(data, "columns", data)]
    if missing or (isinstance(data, pd.DataFrame) and data.empty):
        what = f"lacks the columns {missing}" if missing else "has no rows"
        raise FigureDataError(f"{where}; {path} {what}. Rerun `{spec.rerun}`.")
    return data


def load_tables(name: str, data_dir: str | Path) -> dict:
    """The tables of figure ``name`` from ``data_dir``, checked: {file name: DataFrame or dict}."""
    spec = _spec(name)
    return {table: _read(Path(data_dir) / table, spec, table) for table in _tables(spec, data_dir)}


def _tables(spec: FigureSpec, folder: str | Path) -> tuple[str, ...]:
    """The tables ``spec`` reads from ``folder``: all of its own, and those of its optional ones that are there."""
    return (*spec.tables, *(t for t in spec.optional if (Path(folder) / t).is_file()))


def _spec(name: str) -> FigureSpec:
    if name not in FIGURES:
        raise FigureDataError(f"unknown figure {name!r}; the suite's figures are {sorted(FIGURES)}.")
    return FIGURES[name]


def draw(name: str, data_dir: str | Path, figure_dir: str | Path) -> object:
    """Draw figure ``name`` from the tables in ``data_dir`` and save it (PDF + PNG) in ``figure_dir``."""
    spec = _spec(name)
    tables = load_tables(name, data_dir)
    captions = Path(data_dir) / CAPTIONS
    context = json.loads(captions.read_text()).get(name, "") if captions.is_file() else ""
    with paper_style():
        fig = spec.draw(tables)
        add_caption(fig, " · ".join(x for x in (context, spec.counts(tables)) if x))
        save_figure(fig, figure_dir, name)
    return fig


def publish(name: str, results_dir: str | Path, figure_dir: str | Path, context: str = "") -> object:
    """Keep figure ``name``'s tables beside it (``<figure_dir>/data/``) and draw it from that copy.

    ``context`` starts its caption line: the target and the data, e.g. "SmolLM2-135M-Instruct · MT-bench"."""
    spec = _spec(name)
    data_dir = Path(figure_dir) / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    for table in _tables(spec, results_dir):
        src = Path(results_dir) / table
        _read(src, spec, table)  # a clear error before anything is copied
        shutil.copyfile(src, data_dir / table)
    set_caption(data_dir, name, context)
    return draw(name, data_dir, figure_dir)


def set_caption(data_dir: str | Path, name: str, context: str) -> None:
    """Record ``context`` as the start of figure ``name``'s caption line in ``data_dir``'s ``captions.json``."""
    captions = Path(data_dir) / CAPTIONS
    known = json.loads(captions.read_text()) if captions.is_file() else {}
    known[name] = context
    captions.write_text(json.dumps(dict(sorted(known.items())), indent=1) + "\n")


def redraw(figure_dir: str | Path, out_dir: str | Path | None = None, names=None) -> list[str]:
    """Redraw every figure of a profile's folder from its ``data/`` tables (into ``out_dir``, default the
    same folder). A figure is expected where its PNG or any of its tables is present (and its ``only_with`` table,
    where it names one); returns the names."""
    figure_dir = Path(figure_dir)
    data_dir = figure_dir / "data"
    if not data_dir.is_dir():
        raise FigureDataError(
            f"{figure_dir} has no data/ folder of tables; run the profile's notebooks first."
        )
    if names is None:
        names = [
            s.name
            for s in FIGURES.values()
            if (figure_dir / f"{s.name}.png").is_file()
            or (
                any((data_dir / t).is_file() for t in s.tables)
                and (not s.only_with or (data_dir / s.only_with).is_file())
            )
        ]
    for name in names:
        plt.close(draw(name, data_dir, out_dir or figure_dir))
    return list(names)


def add_cli(sub) -> None:
    p = sub.add_parser("figures", help="redraw a profile's figures from its saved tables (no model loaded)")
    p.add_argument(
        "--profile",
        default="default",
        help="a profile whose figures/<profile>/data/ holds tables, or the path of such a figure folder",
    )
    p.add_argument("--out", default=None, help="write the figures here (default: figures/<profile>/)")
    p.add_argument(
        "--only", nargs="+", default=None, metavar="FIGURE", help="figure names, e.g. 03_mat_by_drafter"
    )
    p.set_defaults(func=_cli_figures)


def _cli_figures(args) -> int:
    import sys

    from ..target.assets import REPO_ROOT

    figure_dir = REPO_ROOT / "figures" / args.profile
    if not figure_dir.is_dir() and Path(args.profile).is_dir():  # a figure folder given by its path
        figure_dir = Path(args.profile)
    known = sorted(p.parent.name for p in (REPO_ROOT / "figures").glob("*/data") if p.is_dir())
    unknown = [n for n in args.only or [] if n not in FIGURES]
    if not figure_dir.is_dir() or unknown:
        what = f"unknown figures {unknown}" if unknown else f"no profile or figure folder {args.profile!r}"
        fix = (
            f"the suite's figures are {sorted(FIGURES)}"
            if unknown
            else f"the profiles with figures are {known}"
        )
        print(f"kvshot figures: {what}; {fix}.", file=sys.stderr)
        return EXIT_USAGE
    try:
        names = redraw(figure_dir, args.out, args.only)
    except FigureDataError as e:
        print(f"kvshot figures: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"redrew {len(names)} figures of {args.profile} into {args.out or figure_dir}: {', '.join(names)}")
    return 0
