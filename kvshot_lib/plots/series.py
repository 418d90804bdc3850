"""Which drafters a figure draws, and in what order: the rule every line figure of the registry keeps.

* :func:`drafter_order`: drafters grouped by paradigm (:data:`PARADIGM_ORDER`) and ordered by stage
  (:func:`stage_of`), as the MAT figure lists them; every legend lists drafters in this order.
* :func:`headline`: a paradigm's headline drafter, the one a reader compares across paradigms: its latest
  stage's main row (EAGLE 3.1 before EAGLE-3, TTT before other regimes, the plainest name), never a control.
* :func:`by_priority`: a paradigm's drafters, most telling first: the headline, its zeroed-KV control, the
  main row of each earlier stage (latest first), then the rest.
* :func:`pick_drafters`: at most :data:`MAX_SERIES` drafters, the paradigms' headlines first, then their
  controls, and so on in turn; what is left out stays in the table, and :func:`left_out` says so in the legend.

``tests/test_figure_rules.py`` draws every registered figure from a table of 14 drafters and checks both rules.
"""

from __future__ import annotations

import re

import pandas as pd
from matplotlib.lines import Line2D

from .style import paradigm_of

MAX_SERIES = 8  # lines of data on one axis

# left to right in the MAT figure: the baselines, the control without the target, then the target readers
PARADIGM_ORDER = ("ngram", "random", "self", "early-exit", "none", "kv", "hidden", "cross", "hybrid", "block")
# which paradigms keep their lines first when a figure has room for only some
IMPORTANCE = ("hidden", "kv", "hybrid", "block", "cross", "none", "ngram", "self", "early-exit", "random")


def paradigm_keys(table: pd.DataFrame) -> dict[str, str]:
    """Per drafter, in the table's order: its paradigm's key (its recorded paradigm, or a baseline's name)."""
    recorded = {}
    if "paradigm" in table:
        recorded = dict(
            table[["drafter", "paradigm"]].drop_duplicates("drafter").itertuples(index=False, name=None)
        )
    return {name: paradigm_of(name, recorded.get(name)) for name in dict.fromkeys(table["drafter"])}


def stage_of(name: str) -> int:
    """A drafter's stage, from its name: 0 for another run's checkpoint (``row@run``), ``n`` for a ``-s<n>`` row
    (``hidden31-ttt-noloop-s2``), else 1."""
    if "@" in name:
        return 0
    m = re.search(r"-s(\d+)(?=-|$)", name)
    return int(m.group(1)) if m else 1


def is_control(name: str) -> bool:
    """A drafter trained with the target's KV zeroed (``kv-ttt-zeroed``)."""
    return "zeroed" in name


def _eagle31(name: str) -> bool:
    return name.split("-")[0].endswith("31")


def drafter_order(table: pd.DataFrame) -> list[str]:
    """The drafters of ``table``, grouped by paradigm (:data:`PARADIGM_ORDER`, unknown ones last) and ordered by
    stage within a paradigm, a zeroed-KV control after the drafters of its stage, EAGLE-3 before EAGLE 3.1 (a
    ``31`` row: ``hidden31-ttt``); the table's order breaks ties."""
    keys, rank = paradigm_keys(table), {p: i for i, p in enumerate(PARADIGM_ORDER)}

    def key(i_name):
        i, name = i_name
        return rank.get(keys[name], len(rank)), stage_of(name), is_control(name), _eagle31(name), i

    return [name for _, name in sorted(enumerate(keys), key=key)]


def _main_first(names: list[str]) -> list[str]:
    """``names`` (of one stage) with the main row first: EAGLE 3.1, TTT, the plainest name, the table's order."""
    return sorted(names, key=lambda n: (not _eagle31(n), "-ttt" not in n, n.count("-"), len(n)))


def headline(names: list[str]) -> str | None:
    """The headline of one paradigm's drafters ``names``: the main row of its latest stage (None: only controls)."""
    rows = [n for n in names if not is_control(n)]
    if not rows:
        return None
    last = max(stage_of(n) for n in rows)
    return _main_first([n for n in rows if stage_of(n) == last])[0]


def by_priority(names: list[str]) -> list[str]:
    """One paradigm's drafters, most telling first (see the module's docstring)."""
    top = headline(names)
    if top is None:
        return list(names)
    first = [top, *(n for n in names if n == f"{top}-zeroed")]
    rows = [n for n in names if not is_control(n) and n != top]
    stages = sorted({stage_of(n) for n in rows}, reverse=True)
    leads = [_main_first([n for n in rows if stage_of(n) == s])[0] for s in stages]
    rest = sorted(
        (n for n in names if n not in first and n not in leads), key=lambda n: -stage_of(n)
    )  # stable: the table's order within a stage
    return [*first, *(n for n in leads if n != top), *rest]


def pick_drafters(table: pd.DataFrame, limit: int = MAX_SERIES) -> list[str]:
    """At most ``limit`` drafters of ``table`` in :func:`drafter_order`: all of them where they fit, else the
    paradigms' :func:`by_priority` lists taken in turns (the target readers' first, :data:`IMPORTANCE`)."""
    order = drafter_order(table)
    if len(order) <= limit:
        return order
    keys = paradigm_keys(table)
    rank = {p: i for i, p in enumerate(IMPORTANCE)}
    paradigms = sorted(dict.fromkeys(keys[n] for n in order), key=lambda p: rank.get(p, len(rank)))
    queues = [by_priority([n for n in order if keys[n] == p]) for p in paradigms]
    chosen: set[str] = set()
    for turn in range(max(len(q) for q in queues)):
        for q in queues:
            if turn < len(q) and len(chosen) < limit:
                chosen.add(q[turn])
    return [n for n in order if n in chosen]


def left_out(table: pd.DataFrame, drawn, where: str) -> list:
    """A legend entry saying how many of ``table``'s drafters a figure leaves out (none: no entry)."""
    n = len(set(table["drafter"]) - set(drawn))
    if not n:
        return []
    return [Line2D([], [], ls="none", label=f"(+{n} more in {where}: at most {MAX_SERIES} lines an axis)")]


def drafter_rows(df: pd.DataFrame) -> list[tuple[str, str, str, str]]:
    """(drafter, paradigm, regime, target_kv) grouped by paradigm and ordered by stage as in the MAT figure
    (:func:`drafter_order`); tables written before controls existed are "real"."""
    df = df if "target_kv" in df else df.assign(target_kv="real")
    cols = ["drafter", "paradigm", "regime", "target_kv"]
    rank = {name: i for i, name in enumerate(drafter_order(df))}
    return sorted(df[cols].drop_duplicates().itertuples(index=False, name=None), key=lambda d: rank[d[0]])
