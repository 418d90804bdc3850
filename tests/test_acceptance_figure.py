"""The acceptance-by-step figure and the Table-5 figure draw what a reader needs, worked out by hand on small tables."""

import math

import matplotlib
import numpy as np
import pandas as pd

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from conftest import MANY_DRAFTERS  # noqa: E402

from kvshot_lib.plots import acceptance, drafter_color, series  # noqa: E402

RUN = pd.DataFrame(MANY_DRAFTERS, columns=["drafter", "paradigm"])  # in the order its evaluation wrote them


def test_a_paradigms_headline_is_its_latest_stages_main_row_never_a_control():
    assert series.headline(["hidden-ttt", "hidden31-ttt", "hidden31-ttt-noloop-s2", "hidden31-ttt-s3"]) == (
        "hidden31-ttt-s3"
    )
    assert series.headline(["kv-tf", "kv-ttt", "kv-ttt-tinit", "kv-ttt-zeroed"]) == "kv-ttt"  # TTT, plainest
    assert series.headline(["hidden-ttt", "hidden31-ttt"]) == "hidden31-ttt"  # EAGLE 3.1 over EAGLE-3
    assert series.headline(["kv-ttt-zeroed"]) is None


def test_eight_lines_keep_each_paradigms_headline_then_its_control():
    # round 1: the headlines of hidden, kv, hybrid, block, none, ngram; round 2: hidden's stage 2, kv's control
    assert series.pick_drafters(RUN) == [
        "ngram",
        "none-ttt",
        "kv-ttt",
        "kv-ttt-zeroed",
        "hidden31-ttt-noloop-s2",
        "hidden31-ttt-s3",
        "hybrid31-ttt-s3",
        "block-kv",
    ]
    assert series.pick_drafters(RUN.head(5)) == series.drafter_order(RUN.head(5))  # all fit: all drawn


def test_a_panel_holds_six_lines_the_headline_its_control_one_row_per_earlier_stage_and_the_references():
    assert acceptance.panel_drafters(RUN, "hidden") == [
        "ngram",
        "none-ttt",
        "hidden31-ttt@reference",  # stage 0: EAGLE 3.1 before EAGLE-3 (hidden-ttt@reference left out)
        "hidden31-ttt",
        "hidden31-ttt-noloop-s2",
        "hidden31-ttt-s3",
    ]
    assert acceptance.panel_drafters(RUN, "hybrid") == [
        "ngram",
        "none-ttt",
        "hybrid31-ttt",
        "hybrid31-ttt-zeroed",
        "hybrid31-ttt-s3",
        "hybrid31-ttt-s3-zeroed",
    ]


def test_the_reach_band_sums_the_steps_log_variances():
    # alpha 0.5 at both steps, each interval 0.5 ± 1.96 * 0.05: log-scale sd 0.05 / 0.5 = 0.1 per step
    lo, hi = acceptance.reach_band([0.5, 0.5], [0.5 - 1.96 * 0.05] * 2, [0.5 + 1.96 * 0.05] * 2)
    assert np.allclose(lo, [0.5 * math.exp(-1.96 * 0.1), 0.25 * math.exp(-1.96 * math.sqrt(0.02))])
    assert np.allclose(hi, [0.5 * math.exp(1.96 * 0.1), 0.25 * math.exp(1.96 * math.sqrt(0.02))])


def test_the_reach_band_covers_like_a_bootstrap_of_independent_cycles():
    """Cycles drawn independently (no turn effects): the product's own bootstrap interval and the band agree."""
    rng = np.random.default_rng(0)
    alpha = np.array([0.6, 0.5, 0.7])
    depth = np.zeros(4000, int)  # accepted drafts per cycle, chain of 3
    for k, a in enumerate(alpha):
        depth += (depth == k) & (rng.random(4000) < a)

    def rates(d):
        att = np.array([(d >= k).sum() for k in range(3)])
        return np.array([(d >= k + 1).sum() for k in range(3)]) / att

    point = rates(depth)
    draws = np.array([rates(depth[rng.integers(0, 4000, 4000)]) for _ in range(2000)])  # [2000, 3]
    lo_a, hi_a = np.percentile(draws, [2.5, 97.5], axis=0)
    lo, hi = acceptance.reach_band(point, lo_a, hi_a)
    lo_p, hi_p = np.percentile(np.cumprod(draws, axis=1), [2.5, 97.5], axis=0)
    assert np.allclose(lo, lo_p, rtol=0.05) and np.allclose(hi, hi_p, rtol=0.05)


def _table(attempts_t0, attempts_t1=()):
    rows = []
    for temp, attempts in ((0.0, attempts_t0), (1.0, attempts_t1)):
        reach = 1.0
        for k, n in enumerate(attempts):
            reach *= 0.5
            rows.append(("hidden-ttt", "hidden", "chain", temp, k, 0.5, reach, n))
    cols = [
        "drafter",
        "paradigm",
        "mode",
        "temperature",
        "step",
        "alpha_conditional",
        "p_reach",
        "n_attempts",
    ]
    return pd.DataFrame(rows, columns=cols)


def test_conditional_points_below_the_minimum_of_attempts_are_not_drawn():
    fig = acceptance.plot_acceptance_by_step(_table([1000, 400, 199, 50, 10]))
    reach, alpha = fig.axes  # one paradigm, T=0 only: no bootstrap table, so no T=1 row
    assert list(alpha.lines[0].get_xdata()) == [0, 1]  # >= 200 attempts
    assert list(reach.lines[0].get_xdata()) == [0, 1, 2, 3]  # >= 20 attempts
    plt.close(fig)


def test_a_higher_temperature_is_drawn_only_where_the_bootstrap_table_has_its_intervals():
    table = _table([1000, 500, 300], [900, 400, 250])
    boot = pd.DataFrame(
        [("hidden-ttt", "chain", t, f"alpha_{k}", 0.45, 0.55) for t in (0.0, 1.0) for k in range(3)],
        columns=["drafter", "mode", "temperature", "metric", "lo", "hi"],
    )
    assert len(acceptance.plot_acceptance_by_step(table).axes) == 2  # T=0: reach, alpha
    assert len(acceptance.plot_acceptance_by_step(table, boot[boot["temperature"] == 0]).axes) == 2
    fig = acceptance.plot_acceptance_by_step(table, boot)
    assert [ax.get_ylabel().split("\n")[0] for ax in fig.axes] == ["T = 0", "T = 0", "T = 1", "T = 1"]
    band = fig.axes[1].collections[0].get_paths()[0].vertices[:, 1]  # the alpha band at T=0
    assert band.min() == 0.45 and band.max() == 0.55
    plt.close("all")


def test_the_papers_rows_are_dashed_in_the_colour_of_the_paradigm_they_stand_for():
    per_step = pd.DataFrame(
        [
            (name, p, k, 0.3, 1000)
            for name, p in (("kv-ttt", "kv"), ("hidden-ttt", "hidden"))
            for k in range(7)
        ],
        columns=["drafter", "paradigm", "draft_step", "accuracy", "n"],
    )
    paper = pd.DataFrame(  # the KV row of the paper's Table 5 only
        [("KV 1L, head concatenation", 0.489, 0.393, 0.353, 0.332, 0.32, 0.311, 0.305)],
        columns=["paper_row", *(f"alpha_{k}" for k in range(7))],
    )
    fig = acceptance.plot_paper_table5(per_step, paper)
    lines = {ln.get_label(): ln for ln in fig.axes[0].lines}
    dashed = lines[f"{acceptance.PAPERS}: KV 1L, head concatenation"]
    assert dashed.get_linestyle() == "--" and dashed.get_color() == drafter_color("kv-ttt", "kv")
    assert list(dashed.get_ydata()) == [0.489, 0.393, 0.353, 0.332, 0.32, 0.311, 0.305]
    assert f"hidden-ttt ({acceptance.OURS})" in lines  # no paper row in the table: ours alone
    plt.close(fig)


def test_on_the_committed_chains_the_band_is_nearly_as_wide_as_the_turn_bootstrap():
    """The band treats the steps as independent; turns make them correlate. Measured where the committed tables
    allow: the chain MAT interval that the per-step intervals imply (MAT - 1 = sum of the reach probabilities,
    their log-scale covariances summed over shared steps) against the bootstrap's own MAT interval over turns."""
    from kvshot_lib.target import REPO_ROOT

    data = REPO_ROOT / "figures" / "onpolicy" / "data"
    table, boot = pd.read_csv(data / "acceptance_by_step.csv"), pd.read_csv(data / "acceptance_bootstrap.csv")
    ratios = {}
    for name, d in table[(table["mode"] == "chain") & (table["temperature"] == 0)].groupby("drafter"):
        b = boot[(boot["drafter"] == name) & (boot["mode"] == "chain") & (boot["temperature"] == 0)]
        b = b.set_index("metric")
        d = d[(d["step"] < 7) & (d["alpha_conditional"] > 0)].sort_values("step")  # alpha 0: its reach is 0
        alpha = d["alpha_conditional"].to_numpy()
        lo, hi = (np.array([b.loc[f"alpha_{k}", c] for k in d["step"]]) for c in ("lo", "hi"))
        var = ((hi - lo) / 3.92 / alpha) ** 2  # per step, log scale
        shared = np.cumsum(var)[np.minimum.outer(np.arange(len(var)), np.arange(len(var)))]  # [K, K]
        reach = np.cumprod(alpha)
        implied = np.sqrt(reach @ shared @ reach)
        ratios[name] = implied / ((b.loc["mat", "hi"] - b.loc["mat", "lo"]) / 3.92)
    trained = [r for name, r in ratios.items() if name != "ngram"]
    drafters = pd.read_csv(data / "acceptance_summary.csv")["drafter"].nunique()
    assert len(trained) == drafters - 1 and not np.isnan(trained).any()  # every trained drafter
    assert 0.71 <= min(trained) and max(trained) <= 1.01  # the docstring of plots.acceptance: 72-100%
    assert ratios["ngram"] > 2  # no band is drawn for the n-gram drafter (a faint reference)
