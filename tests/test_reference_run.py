"""The reference run on one machine (``kvshot_lib.reference``), the whole CPU path at smoke scale: a feature store
extracted once, every row of the plan trained to its plateau rule or token-pass cap, the KV ablation, the committed
checkpoints within their limits, the MT-bench evaluation, Table 5 with the paper's numbers, the learning curves
and the figures; a second run reads the finished rows back instead of training them again."""

import dataclasses
import json
import math
import shutil

import pandas as pd
import pytest
import torch

from kvshot_lib.corpus import FeatureStore
from kvshot_lib.plots import redraw
from kvshot_lib.reference import PlanError, init_path, load_plan, run_reference, status, tables
from kvshot_lib.target import cache_dir, load_target
from kvshot_lib.training import budget_note

ROWS = ["none-ttt", "hidden-ttt", "kv-ttt", "kv-ttt-zeroed", "hybrid-ttt", "hybrid-ttt-zeroed", "kv-ttt-tinit",
        "block-kv", "hidden31-ttt"]  # fmt: skip
KV_READERS = {"kv-ttt", "kv-ttt-zeroed", "hybrid-ttt", "hybrid-ttt-zeroed", "kv-ttt-tinit", "block-kv"}

MB = 10**6  # the limits are in decimal megabytes


def test_the_reference_plan_is_the_issues():
    plan = load_plan("reference")
    assert plan.training_order() == ROWS and plan.device == "auto" and plan.run_name == "reference"
    assert plan.headline_rows() == [
        "none-ttt",
        "hidden-ttt",
        "kv-ttt",
        "hybrid-ttt",
        "kv-ttt-tinit",
        "block-kv",
        "hidden31-ttt",
    ]
    cfgs = {r: plan.row(r).train_config() for r in ROWS}
    assert {(c.schedule, c.plateau_stop, c.data_source, c.mixed_precision) for c in cfgs.values()} == {
        ("wsd", 0.01, "store", "auto")
    }  # one schedule family and one stopping rule for every row
    assert cfgs["kv-ttt-tinit"].init_from == "target" and cfgs["kv-ttt-zeroed"].target_kv == "zeroed"
    assert (
        cfgs["hidden31-ttt"].fc_norm and cfgs["hidden31-ttt"].norm_output
    )  # EAGLE 3.1 on the original answers
    assert (cfgs["block-kv"].paradigm, cfgs["block-kv"].n_layers, cfgs["block-kv"].regime) == (
        "block",
        2,
        "parallel",
    )
    assert plan.budget["token_passes"] == 8_000_000 and plan.data["min_train_tokens"] >= 1_000_000
    assert (plan.data["min_len"], plan.data["max_len"]) == (512, 1024)
    smoke = load_plan("reference", smoke=True)
    assert (
        smoke.run_name == "reference-smoke" and smoke.target == "tiny-llama"
    )  # never the real run's folders


def test_a_bad_plan_is_refused_before_anything_runs(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "parameters: {target: tiny-llama}\nreference:\n  data: {responses: original}\n  training: {}\n"
        "  rows: [{name: a, paradigm: hidden, regime: tt}]\n"
    )
    with pytest.raises(PlanError, match="row 'a': .*regime"):
        load_plan(str(bad))
    bad.write_text(bad.read_text().replace("regime: tt", "regime: ttt") + "  eval: {rows: [a, b]}\n")
    with pytest.raises(PlanError, match=r"eval.rows names rows \['b'\]"):
        load_plan(str(bad))
    bad.write_text(bad.read_text().replace("rows: [a, b]", "rows: [a]"))
    assert load_plan(str(bad)).eval_rows() == ["a"]
    bad.write_text(bad.read_text().replace("regime: ttt}", "regime: ttt, loops: yes please}"))
    with pytest.raises(PlanError, match="row 'a': loops must be one of"):
        load_plan(str(bad))
    bad.write_text(bad.read_text().replace("loops: yes please", "loops: cut"))
    assert load_plan(str(bad)).row("a").loops == "cut"
    bad.write_text(bad.read_text() + "  baseline: {run: reference, rows: {b: a}}\n")  # b is not a row here
    with pytest.raises(PlanError, match="baseline must be"):
        load_plan(str(bad))


def test_a_row_of_a_later_stage_has_its_own_slice_and_cap_and_the_command_line_still_wins(tmp_path):
    path = tmp_path / "stages.yaml"
    path.write_text(
        "parameters: {target: tiny-llama}\nreference:\n"
        "  data: {responses: regenerated, n_train_conversations: 100, min_train_tokens: 10}\n"
        "  budget: {token_passes: 1000}\n  training: {}\n  rows:\n"
        "    - {name: a, paradigm: hidden, regime: ttt}\n"
        "    - {name: a-s3, like: a, data: {n_train_conversations: 400}, budget: {token_passes: 5000}}\n"
        "    - {name: b-s3, like: a-s3, loops: cut}\n"
    )
    plan = load_plan(str(path))
    a, a3, b3 = plan.row("a"), plan.row("a-s3"), plan.row("b-s3")
    assert (
        plan.row_data_spec(a)["n_train_conversations"] == 100 and plan.row_budget(a)["token_passes"] == 1000
    )
    for row in (a3, b3):  # `like` carries the slice and the cap
        assert plan.row_data_spec(row) == {
            "responses": "regenerated",
            "n_train_conversations": 400,
            "min_train_tokens": 10,
        }
        assert plan.row_budget(row) == {"token_passes": 5000}
    plan.override(
        {"min_train_tokens": 0}, {"token_passes": 7}
    )  # --data / --budget: over the plan and every row
    assert plan.row_budget(a)["token_passes"] == plan.row_budget(a3)["token_passes"] == 7
    assert (
        plan.row_data_spec(a3)["min_train_tokens"] == 0
        and plan.row_data_spec(a3)["n_train_conversations"] == 400
    )
    plan.override({"n_train_conversations": 50})
    assert (
        plan.row_data_spec(a)["n_train_conversations"]
        == plan.row_data_spec(b3)["n_train_conversations"]
        == 50
    )
    with pytest.raises(PlanError, match="--data names"):
        plan.override({"n_conversations": 5})
    smoke = load_plan("onpolicy", smoke=True)  # the smoke slice and cap hold for a later stage's row too
    row = smoke.row("hybrid31-ttt-s3-zeroed")
    assert smoke.row_data_spec(row) == smoke.data and smoke.row_budget(row) == smoke.budget
    full = load_plan("onpolicy")
    assert full.row_budget(full.row(row.name))["token_passes"] > full.budget["token_passes"]
    path.write_text(path.read_text().replace("budget: {token_passes: 5000}", "budget: {steps: 5}"))
    with pytest.raises(PlanError, match="row 'a-s3': its data keys must be the plan's"):
        load_plan(str(path))
    path.write_text(path.read_text().replace("budget: {steps: 5}", "data: {n_conversations: 5}"))
    with pytest.raises(PlanError, match="row 'a-s3': its data keys must be the plan's"):
        load_plan(str(path))


@pytest.mark.slow  # ~16 s: make test-slow, which CI runs
def test_a_smoke_run_trains_every_row_and_writes_table_5(tmp_path):
    plan = load_plan("reference", smoke=True)
    record = run_reference(plan, "cpu", ("train",), root=tmp_path, progress=False, figures=False)
    assert record["trained"] == ROWS
    data = tmp_path / "figures" / "reference-smoke" / "data"
    rows = pd.read_csv(data / "reference_rows.csv").set_index("drafter")
    history = pd.read_csv(data / "training_history.csv")
    target = load_target("tiny-llama", device="cpu")
    trained = json.loads(
        (tmp_path / "runs" / "reference-smoke" / "drafters" / "none-ttt" / "config.json").read_text()
    )
    # the one store every row read, recorded by its folder's name under <cache>/features/
    store = FeatureStore(cache_dir() / "features" / trained["extra"]["train_store"])
    assert (
        store.n_tokens == rows["unique_tokens"].iloc[0] and len(store) == plan.data["n_train_conversations"]
    )
    mean_len = sum(
        min(n, 128) for n in (len(store.sequence(i, ["input_ids"])["input_ids"]) for i in range(len(store)))
    )
    cap_steps = math.ceil(plan.budget["token_passes"] / (2 * mean_len / len(store)))
    for name in ROWS:
        r = rows.loc[name]
        assert r["train_tokens"] == history[history["drafter"] == name]["tokens"].sum()  # token-passes
        assert r["train_steps"] == cap_steps and r["steps_trained"] <= cap_steps  # the cap, in token-passes
        assert r["precision"] in ("bf16", "fp32") and r["cpu"] and r["row_seconds"] > 0
        cfg = json.loads(
            (tmp_path / "runs" / "reference-smoke" / "drafters" / name / "config.json").read_text()
        )
        assert cfg["extra"]["train_store"] == store.path.name  # one store for every row, by name, not path
    # the KV ablation covers every KV reader, three conditions each; the gate statistics the hybrids
    ablation = pd.read_csv(data / "kv_ablation.csv")
    assert set(ablation["drafter"]) == KV_READERS
    assert set(ablation["condition"]) == {"real", "zeroed", "shuffled"}
    assert set(pd.read_csv(data / "gate_stats.csv")["drafter"]) == {"hybrid-ttt", "hybrid-ttt-zeroed"}
    curves = pd.read_csv(data / "learning_curves.csv")
    assert set(curves["drafter"]) == set(ROWS) and {"acc_0", "mat"} <= set(curves["metric"])
    assert set(pd.read_csv(data / "curve_asymptotes.csv")["drafter"]) == set(ROWS)
    gaps = pd.read_csv(data / "gap_by_budget.csv")
    assert {("kv-ttt-tinit", "kv-ttt"), ("kv-ttt", "kv-ttt-zeroed"), ("hybrid-ttt", "hidden-ttt")} <= set(
        zip(gaps["drafter"], gaps["minus"])
    )
    # the committed checkpoints: headline rows in order, within the smoke limits (block-kv is left out)
    ckpt = tmp_path / "checkpoints" / "reference-smoke"
    limits = plan.checkpoints
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(
        ["none-ttt", "hidden-ttt", "kv-ttt", "hybrid-ttt", "kv-ttt-tinit"]
    )
    assert all(f.stat().st_size <= limits["max_file_mb"] * MB for f in ckpt.rglob("*.safetensors"))
    assert sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) <= limits["max_total_mb"] * MB
    assert "over" in rows.loc["block-kv", "checkpoint_skipped"]
    assert rows.loc["hybrid-ttt", "checkpoint"] == "checkpoints/reference-smoke/hybrid-ttt"
    from kvshot_lib.drafters import load_drafter

    assert load_drafter(ckpt / "hybrid-ttt", target).cfg.paradigm == "hybrid"
    done = status(plan, tmp_path)
    assert list(done["state"]) == ["done"] * len(ROWS)

    # the evaluation: MT-bench on every trained row and the n-gram baseline, then Table 5 and the figures
    with_standard = dataclasses.replace(plan, comparisons=[*plan.comparisons, ("hybrid-ttt", "hidden-ttt")])
    record = run_reference(with_standard, "cpu", ("eval",), root=tmp_path, progress=False)
    assert {(d["drafter"], d["mode"], d["temperature"]) for d in record["evaluated"]} >= {
        ("hybrid-ttt", "tree", 0.0), ("ngram", "chain", 0.0), ("block-kv", "chain", 1.0)
    }  # fmt: skip
    table = pd.read_csv(data / "reference_table.csv").set_index("drafter")
    per_step = pd.read_csv(data / "per_step_accuracy.csv")
    for name in ROWS:
        acc = per_step[per_step["drafter"] == name].sort_values("draft_step")["accuracy"]
        if acc.notna().all():
            assert table.loc[name, "heldout_mat"] == pytest.approx(1 + acc.cumprod().sum())
        assert table.loc[name, "mat_lo"] <= table.loc[name, "mat"] <= table.loc[name, "mat_hi"]
        assert table.loc[name, "token_passes"] == rows.loc[name, "train_tokens"]
        assert table.loc[name, "unique_tokens"] == store.n_tokens
        stopped = table.loc[name, "stop_reason"]  # the plateau rule (and then the row plateaued), or the cap
        if stopped.startswith("plateau"):
            assert table.loc[name, "stable_phase_flat"]
        else:
            assert (
                stopped == "the token-pass cap" and table.loc[name, "steps"] == rows.loc[name, "train_steps"]
            )
    # each drafter against the n-gram drafter, and the plan's pairs, on the same turns: the paired difference is
    # the summaries' difference
    vs = pd.read_csv(data / "mat_differences.csv")
    summary = pd.read_csv(data / "acceptance_summary.csv").set_index(["drafter", "mode", "temperature"])
    assert set(vs.query("minus == 'ngram'")["drafter"]) == set(ROWS)
    assert {("kv-ttt", "kv-ttt-zeroed"), ("kv-ttt", "hidden-ttt")} <= set(zip(vs["drafter"], vs["minus"]))
    # the standard pair asked for again is listed once
    assert not vs.duplicated(["drafter", "minus", "mode", "temperature"]).any()
    for r in vs.itertuples():
        by_hand = (
            summary.loc[(r.drafter, r.mode, r.temperature), "mat"]
            - summary.loc[(r.minus, r.mode, r.temperature), "mat"]
        )
        assert r.mat_diff == pytest.approx(by_hand) and r.lo <= r.mat_diff <= r.hi
    assert table.loc["hidden-ttt", "paper_mat"] == 2.37 and table.loc["none-ttt", "paper_alpha_0"] == 0.237
    assert math.isnan(table.loc["block-kv", "paper_mat"])  # the paper has no block row
    figures = tmp_path / "figures" / "reference-smoke"
    for fig in ("02_per_step_accuracy", "02_learning_curves", "02_kv_ablation", "03_acceptance_by_step"):
        assert (figures / f"{fig}.png").is_file(), fig
    redrawn = redraw(figures, tmp_path / "redrawn", ["02_learning_curves"])  # kvshot figures, no model
    assert (tmp_path / "redrawn" / f"{redrawn[0]}.png").read_bytes() == (
        figures / f"{redrawn[0]}.png"
    ).read_bytes()
    note = budget_note(tmp_path / "runs" / "reference-smoke" / "results")  # notebook 04's caption on this run
    precision = rows["precision"].iloc[0]  # bf16 where the CPU has it, else fp32
    assert (
        "token-passes per drafter over" in note and "unique tokens (published" in note and precision in note
    )
    captions = (figures / "data" / "captions.json").read_text()
    assert "unique training tokens" in captions and "token-passes" in captions and precision in captions

    # a second run reads every finished row back: nothing trains again, nothing is duplicated
    run_reference(plan, "cpu", ("train",), ["hidden-ttt"], root=tmp_path, progress=False, figures=False)
    again = pd.read_csv(data / "reference_rows.csv").set_index("drafter")
    assert again.loc["hidden-ttt", "seconds"] == rows.loc["hidden-ttt", "seconds"]
    # a read-back row keeps its training time, not the time it took to read it
    assert again.loc["hidden-ttt", "row_seconds"] == rows.loc["hidden-ttt", "seconds"]
    assert len(pd.read_csv(data / "training_history.csv").query("drafter == 'hidden-ttt'")) == len(
        history.query("drafter == 'hidden-ttt'")
    )
    # asked for with another budget, a finished row is refused, not trained over from scratch
    before = (
        tmp_path / "runs" / "reference-smoke" / "drafters" / "hidden-ttt" / "model.safetensors"
    ).read_bytes()
    doubled = dataclasses.replace(plan, budget={"token_passes": 2 * plan.budget["token_passes"]})
    with pytest.raises(PlanError, match=r"row 'hidden-ttt' is trained already .*train_steps .*--budget"):
        run_reference(
            doubled, "cpu", ("train",), ["hidden-ttt"], root=tmp_path, progress=False, figures=False
        )
    assert (
        tmp_path / "runs" / "reference-smoke" / "drafters" / "hidden-ttt" / "model.safetensors"
    ).read_bytes() == before
    with pytest.raises(PlanError, match="steps"):
        run_reference(plan, "cpu", ("fly",), root=tmp_path)


def test_significant_rounds_float_columns_once():
    df = pd.DataFrame(dict(step=[1, 2], loss=[150.11708068847656, 1e-05], acc=[0.0030864197530864196, 0.0]))
    got = tables.significant(df, 5)
    assert got["loss"].tolist() == [150.12, 1e-05] and got["acc"].tolist() == [0.0030864, 0.0]
    assert got["step"].tolist() == [1, 2] and got["step"].dtype == df["step"].dtype  # integers untouched
    pd.testing.assert_frame_equal(tables.significant(got, 5), got)  # rounding again changes nothing


def test_step_blocks_average_each_drafters_blocks_once():
    """Steps 1..3 of ``a`` with blocks of 2: (1, 2) and (3); ``b`` is already blocked and passes through."""
    raw = pd.DataFrame(
        dict(
            step=[3, 1, 2],
            loss=[5.0, 1.0, 2.0],
            lr=[0.3, 0.1, 0.2],
            seconds=[9.0, 4.0, 6.0],
            epoch=[0.3, 0.1, 0.2],
            tokens=[30, 10, 20],
            drafter="a",
            paradigm="hidden",
        )
    )
    done = pd.DataFrame(
        dict(
            step=[2],
            loss=[7.0],
            lr=[0.1],
            seconds=[1.0],
            epoch=[0.5],
            tokens=[8],
            drafter="b",
            paradigm="kv",
            steps=[2],
        )
    )
    got = tables.step_blocks(pd.concat([done, raw], ignore_index=True), 2)
    a = got[got["drafter"] == "a"].set_index("step")
    assert a.index.tolist() == [2, 3] and a["steps"].tolist() == [2, 1]
    assert a.loc[2, ["loss", "lr", "seconds", "epoch", "tokens"]].tolist() == [1.5, 0.2, 6.0, 0.2, 30]
    assert a.loc[3, ["loss", "tokens"]].tolist() == [5.0, 30] and (a["paradigm"] == "hidden").all()
    assert got[got["drafter"] == "b"].to_dict("records") == done.to_dict("records")
    pd.testing.assert_frame_equal(tables.step_blocks(got, 2), got)  # blocking again changes nothing


def test_the_onpolicy_rows_are_measured_beside_the_reference_runs_checkpoints(tiny_llama, tmp_path):
    """The on-policy eval loads checkpoints/reference/<row> as <row>@reference and pairs each row with it."""
    from conftest import trained_like

    from kvshot_lib.drafters import save_drafter
    from kvshot_lib.reference import run as reference_run

    plan = load_plan("onpolicy", smoke=True)
    pairs = plan.baseline_pairs()
    assert ("hidden31-ttt", "hidden-ttt@reference-smoke") in pairs and (
        "kv-ttt",
        "kv-ttt@reference-smoke",
    ) in pairs
    assert {row for row, _ in pairs} <= set(plan.rows)
    save_drafter(
        trained_like(tiny_llama, "hidden"), tmp_path / "runs" / "onpolicy-smoke" / "drafters" / "hidden-ttt"
    )
    save_drafter(
        trained_like(tiny_llama, "hidden"), tmp_path / "checkpoints" / "reference-smoke" / "hidden-ttt"
    )
    drafters, missing = reference_run.evaluated_drafters(plan, tiny_llama, None, tmp_path)
    assert set(drafters) == {"hidden-ttt", "hidden-ttt@reference-smoke", "ngram"}  # kv-ttt@... is not there
    assert "kv-ttt" in missing and "hidden-ttt" not in missing
    with pytest.raises(PlanError, match="no checkpoint of row 'none-ttt'"):
        reference_run.evaluated_drafters(plan, tiny_llama, ["none-ttt"], tmp_path)
    save_drafter(trained_like(tiny_llama, "kv"), tmp_path / "runs" / "onpolicy-smoke" / "drafters" / "kv-ttt")
    asked, _ = reference_run.evaluated_drafters(plan, tiny_llama, ["kv-ttt"], tmp_path)
    assert set(asked) == {"kv-ttt", "ngram"}  # hidden-ttt@reference-smoke pairs with rows not asked for
    asked, _ = reference_run.evaluated_drafters(plan, tiny_llama, ["hidden-ttt"], tmp_path)
    assert set(asked) == {"hidden-ttt", "hidden-ttt@reference-smoke", "ngram"}


def test_both_held_out_sets_measure_the_onpolicy_rows_and_the_reference_checkpoints(tiny_llama, tmp_path):
    """The heldout step: each checkpoint (the on-policy run's and the reference run's) on the on-policy run's
    held-out set (the target's own answers) and the reference run's (ShareGPT's), each labelled with what it
    trained on; one drafter under two labels measures the same on each set; the figure redraws from its table."""
    from conftest import trained_like

    from kvshot_lib.drafters import save_drafter
    from kvshot_lib.reference import heldout, heldout_sets
    from kvshot_lib.reference import run as reference_run

    plan = load_plan("onpolicy", smoke=True)
    original = load_plan("onpolicy", smoke=True)
    for row in original.rows.values():  # both runs would then hold out ShareGPT's answers: refused
        row.responses = "original"
    with pytest.raises(PlanError, match="both hold original answers"):
        heldout_sets(original, tiny_llama)
    reference_run.regenerate_split(plan, tiny_llama, "eval", progress=False)
    reference_run.regenerate_split(plan, tiny_llama, "train", progress=False)
    d = trained_like(tiny_llama, "hidden")
    save_drafter(d, tmp_path / "runs" / "onpolicy-smoke" / "drafters" / "hidden-ttt")
    save_drafter(d, tmp_path / "checkpoints" / "reference-smoke" / "hidden-ttt")
    run_reference(plan, "cpu", ("heldout",), ["hidden-ttt"], root=tmp_path, progress=False)
    figures = tmp_path / "figures" / "onpolicy-smoke"
    got = pd.read_csv(figures / "data" / "heldout_cross.csv")
    steps = plan.row("hidden-ttt").train_config().eval_steps
    assert len(got) == 2 * 3 * steps
    free = heldout.LOOP_FREE
    assert set(zip(got["drafter"], got["heldout"], got["trained_on"])) == {
        ("hidden-ttt", "original", "regenerated"),
        ("hidden-ttt", "regenerated", "regenerated"),
        ("hidden-ttt", free, "regenerated"),
        ("hidden-ttt@reference-smoke", "original", "original"),
        ("hidden-ttt@reference-smoke", "regenerated", "original"),
        ("hidden-ttt@reference-smoke", free, "original"),
    }
    # the smoke run's 8-token answers cannot loop (a loop needs 96 tokens): its loop-free view is the same set
    same = got[got["heldout"] == "regenerated"].set_index(["drafter", "draft_step"]).sort_index()
    cut = got[got["heldout"] == free].set_index(["drafter", "draft_step"]).sort_index()
    pd.testing.assert_series_equal(same["accuracy"], cut["accuracy"])
    key = ["heldout", "draft_step"]
    own = got[got["drafter"] == "hidden-ttt"].set_index(key).sort_index()
    other = got[got["drafter"] == "hidden-ttt@reference-smoke"].set_index(key).sort_index()
    pd.testing.assert_series_equal(own["accuracy"], other["accuracy"])  # the same weights, the same sets
    assert own.loc[("original", 0), "n"] != own.loc[("regenerated", 0), "n"]  # two different held-out sets
    step0 = got[got["draft_step"] == 0]
    assert (step0["accuracy"] <= step0["ceiling"]).all()  # a token outside the draft vocabulary is a miss
    redraw(figures, tmp_path / "redrawn", ["02_heldout_cross"])
    assert (tmp_path / "redrawn" / "02_heldout_cross.png").read_bytes() == (
        figures / "02_heldout_cross.png"
    ).read_bytes()


def test_a_row_that_drops_looping_answers_trains_on_the_other_conversations(tiny_llama, monkeypatch):
    from kvshot_lib.reference import data as reference_data

    plan = load_plan("onpolicy", smoke=True)
    full = reference_data.row_data(plan, tiny_llama, plan.row("hidden31-ttt"), progress=False)
    monkeypatch.setattr(
        reference_data, "looping_conversations", lambda split, stops: [i % 3 == 0 for i in range(len(split))]
    )
    part = reference_data.row_data(plan, tiny_llama, plan.row("hidden31-ttt-noloop"), progress=False)
    keep = [i for i in range(len(full.train)) if i % 3]
    ids = lambda store, i: store.sequence(i, ["input_ids"])["input_ids"]  # noqa: E731
    assert len(part.train) == len(keep) and all(
        torch.equal(ids(part.train, j), ids(full.train, i)) for j, i in enumerate(keep)
    )
    assert part.unique_tokens == sum(len(ids(full.train, i)) for i in keep) < full.unique_tokens
    assert part.what.endswith(f"without the {len(full.train) - len(keep)} conversations whose answers loop")
    assert len(part.held) == len(full.held)  # one held-out set measures every row


def cut_three_of_every_other(split, stops):
    """A stand-in for ``cut_looping`` (the smoke run's 8-token answers cannot loop): the last three tokens of every
    other conversation, from the first, go."""
    from kvshot_lib.corpus import TokenizedSplit

    out = [x[:-3] if i % 2 == 0 else x for i, x in enumerate(split.ids)]
    masks = [m[: len(x)] for m, x in zip(split.loss_mask, out)]
    n_cut = (len(out) + 1) // 2
    counts = dict(split.counts, looping_answers_cut=n_cut, looping_tokens_cut=3 * n_cut)
    return TokenizedSplit(out, masks, list(split.source_ids), dict(split.spec, loops="cut"), counts)


def test_a_row_that_cuts_loops_trains_on_every_conversation_with_its_loops_cut(tiny_llama, monkeypatch):
    from kvshot_lib.reference import data as reference_data

    plan = load_plan("onpolicy", smoke=True)
    full = reference_data.row_data(plan, tiny_llama, plan.row("hidden31-ttt"), progress=False)
    ids = lambda store, i: store.sequence(i, ["input_ids"])["input_ids"]  # noqa: E731

    monkeypatch.setattr(reference_data, "cut_looping", cut_three_of_every_other)
    cut = reference_data.row_data(plan, tiny_llama, plan.row("hidden31-ttt-cut"), progress=False)
    assert len(cut.train) == len(full.train)  # every conversation kept
    for i in range(len(full.train)):
        want = ids(full.train, i)[:-3] if i % 2 == 0 else ids(full.train, i)
        assert torch.equal(ids(cut.train, i), want)
    assert cut.unique_tokens == full.unique_tokens - 3 * ((len(full.train) + 1) // 2)
    assert "looping answers cut after its first repetition" in cut.what
    assert ("hidden31-ttt-cut", "hidden31-ttt-noloop") in plan.comparisons
    # the plan's floor is on the slice before any row's filter: the cut row trains on fewer tokens than it
    plan.data["min_train_tokens"] = full.unique_tokens
    assert reference_data.row_data(
        plan, tiny_llama, plan.row("hidden31-ttt-cut"), progress=False
    ).unique_tokens < (full.unique_tokens)
    plan.data["min_train_tokens"] = full.unique_tokens + 1
    with pytest.raises(PlanError, match="fewer than the plan's min_train_tokens"):
        reference_data.row_data(plan, tiny_llama, plan.row("hidden31-ttt-cut"), progress=False)


def test_the_regenerate_step_tables_each_slices_tokens_after_its_loops_are_cut_or_dropped(
    tiny_llama, tmp_path, monkeypatch
):
    """corpus_tokens.csv: one line per slice the rows read (a later stage's larger slice too), its tokens as
    regenerated, and after each loop is cut or each looping conversation dropped, worked out from the lengths."""
    from kvshot_lib.corpus import regenerate
    from kvshot_lib.reference import data as reference_data

    plan = load_plan("onpolicy", smoke=True)
    for name in ("hidden31-ttt-s3", "hybrid31-ttt-s3", "hybrid31-ttt-s3-zeroed"):
        plan.row(name).data["n_train_conversations"] = (
            8  # smoke's stage 3 reads a smaller slice than the rest
        )

    monkeypatch.setattr(regenerate, "cut_looping", cut_three_of_every_other)  # what training_tokens cuts
    monkeypatch.setattr(
        reference_data, "looping_conversations", lambda split, stops: [i % 3 == 0 for i in range(len(split))]
    )
    run_reference(plan, "cpu", ("regenerate",), root=tmp_path, progress=False)
    got = pd.read_csv(tmp_path / "figures" / "onpolicy-smoke" / "data" / "corpus_tokens.csv")
    assert list(got["conversations"]) == [8, 12]
    lengths = [len(x) for x in reference_data.data_splits(plan, tiny_llama, "regenerated")[0].ids]
    assert len(lengths) == 12
    for _, line in got.iterrows():
        n = line["conversations"]
        first = lengths[:n]
        assert line["regenerated"] == n and line["tokens"] == sum(first)
        assert line["tokens_loops_cut"] == sum(first) - 3 * ((n + 1) // 2)
        assert line["tokens_loops_dropped"] == sum(x for i, x in enumerate(first) if i % 3)
        assert line["looping_conversations"] == (n + 2) // 3
    assert (
        got.set_index("conversations").loc[8, "rows"]
        == "hidden31-ttt-s3 hybrid31-ttt-s3 hybrid31-ttt-s3-zeroed"
    )
    assert "hidden31-ttt-cut" in got.set_index("conversations").loc[12, "rows"].split()


def test_two_rows_finishing_at_once_both_keep_their_tables(tmp_path, monkeypatch):
    """Two processes (here threads) merging into the run's tables at the same moment: neither drops the other's row."""
    import threading
    import time

    plan = load_plan("reference", smoke=True)
    read = tables._read

    def slow_read(folder, name):  # widens the read-merge-write window that two finishing rows share
        time.sleep(0.2)
        return read(folder, name)

    monkeypatch.setattr(tables, "_read", slow_read)
    jobs = [pd.DataFrame([dict(job=f"train@{r}", started="2026-11-27 15:20", rows=r)]) for r in ("a", "b")]
    threads = [
        threading.Thread(
            target=tables.update_run, args=(plan, {"reference_jobs.csv": j}, tmp_path), kwargs={"draw": False}
        )
        for j in jobs
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    merged = pd.read_csv(tmp_path / "figures" / plan.run_name / "data" / "reference_jobs.csv")
    assert sorted(merged["rows"]) == ["a", "b"]


def test_a_carried_row_goes_on_in_a_session_without_runs_and_commits_its_checkpoint(tmp_path, monkeypatch):
    """A row with ``carry: true`` keeps its position in ``checkpoints/<run>/<row>.partial/`` while it trains;
    with ``runs/`` gone (a new session), the run goes on from there, and the finished checkpoint takes its place."""
    import shutil

    from kvshot_lib.training import StoreBatches

    plan = load_plan("reference", smoke=True)
    plan = dataclasses.replace(
        plan, rows={**plan.rows, "none-ttt": dataclasses.replace(plan.rows["none-ttt"], carry=True)}
    )
    partial = tmp_path / "checkpoints" / "reference-smoke" / "none-ttt.partial"
    real, seen = StoreBatches.batch, []

    def dies_at_4(self, step):
        if step == 4:
            raise KeyboardInterrupt
        return real(self, step)

    monkeypatch.setattr(StoreBatches, "batch", dies_at_4)
    with pytest.raises(KeyboardInterrupt):
        run_reference(plan, "cpu", ("train",), ["none-ttt"], root=tmp_path, progress=False, figures=False)
    assert json.loads((partial / "trainer.json").read_text())["step"] == 4  # save_every 2
    shutil.rmtree(tmp_path / "runs")  # the next session's machine
    assert status(plan, tmp_path).set_index("row").loc["none-ttt", "state"] == "carried"

    def counted(self, step):
        seen.append(step)
        return real(self, step)

    monkeypatch.setattr(StoreBatches, "batch", counted)
    run_reference(plan, "cpu", ("train",), ["none-ttt"], root=tmp_path, progress=False, figures=False)
    assert seen and seen[0] == 4  # went on from the carried step
    assert not partial.exists() and (partial.with_name("none-ttt") / "config.json").is_file()
    out = tmp_path / "runs" / "reference-smoke" / "drafters" / "none-ttt"
    history = pd.read_csv(out / "history.csv")
    assert list(history["step"]) == list(range(1, len(history) + 1)) and len(history) > 4  # the whole history
    assert list(pd.read_csv(out / "restarts.csv")["step"]) == [4]


def test_a_carried_row_needs_its_starting_checkpoint_only_until_it_carries(tmp_path):
    """``init_from``: a fresh start needs the starting checkpoint; a carried row that holds a position, or its
    finished weights in ``runs/``, goes on (or is read back) without it (its committed path kept, for the config
    that resumes), so that checkpoint can be retired."""
    plan = load_plan("onpolicy")
    row = plan.row("hybrid31-ttt-s4")
    assert row.carry and row.init_row == "hybrid31-ttt-s3"
    with pytest.raises(PlanError, match="'hybrid31-ttt-s4' starts from row 'hybrid31-ttt-s3': no checkpoint"):
        init_path(plan, row, tmp_path)
    partial = tmp_path / "checkpoints" / "onpolicy" / "hybrid31-ttt-s4.partial"
    partial.mkdir(parents=True)
    with pytest.raises(PlanError):  # a folder without a position is no carried state
        init_path(plan, row, tmp_path)
    (partial / "trainer.json").write_text(json.dumps({"step": 8300}))
    committed = str(tmp_path / "checkpoints" / "onpolicy" / "hybrid31-ttt-s3")
    assert init_path(plan, row, tmp_path) == committed
    # finished: its checkpoint took the position's place, and runs/ holds it (read back)
    shutil.rmtree(partial)
    own = tmp_path / "runs" / "onpolicy" / "drafters" / "hybrid31-ttt-s4"
    own.mkdir(parents=True)
    with pytest.raises(PlanError):  # an empty folder holds no weights
        init_path(plan, row, tmp_path)
    (own / "state").mkdir()
    (own / "state" / "trainer.json").write_text(json.dumps({"step": 14300}))  # a saved state, resumed from
    assert init_path(plan, row, tmp_path) == committed
    shutil.rmtree(own / "state")
    (own / "config.json").write_text("{}")  # the finished checkpoint, read back
    assert init_path(plan, row, tmp_path) == committed
    trained = (
        tmp_path / "runs" / "onpolicy" / "drafters" / "hybrid31-ttt-s3"
    )  # where a trained row is found first
    trained.mkdir(parents=True)
    (trained / "config.json").write_text("{}")
    assert init_path(plan, row, tmp_path) == str(trained)
    with pytest.raises(PlanError):  # an uncarried row still needs it
        init_path(plan, plan.row("hidden31-ttt-noloop-ft"), tmp_path)
