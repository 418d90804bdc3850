"""The reference run's helper scripts (``scripts/reference/``) on hand-made inputs: the learning-curve points of a
row that is still training, read from its saved state and compared at equal budgets with a committed row."""

import json
import subprocess
import sys

import pandas as pd
import pytest

from kvshot_lib.target import REPO_ROOT

SCRIPTS = REPO_ROOT / "scripts" / "reference"
COMMITTED = REPO_ROOT / "figures" / "reference" / "data" / "learning_curves.csv"


def label(row):
    """The script's name for a row saved on this machine: ``row@here`` once a committed row has that name."""
    return f"{row}@here" if row in set(pd.read_csv(COMMITTED)["drafter"]) else row


def fake_state(root, row, points):
    """A row's saved training state (``runs/reference/drafters/<row>/state/trainer.json``) with ``points``
    (budget_step, tokens, acc_0) logged as the loop logs its learning-curve points."""
    state = root / "runs" / "reference" / "drafters" / row / "state"
    state.mkdir(parents=True)
    curve = [
        dict(
            **{f"acc_{k}": acc * 0.9**k for k in range(7)},
            **{f"n_{k}": 20000 if k else 40000 for k in range(7)},
            ce_0=2 - acc, ce_sd_0=2.0, step=budget + 10, budget_step=budget, tokens=tokens,
        )
        for budget, tokens, acc in points
    ]  # fmt: skip
    meta = dict(
        step=points[-1][0] + 40,
        config=dict(mixed_precision="no", paradigm="hybrid", regime="ttt", target_kv="zeroed"),
        logs=dict(
            curve=curve,
            eval=[dict(step=200, acc_0=0.21, n_0=40000), dict(step=400, acc_0=0.26, n_0=40000)],
            history=[
                dict(step=i + 1, seconds=t, tokens=1000)
                for i, t in enumerate((10.0, 12.0, 14.0, 100.0, 103.0))
            ],  # 86 s: a branch
        ),
    )
    (state / "trainer.json").write_text(json.dumps(meta))


def test_partial_curve_points_compare_a_saved_row_with_a_committed_one(tmp_path):
    committed = pd.read_csv(COMMITTED)
    hidden = committed[(committed["drafter"] == "hidden-ttt") & (committed["metric"] == "acc_0")]
    first, second = hidden.sort_values("budget_step").iloc[:2].itertuples()
    fake_state(
        tmp_path,
        "hybrid-ttt-zeroed",
        [(first.budget_step, first.tokens, 0.25), (second.budget_step, second.tokens, 0.3)],
    )
    out = tmp_path / "partial" / "curve.csv"
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "partial_curve_points.py"), "--rows", f"{tmp_path}:hybrid-ttt-zeroed",
         "--against", "hidden-ttt", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{label('hybrid-ttt-zeroed')}: step 299 saved, 2 curve points" in done.stdout
    points = pd.read_csv(out)
    acc0 = points[points["metric"] == "acc_0"].set_index("budget_step")
    assert acc0.loc[first.budget_step, "value"] == 0.25 and acc0.loc[second.budget_step, "value"] == 0.3
    assert set(points["target_kv"]) == {"zeroed"} and set(points["precision"]) == {"fp32"}
    gaps = pd.read_csv(out.with_name("curve_gaps.csv"))
    gap = gaps[(gaps["metric"] == "acc_0") & (gaps["minus"] == "hidden-ttt")].set_index("budget_step")
    assert list(gap.index) == [first.budget_step, second.budget_step]
    assert gap.loc[first.budget_step, "gap"] == pytest.approx(0.25 - first.value)
    assert gap.loc[second.budget_step, "gap"] == pytest.approx(0.3 - second.value)
    heldout = pd.read_csv(out.with_name("curve_heldout.csv"))
    mine = heldout[heldout["drafter"] == label("hybrid-ttt-zeroed")].set_index("step")["acc_0"]
    assert mine.to_dict() == {200: 0.21, 400: 0.26}  # the saved row's evaluations, beside the committed row's
    theirs = pd.read_csv(REPO_ROOT / "figures" / "reference" / "data" / "heldout_eval.csv")
    theirs = theirs[theirs["drafter"] == "hidden-ttt"]
    assert heldout[heldout["drafter"] == "hidden-ttt"]["acc_0"].tolist() == theirs["acc_0"].tolist()
    rule = pd.read_csv(out.with_name("curve_points.csv")).set_index(
        "budget_step"
    )  # the convergence rule's inputs
    assert rule.loc[second.budget_step, "ce_0"] == pytest.approx(1.7)
    assert rule.loc[second.budget_step, "ce_se_0"] == pytest.approx(
        2 / 200
    )  # sd 2 over sqrt(40,000) positions
    assert rule.loc[first.budget_step, "acc_se_0"] == pytest.approx((0.25 * 0.75 / 40000) ** 0.5)
    progress = pd.read_csv(out.with_name("curve_progress.csv")).iloc[0]
    assert progress["plain_steps"] == 3 and progress["seconds_per_step"] == pytest.approx(
        7 / 3
    )  # 2 + 2 + 3 s
    assert progress["token_passes_per_second"] == pytest.approx(3000 / 7) and progress["token_passes"] == 5000
    se = (0.25 * 0.75 / 40000 + first.se**2) ** 0.5  # the two points' binomial errors, combined
    assert gap.loc[first.budget_step, "hi"] - gap.loc[first.budget_step, "gap"] == pytest.approx(
        1.96 * se, rel=1e-3
    )


def test_keep_carries_a_stopped_rows_points_and_heldout_evaluations(tmp_path):
    committed = pd.read_csv(COMMITTED).query("drafter == 'hidden-ttt' and metric == 'acc_0'")
    budget = committed.sort_values("budget_step").iloc[0]
    first = tmp_path / "first" / "curve.csv"
    fake_state(tmp_path / "a", "hybrid-ttt-zeroed", [(int(budget.budget_step), int(budget.tokens), 0.25)])
    fake_state(tmp_path / "b", "hybrid-ttt", [(int(budget.budget_step), int(budget.tokens), 0.27)])
    script = [sys.executable, str(SCRIPTS / "partial_curve_points.py"), "--against", "hidden-ttt"]
    for rows, out, keep in (
        ([f"{tmp_path / 'a'}:hybrid-ttt-zeroed"], first, []),
        ([f"{tmp_path / 'b'}:hybrid-ttt"], tmp_path / "second" / "curve.csv", ["--keep", str(first)]),
    ):
        done = subprocess.run(
            [*script, "--rows", *rows, "--out", str(out), *keep],
            capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
    second = tmp_path / "second"
    points = pd.read_csv(second / "curve.csv").query("metric == 'acc_0'").set_index("drafter")["value"]
    assert points.to_dict() == {label("hybrid-ttt"): 0.27, label("hybrid-ttt-zeroed"): 0.25}
    heldout = pd.read_csv(second / "curve_heldout.csv")
    for row in (label("hybrid-ttt"), label("hybrid-ttt-zeroed")):  # the stopped row's, from the first table
        assert heldout[heldout["drafter"] == row].set_index("step")["acc_0"].to_dict() == {
            200: 0.21,
            400: 0.26,
        }
    committed = pd.read_csv(REPO_ROOT / "figures" / "reference" / "data" / "heldout_eval.csv")
    assert (heldout["drafter"] == "hidden-ttt").sum() == (committed["drafter"] == "hidden-ttt").sum()  # once
    gaps = pd.read_csv(second / "curve_gaps.csv").query("metric == 'acc_0'")
    hybrid, zeroed = label("hybrid-ttt"), label("hybrid-ttt-zeroed")
    pair = gaps[gaps["drafter"].isin([hybrid, zeroed]) & gaps["minus"].isin([hybrid, zeroed])]
    sign = pair["drafter"].map({hybrid: 1.0, zeroed: -1.0})  # the pair is named in either order
    assert (pair["gap"] * sign).tolist() == [pytest.approx(0.02)]


def test_stopped_rows_are_tabled_with_their_saved_step_and_drawn_beside_the_finished_ones(tmp_path):
    from kvshot_lib.plots import FIGURES, load_tables

    committed = pd.read_csv(COMMITTED)
    budget = committed.query("drafter == 'hidden-ttt'").sort_values("budget_step").iloc[0]
    fake_state(tmp_path, "hybrid-ttt-zeroed", [(int(budget.budget_step), int(budget.tokens), 0.25)])
    stopped = tmp_path / "stopped_curves.csv"
    stopped.write_text("drafter,metric,value\nblock-kv,acc_0,0.3\n")  # an earlier stopped row is kept
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "partial_curve_points.py"), "--rows", f"{tmp_path}:hybrid-ttt-zeroed",
         "--stopped", str(stopped)],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    table = pd.read_csv(stopped)
    mine = table[table["drafter"] == label("hybrid-ttt-zeroed")]
    assert set(mine["saved_step"]) == {int(budget.budget_step) + 40}  # the step the state was saved at
    assert mine.set_index("metric").loc["acc_0", "value"] == 0.25
    assert table.query("drafter == 'block-kv'")["value"].tolist() == [0.3]
    mine = mine.assign(train_steps=4150)
    counts = FIGURES["02_learning_curves"].counts(
        {"learning_curves.csv": committed, "stopped_curves.csv": mine}
    )
    assert counts.endswith(
        f"stopped: {label('hybrid-ttt-zeroed')} at step {int(budget.budget_step) + 40:,} of 4,150 "
        f"(last point {budget.tokens / 1e6:.1f}M token-passes)"
    )
    # a stopped row is drawn as "<row> (stopped)"; once the finished rows hold it, only theirs is drawn
    extra = mine.assign(drafter="extra-row")
    fig = FIGURES["02_learning_curves"].draw(
        {
            "learning_curves.csv": committed,
            "curve_asymptotes.csv": pd.DataFrame(columns=["drafter", "metric"]),
            "stopped_curves.csv": pd.concat([extra, committed.query("drafter == 'kv-ttt'")]),
        }
    )
    labels = fig.legends[0].get_texts()
    assert [t.get_text() for t in labels].count("extra-row (stopped)") == 1
    assert "kv-ttt (stopped)" not in [t.get_text() for t in labels]
    # the reference run's stopped row (block-kv) is read beside its learning curves where its table is present
    tables = load_tables("02_learning_curves", REPO_ROOT / "figures" / "reference" / "data")
    assert set(tables["stopped_curves.csv"]["drafter"]) == {"block-kv"}
    assert "stopped: block-kv at step 2,100 of 4,150" in FIGURES["02_learning_curves"].counts(tables)


def test_a_row_without_a_saved_state_is_refused(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "partial_curve_points.py"), "--rows", f"{tmp_path}:hybrid-ttt"],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
    )  # fmt: skip
    assert done.returncode != 0 and "no saved state for 'hybrid-ttt'" in done.stderr


def test_query_error_at_init_pairs_two_drafters_on_the_same_turns():
    sys.path.insert(0, str(SCRIPTS))  # the script is a file beside the library, not a module of it
    import query_error_at_init

    # out_err of drafters a, b and c on three turns x two draft steps, and the stale query's (which the pairing
    # must leave out: it compares a with b, not either with the stale query)
    values = {"a": [[1.0, 2.0], [3.0, 5.0], [2.0, 2.0]], "b": [[0.5, 1.0], [1.0, 1.0], [2.0, 3.0]]}
    values["c"] = [[9.0, 9.0]] * 3
    rows = [
        dict(
            drafter=d,
            estimator=est,
            level="layer",
            variant="without_sink",
            sequence=s,
            step=k,
            out_err=v + shift,
        )
        for d, grid in values.items()
        for est, shift in (("drafter", 0.0), ("stale", -7.0))
        for s, per_step in enumerate(grid)
        for k, v in enumerate(per_step)
    ]
    got = query_error_at_init.paired(pd.DataFrame(rows), "a", "b", "out_err").set_index("step")
    # by hand: a - b per turn and step is (0.5, 1), (2, 4), (0, -1); the mean over turns per step and overall
    assert got.loc[0, "diff"] == pytest.approx((0.5 + 2 + 0) / 3)
    assert got.loc[1, "diff"] == pytest.approx((1 + 4 - 1) / 3)
    assert got.loc[-1, "diff"] == pytest.approx((0.75 + 3 - 0.5) / 3)
    assert got.loc[-1, "drafter_mean"] == pytest.approx(15 / 6)  # a's mean, the "drafter" side
    assert got.loc[-1, "stale_mean"] == pytest.approx(8.5 / 6)  # b's mean, the baseline side
    assert set(got["drafter"]) == {"a - b"} and set(got["metric"]) == {"out_err"}


def test_mtbench_gap_measures_named_checkpoints_and_keeps_the_other_drafters_rows(tmp_path):
    sys.path.insert(0, str(SCRIPTS))
    import mtbench_gap

    from kvshot_lib.reference import checkpoint_folders, merged_table

    # the headline drafters it measures by default are committed (the malformed arguments:
    # test_reference_checkpoints.py)
    assert set(checkpoint_folders(None, mtbench_gap.DRAFTERS, REPO_ROOT)) == set(mtbench_gap.DRAFTERS)
    table = tmp_path / "gap.csv"
    pd.DataFrame(dict(drafter=["a", "b", "b"], value=[1, 2, 3])).to_csv(table, index=False)
    new = pd.DataFrame(dict(drafter=["b", "c"], value=[5, 6]))
    assert merged_table(table, new, ["drafter"]).values.tolist() == [["a", 1], ["b", 5], ["c", 6]]
    assert merged_table(tmp_path / "none.csv", new, ["drafter"]) is new


def test_a_row_finished_here_keeps_its_name_and_its_earlier_stretches_machines(tmp_path):
    """A carried row that finished on this machine is the committed row of its name (no ``@here``); its first
    stretch, which no restart names, takes its machine from the ``--keep`` table of an earlier session, and its
    last is the finishing machine's."""
    out_dir = tmp_path / "runs" / "reference" / "drafters" / "hybrid-ttt"
    out_dir.mkdir(parents=True)
    config = dict(mixed_precision="no", paradigm="hybrid", regime="ttt", target_kv="real")
    finisher = dict(precision="fp32", cpu="CPU C", bf16_isa="none")
    extra = dict(completed=True, train_config=config, machine=finisher)
    (out_dir / "config.json").write_text(json.dumps(dict(extra=extra)))
    steps = pd.DataFrame(dict(step=range(1, 7), seconds=[5.0, 6.0, 7.0, 50.0, 52.0, 54.0], tokens=100))
    steps.to_csv(out_dir / "history.csv", index=False)  # 1 s a step, then a restart at step 3 and 2 s a step
    pd.DataFrame([dict(step=3, seconds=7.0)]).to_csv(
        out_dir / "restarts.csv", index=False
    )  # names no machine
    curve = dict(acc_0=0.3, n_0=40000, ce_0=1.7, ce_sd_0=2.0, step=6, budget_step=6, tokens=600)
    pd.DataFrame([curve]).to_csv(out_dir / "curve.csv", index=False)
    pd.DataFrame([dict(step=4, acc_0=0.28, n_0=40000)]).to_csv(out_dir / "eval.csv", index=False)
    keep = tmp_path / "earlier" / "curve.csv"
    keep.parent.mkdir()
    pd.DataFrame([dict(drafter="hybrid-ttt", metric="acc_0", value=0.2)]).to_csv(keep, index=False)
    earlier = dict(drafter="hybrid-ttt", from_step=0, to_step=3, saved_step=3, precision="bf16", cpu="CPU A")
    pd.DataFrame([dict(earlier, bf16_isa="avx512_bf16")]).to_csv(
        keep.with_name("curve_progress.csv"), index=False
    )
    out = tmp_path / "now" / "curve.csv"
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "partial_curve_points.py"), "--rows", f"{tmp_path}:hybrid-ttt",
         "--keep", str(keep), "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "hybrid-ttt" in set(pd.read_csv(COMMITTED)["drafter"])  # the name a stopped row would label @here
    assert set(pd.read_csv(out)["drafter"]) == {"hybrid-ttt"}
    progress = pd.read_csv(out.with_name("curve_progress.csv"))
    assert progress["cpu"].tolist() == ["CPU A", "CPU C"] and progress["precision"].tolist() == [
        "bf16",
        "fp32",
    ]
    assert progress["from_step"].tolist() == [0, 3] and progress["to_step"].tolist() == [3, 6]
    assert progress["seconds_per_step"].tolist() == [pytest.approx(1.0), pytest.approx(2.0)]
    assert set(pd.read_csv(out)["cpu"]) == {"CPU C"}  # the one point, step 6, ran on the last stretch


def test_memorization_gap_counts_the_passes_a_continued_row_made_before_it_started():
    sys.path.insert(0, str(SCRIPTS))
    import memorization_gap

    from kvshot_lib.reference import load_plan

    plan = load_plan("onpolicy")
    # a row continued from stage 2's weights, 7,287,378 token-passes before it (the profile's tokens_before), and
    # its own 16,711,553 over 1,323,029 unique tokens: 23,998,931 in all, 18.14 passes (by hand: 23998931 / 1323029)
    info = {"unique_tokens": 1_323_029, "train_tokens": 16_711_553}
    got = memorization_gap.passes_over_data(info, plan.row("hidden31-ttt-noloop-s4"))
    assert got["token_passes"] == 23_998_931 and got["passes"] == 18.14
    # the stage-2 row trained from scratch: its own token-passes only
    fresh = memorization_gap.passes_over_data(info, plan.row("hidden31-ttt-noloop-s2"))
    assert fresh["token_passes"] == 16_711_553 and fresh["passes"] == 12.63
