"""The MAT-by-drafter figure reads as a paper figure: drafters grouped by paradigm, ordered by stage, intervals."""

import pandas as pd

from kvshot_lib.plots import decoding, series


def test_stage_is_read_from_the_rows_name():
    assert series.stage_of("hidden-ttt@reference") == 0
    assert series.stage_of("hidden31-ttt") == series.stage_of("kv-ttt-zeroed") == 1
    assert series.stage_of("hidden31-ttt-noloop-s2") == 2
    assert series.stage_of("hybrid31-ttt-s3-zeroed") == 3
    assert series.stage_of("hidden-s2x") == 1  # a suffix, not any "-s" in the name


def test_drafters_are_grouped_by_paradigm_and_ordered_by_stage():
    rows = [  # the table's order: as the evaluation wrote it, in no order
        ("hybrid31-ttt-s3", "hybrid"),
        ("kv-ttt-zeroed", "kv"),
        ("hidden31-ttt-noloop-s2", "hidden"),
        ("ngram", "baseline"),
        ("hidden-ttt@reference", "hidden"),
        ("kv-ttt", "kv"),
        ("hybrid31-ttt-zeroed", "hybrid"),
        ("hybrid31-ttt", "hybrid"),
        ("hybrid-ttt", "hybrid"),
        ("none-ttt", "none"),
        ("hidden31-ttt@reference", "hidden"),
        ("hidden31-ttt", "hidden"),
    ]
    table = pd.DataFrame(rows, columns=["drafter", "paradigm"])
    assert series.drafter_order(table) == [
        "ngram",
        "none-ttt",
        "kv-ttt",
        "kv-ttt-zeroed",  # a control after its stage's drafters
        "hidden-ttt@reference",
        "hidden31-ttt@reference",  # EAGLE-3 before EAGLE 3.1 within a stage
        "hidden31-ttt",
        "hidden31-ttt-noloop-s2",
        "hybrid-ttt",
        "hybrid31-ttt",
        "hybrid31-ttt-zeroed",
        "hybrid31-ttt-s3",
    ]


def test_each_bar_carries_its_bootstrap_interval():
    summary = pd.DataFrame(
        [("a", "hidden", "chain", 0.0, 1.5), ("b", "kv", "chain", 0.0, 1.2)],
        columns=["drafter", "paradigm", "mode", "temperature", "mat"],
    )
    boot = pd.DataFrame(
        [("a", "chain", 0.0, "mat", 1.5, 1.4, 1.7), ("a", "chain", 0.0, "alpha_0", 0.4, 0.3, 0.5)],
        columns=["drafter", "mode", "temperature", "metric", "value", "lo", "hi"],
    )
    fig = decoding.plot_mat_by_drafter(summary, boot)
    ax = fig.axes[0]
    assert [round(p.get_width(), 6) for p in ax.patches] == [1.2, 1.5]  # kv before hidden
    (segments,) = [c.get_segments() for c in ax.collections]  # one interval: b has none
    (((lo, y0), (hi, y1)),) = segments
    assert (round(lo, 6), round(hi, 6)) == (1.4, 1.7) and y0 == y1
