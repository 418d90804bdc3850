"""Notebook hygiene; every notebook runs end to end under papermill with the smoke profile, saves result
tables whose columns, value ranges and row counts follow from the profile's parameters (and whose numbers
agree with each other where one table restates another), and ``kvshot figures`` redraws every figure from
the tables kept beside it, byte for byte."""

import ast
import json
import math
import os

import numpy as np
import pandas as pd
import pytest

from kvshot_lib import cli, plots, runner
from kvshot_lib.evaluation import HF_METHODS
from kvshot_lib.target import REPO_ROOT, cpu_model, resolve_precision
from kvshot_lib.training import parse_drafter_specs

NOTEBOOKS = runner.list_notebooks()
pytestmark = pytest.mark.timeout(1800)  # the smoke run of every notebook, on a busy 2-core machine
REQUIRED = {"profile", "run_dir", "figure_dir", "target", "device", "dtype", "seed"}


def test_there_are_notebooks():
    assert "00" in NOTEBOOKS


@pytest.mark.parametrize("number", sorted(NOTEBOOKS))
def test_notebook_is_stripped_parameterized_and_short(number):
    path = NOTEBOOKS[number]
    nb = json.loads(path.read_text())
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    assert nb["cells"][0]["cell_type"] == "markdown", "first cell states the question"
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [] and cell.get("execution_count") is None, (
                f"{path.name}: strip outputs"
            )
            for node in ast.walk(ast.parse("".join(cell["source"]))):
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    assert node.end_lineno - node.lineno < 6, (
                        f"{path.name}: {node.name} belongs in kvshot_lib"
                    )
    params = runner.notebook_parameters(path)  # exactly one tagged cell, literals only
    assert REQUIRED <= set(params), f"{path.name} must declare {sorted(REQUIRED - set(params))}"


@pytest.fixture(scope="module")
def smoke_run():
    """The smoke profile, run once. ``KVSHOT_SMOKE_ONLY=01,07`` runs only those notebooks, on top of the other
    notebooks' outputs already under ``runs/smoke`` (``tests/mutation_issue21.py`` does, to check the tables
    of one notebook under a mutant)."""
    only = os.environ.get("KVSHOT_SMOKE_ONLY")
    return runner.run_profile("smoke", only=only.split(",") if only else None)


def test_smoke_profile_runs_every_notebook(smoke_run):
    assert [r["notebook"] for r in smoke_run] == [p.name for p in NOTEBOOKS.values()]
    figures = {p.name for p in (REPO_ROOT / "figures" / "smoke").glob("*.png")}
    for number in NOTEBOOKS:
        assert any(f.startswith(number) for f in figures), f"notebook {number} saved no figure"
    assert (REPO_ROOT / "runs" / "smoke" / "results" / "run_log.json").is_file()


def test_kvshot_figures_redraws_every_figure_byte_for_byte(smoke_run, tmp_path):
    figure_dir = REPO_ROOT / "figures" / "smoke"
    drawn = sorted(p.stem for p in figure_dir.glob("*.png"))
    by_notebooks = sorted(name for name, spec in plots.FIGURES.items() if not spec.command)
    assert drawn == by_notebooks, "every figure a notebook draws is drawn by the smoke run, and no other"
    assert cli.main(["figures", "--profile", "smoke", "--out", str(tmp_path)]) == 0
    for name in drawn:
        for ext in (".png", ".pdf"):
            original, redrawn = figure_dir / f"{name}{ext}", tmp_path / f"{name}{ext}"
            assert redrawn.read_bytes() == original.read_bytes(), f"{name}{ext} differs when redrawn"


def test_kvshot_figures_names_the_missing_table(smoke_run, tmp_path, capsys):
    figure_dir = tmp_path / "figures"
    (figure_dir / "data").mkdir(parents=True)
    (figure_dir / "02_per_step_accuracy.png").write_bytes(b"")  # the figure is there, its table is not
    with pytest.raises(
        plots.FigureDataError, match="02_per_step_accuracy.*per_step_accuracy.csv.*02_train_drafters"
    ):
        plots.redraw(figure_dir)
    (figure_dir / "data" / "per_step_accuracy.csv").write_text("drafter,accuracy\nx,0.5\n")
    with pytest.raises(plots.FigureDataError, match="lacks the columns"):
        plots.redraw(figure_dir)


RESULTS = REPO_ROOT / "runs" / "smoke" / "results"


def smoke_params(number: str) -> dict:
    """The parameters notebook ``number`` ran with under the smoke profile (its defaults, then the profile)."""
    plan = {path.name[:2]: params for path, params in runner.plan_run(runner.load_profile("smoke"))}
    return {**runner.notebook_parameters(NOTEBOOKS[number]), **plan[number]}


def table(name: str, columns) -> pd.DataFrame:
    df = pd.read_csv(RESULTS / f"{name}.csv")
    assert set(columns) <= set(df.columns), f"{name}.csv lacks {sorted(set(columns) - set(df.columns))}"
    return df


def within(series, lo, hi, tol=1e-6) -> bool:
    """Every value in [lo, hi] up to float rounding (NaN is not)."""
    return bool(((series >= lo - tol) & (series <= hi + tol)).all())


def trained_configs():
    p = smoke_params("02")
    return parse_drafter_specs(p["drafters"], dict(train_steps=p["train_steps"], ttt_steps=p["ttt_steps"]))


def all_accepted_cycles(max_new_tokens: int, depth: int) -> list[int]:
    """Accepted drafts per cycle when every draft is accepted: the prefill gives one token, then each cycle
    drafts min(depth, tokens still to make - 1) and commits them plus the bonus."""
    made, cycles = 1, []
    while max_new_tokens - made - 1 > 0:
        cycles.append(min(depth, max_new_tokens - made - 1))
        made += cycles[-1] + 1
    return cycles


def test_saved_tables_of_notebook_00(smoke_run):
    p = smoke_params("00")
    info = json.loads((RESULTS / "target_info.json").read_text())
    assert info["name"] == p["target"] and info["vocab_size"] > 0 and info["n_layers"] > 0
    conv = table("sharegpt_conversations", ["id", "tokens", "assistant_tokens", "responses"])
    assert 0 < len(conv) <= p["n_stats_conversations"] and conv["id"].is_unique
    assert (conv["assistant_tokens"] > 0).all() and (conv["assistant_tokens"] <= conv["tokens"]).all()
    assert len(table("sharegpt_responses", ["tokens"])) == conv["responses"].sum()  # one row per response
    prompts = table("mtbench_prompts", ["question_id", "category", "turn1_prompt_tokens"])
    assert (
        prompts["question_id"].tolist() == list(range(81, 161)) and (prompts["turn1_prompt_tokens"] > 0).all()
    )
    stores = table("feature_extraction", ["split", "sequences", "tokens"]).set_index("split")
    for split, n in (("train", p["n_train_conversations"]), ("eval", p["n_eval_conversations"])):
        assert 0 < stores.loc[split, "sequences"] <= n and stores.loc[split, "tokens"] <= n * p["max_len"]


def test_saved_tables_of_notebook_02(smoke_run):
    p, configs = smoke_params("02"), trained_configs()
    names = [c.name for c in configs]
    acc = table("per_step_accuracy", ["drafter", "draft_step", "accuracy", "n", "ceiling"])
    assert sorted(zip(acc["drafter"], acc["draft_step"])) == sorted(
        (c.name, k) for c in configs for k in range(c.eval_steps)
    ), "one row per drafter x draft step"
    # a block drafter drafts at most its block: past it a step has no positions and no accuracy
    measured = acc["n"] > 0
    assert within(acc.loc[measured, "accuracy"], 0, 1) and within(acc["ceiling"], 0, 1)
    assert acc.loc[~measured, "accuracy"].isna().all() and measured[acc["draft_step"] == 0].all()
    step0 = acc[acc["draft_step"] == 0]
    assert (
        step0["accuracy"] <= step0["ceiling"] + 1e-12
    ).all()  # a hit needs the target's token in the vocab
    precision = {"no": "fp32"}.get(resolve_precision("auto", "cpu"), "bf16")  # what `auto` runs as here
    for name in ("per_step_accuracy", "training_times", "training_history", "learning_curves"):
        recorded = table(name, ["precision", "cpu", "bf16_isa"])
        assert set(recorded["precision"]) == {precision} and set(recorded["cpu"]) == {cpu_model()}, name
    times = table("training_times", ["drafter", "train_steps", "train_tokens"])
    assert times["drafter"].tolist() == names and (times["train_steps"] == p["train_steps"]).all()
    history = table("training_history", ["drafter", "step", "loss", "acc_0"])
    for c in configs:
        h = history[history["drafter"] == c.name]
        assert h["step"].tolist() == list(range(1, p["train_steps"] + 1))
        assert (h["loss"] > 0).all() and np.isfinite(h["loss"]).all() and within(h["acc_0"], 0, 1)
    evals = table("heldout_eval", ["drafter", "step", "acc_0", "ceiling"])
    want = sorted({1, p["train_steps"]} | set(range(p["eval_every"], p["train_steps"] + 1, p["eval_every"])))
    for c in configs:
        e = evals[evals["drafter"] == c.name]
        assert e["step"].tolist() == want and within(
            e[[f"acc_{k}" for k in range(c.eval_steps)]].stack().dropna(),
            0,
            1,  # NaN past a block
        )
    probes = table("grad_probes", ["drafter", "step", "group", "l2", "frac_small", "n_positions"])
    probe_steps = sorted(
        {s for s in range(p["train_steps"]) if s % p["probe_every"] == 0} | {p["train_steps"] - 1}
    )
    for c in configs:
        assert sorted(set(probes[probes["drafter"] == c.name]["step"])) == probe_steps, c.name
    assert within(probes["frac_small"], 0, 1) and (probes["n_positions"] <= probes["n_positions_total"]).all()
    kv = table("kv_positions", ["drafter", "own_step", "frac_zero_grad"])
    for c in configs:
        steps = sorted(set(kv[kv["drafter"] == c.name]["own_step"]))
        if c.paradigm == "block":  # one forward drafts the block: its own K/V are not per unrolled step
            assert steps, c.name
        else:
            assert steps == list(range(c.n_train_steps)), c.name
    assert within(kv["frac_zero_grad"], 0, 1)
    mass = table("attention_mass", ["drafter", "paradigm", "step", "layer", "segment", "share"])
    assert within(mass["share"], 0, 1 + 1e-6)
    by_name = {c.name: c for c in configs}
    for (name, *_), shares in mass.groupby(["drafter", "step", "layer"])["share"]:
        # one softmax per layer; two for the hybrid (self- and cross-attention) and for a KV-only drafter
        # whose target KV has a softmax of its own
        c = by_name[name]
        two = c.paradigm == "hybrid" or (c.paradigm == "kv" and c.kv_softmax == "separate")
        assert shares.sum() == pytest.approx(2.0 if two else 1.0, abs=1e-5), name
    ablation = table("kv_ablation", ["drafter", "trained_with", "condition", "draft_step", "accuracy", "n"])
    readers = [c for c in configs if c.paradigm in ("kv", "hybrid", "cross") or c.context in ("kv", "both")]
    assert sorted(zip(ablation["drafter"], ablation["condition"], ablation["draft_step"])) == sorted(
        (c.name, cond, k)
        for c in readers
        for cond in ("real", "zeroed", "shuffled")
        for k in range(p["ttt_steps"])
    ), "one row per KV-reading drafter x condition x draft step"
    assert within(ablation["accuracy"], 0, 1)
    for c in readers:
        rows = ablation[ablation["drafter"] == c.name]
        assert set(rows["trained_with"]) == {c.target_kv}
        if c.target_kv == "zeroed":  # the control never sees the K/V: the three conditions are the same run
            by = rows.pivot(index="draft_step", columns="condition", values="accuracy")
            assert (by["real"] == by["zeroed"]).all() and (by["real"] == by["shuffled"]).all()


def test_saved_tables_of_notebook_03(smoke_run):
    p = smoke_params("03")
    drafters = [c.name for c in trained_configs()] + p["baseline_drafters"]
    by_step = table(
        "acceptance_by_step",
        ["drafter", "mode", "temperature", "step", "alpha_conditional", "p_reach", "n_attempts"],
    )
    summary = table(
        "acceptance_summary", ["drafter", "mode", "temperature", "mat", "alpha_0", "n_generations"]
    )
    every_run = {(d, m, float(t)) for d in drafters for m in p["modes"] for t in p["temperatures"]}
    keys = list(zip(summary["drafter"], summary["mode"], summary["temperature"]))
    assert sorted(keys) == sorted(every_run), "one summary row per drafter x mode x temperature"
    runs = by_step.groupby(["drafter", "mode", "temperature"], sort=False)
    assert set(runs.groups) <= every_run  # a run that never drafted has no step rows
    for key, r in runs:
        assert r["step"].tolist() == list(range(len(r))) and len(r) <= max(p["chain_depth"], p["tree_depth"])
        att, acc = r["n_attempts"].to_numpy(), r["n_accepts"].to_numpy()
        assert (acc >= 0).all() and (acc <= att).all(), key
        assert (att[1:] <= acc[:-1]).all(), f"{key}: step k+1 is tried only after step k was accepted"
        alpha = np.where(att > 0, acc / np.maximum(att, 1), np.nan)
        np.testing.assert_allclose(r["alpha_conditional"], alpha, equal_nan=True)
        np.testing.assert_allclose(r["p_reach"], np.cumprod(alpha), equal_nan=True)
    for key, row in zip(keys, summary.itertuples()):
        n_questions = p["n_questions"] if row.temperature == 0 else p["n_questions_sampled"]
        assert row.n_generations == 2 * n_questions and 1 <= row.mat <= 1 + max(
            p["chain_depth"], p["tree_depth"]
        )
        first = runs.get_group(key)["alpha_conditional"].iloc[0] if key in runs.groups else math.nan
        assert row.alpha_0 == pytest.approx(first, nan_ok=True), key
    boot = table("acceptance_bootstrap", ["drafter", "mode", "temperature", "metric", "value", "lo", "hi"])
    mats = boot[boot["metric"] == "mat"].merge(summary, on=["drafter", "mode", "temperature"])
    assert len(mats) == len(summary), "one MAT interval per summary row"
    assert np.allclose(mats["value"], mats["mat"]) and (mats["lo"] <= mats["mat"]).all()
    assert (mats["mat"] <= mats["hi"]).all()
    # the target drafting for itself at T=0 accepts everything: its MAT follows from the lengths alone
    self_chain = summary.query("drafter == 'self' and mode == 'chain' and temperature == 0").iloc[0]
    assert self_chain["alpha_0"] == 1.0
    if self_chain["n_tokens"] == self_chain["n_generations"] * p["max_new_tokens"]:  # no stop token
        cycles = all_accepted_cycles(p["max_new_tokens"], p["chain_depth"])
        assert self_chain["mat"] == pytest.approx(sum(a + 1 for a in cycles) / len(cycles))


def test_saved_tables_of_notebook_05(smoke_run):
    p, configs = smoke_params("05"), trained_configs()
    summary = table(
        "kv_gradient_summary", ["drafter", "kv_frac_small", "kv_position_share", "spearman_received_vs_grad"]
    )
    assert sorted(summary["drafter"]) == sorted(c.name for c in configs), "one row per drafter of notebook 02"
    for column in ("kv_frac_small", "others_frac_small", "kv_position_share", "attention_on_own_branch"):
        assert within(summary[column].dropna(), 0, 1), column
    assert within(summary["spearman_received_vs_grad"].dropna(), -1, 1)
    runs = [f"{r}-seed{s}" for r in p["remedies"] for s in p["remedy_seeds"]]  # each remedy from each seed
    acc = table("remedy_per_step_accuracy", ["drafter", "remedy", "draft_step", "accuracy"])
    eval_steps = parse_drafter_specs([{**p["remedy_drafter"], "name": "x"}])[0].eval_steps
    assert sorted(zip(acc["drafter"], acc["draft_step"])) == sorted(
        (r, k) for r in runs for k in range(eval_steps)
    )
    assert sorted(set(acc["remedy"])) == sorted(p["remedies"]) and within(acc["accuracy"], 0, 1)
    times = table("remedy_training_times", ["drafter", "train_steps"])
    assert times["drafter"].tolist() == runs and (times["train_steps"] == p["remedy_train_steps"]).all()


def test_saved_tables_of_notebook_06(smoke_run):
    p = smoke_params("06")
    trained = [c.name for c in trained_configs()]
    drafters = trained + p["baseline_drafters"]
    speed = table(
        "speedup",
        ["method", "drafter", "temperature", "tokens_per_s", "speedup_vs_ar", "mat", "exact_match_vs_ar"],
    )
    precisions = list(dict.fromkeys(speed["precision"]))
    assert precisions[0] == "fp32" and set(precisions) <= {"fp32", "bf16"}, (
        "fp32 always, bf16 where the CPU has it"
    )
    limited = {k: set(v) for k, v in p["drafter_methods"].items()}
    want = []
    for precision in precisions:
        for t in p["temperatures"]:
            want.append(("ar", "-", t, precision))
            for m in p["methods"]:
                if m in ("chain", "tree", "chain_chosen", "tree_chosen", "combined"):
                    for d in drafters:
                        if m in limited.get(d, {m}) and not (m == "combined" and d == "ngram"):
                            want.append((m, d, t, precision))
                elif m == "hf_generate" or (m == "hf_prompt_lookup" and t == 0):
                    want.append((m, "ngram" if m == "hf_prompt_lookup" else "-", t, precision))
    got = zip(speed["method"], speed["drafter"], speed["temperature"], speed["precision"])
    assert sorted(got) == sorted(want)
    assert (speed["n_prompts"] == p["n_questions"] * p["turns"]).all()
    assert (speed["n_reps"] == p["repeats"]).all()
    assert (speed["tokens_per_s"] > 0).all() and (speed["speedup_vs_ar"] > 0).all()
    assert (speed["speedup_min"] <= speed["speedup_vs_ar"]).all() and (
        speed["speedup_vs_ar"] <= speed["speedup_max"]
    ).all()
    greedy32 = speed[(speed["temperature"] == 0) & (speed["precision"] == "fp32")]
    assert (greedy32["exact_match_vs_ar"] == 1.0).all(), (
        "at T=0 every float32 method reproduces plain decoding"
    )
    spec = speed["method"].isin(["chain", "tree", "chain_chosen", "tree_chosen", "combined"])
    assert (speed.loc[spec, "mat"] >= 1).all() and speed.loc[~spec, "mat"].isna().all()
    assert set(speed.loc[speed["method"].isin(HF_METHODS), "drafter"]) <= {"-", "ngram"}
    self_chain = greedy32.query("method == 'chain' and drafter == 'self'").iloc[0]
    if self_chain["n_tokens"] == self_chain["n_prompts"] * p["max_new_tokens"]:  # no stop token
        cycles = all_accepted_cycles(p["max_new_tokens"], p["chain_depth"])
        assert self_chain["mat"] == pytest.approx(sum(a + 1 for a in cycles) / len(cycles))
    # every greedy divergence (bf16 only) is listed, and the runs table restates the summary's tokens
    runs = table("speedup_runs", ["method", "drafter", "precision", "rep", "tokens_per_s", "speedup_vs_ar"])
    assert runs.groupby(["method", "drafter", "precision"])["n_tokens"].sum().sum() == speed["n_tokens"].sum()
    diverged = table("speedup_divergences", ["method", "drafter", "precision", "position", "margin"])
    assert set(diverged["precision"]) <= {"bf16"}
    costs = table("cost_models", ["precision", "part", "drafter", "n", "seconds"])
    assert set(costs["precision"]) == set(precisions) and (costs["seconds"] > 0).all()
    for _, d in costs[costs["part"].str.startswith("verify")].groupby(["precision", "part"]):
        assert set(d["n"]) >= {1, 2, 8, 64} and d.sort_values("n")["seconds"].is_monotonic_increasing


def per_doc_ce(rows: pd.DataFrame) -> pd.DataFrame:
    """Per test document and step: summed cross-entropy bits and examples over the seeds of ``rows``."""
    return rows.groupby(["doc", "step"])[["ce_bits", "n", "top1", "top5"]].sum()


def test_saved_tables_of_notebook_01(smoke_run):
    """The probes' summary tables restate the per-document table: every estimate is recomputed here from
    ``probe_by_doc.csv`` (pooled ratios over documents and seeds, the information gain over the embedding
    probe, paired differences, the gap between the KV and hidden-state probes and its slope over steps)."""
    p = smoke_params("01")
    data = json.loads((RESULTS / "probe_data.json").read_text())
    assert data["layers"] == p["probe_layers"] and data["n_steps"] == p["n_steps"]
    assert data["train_docs"] == p["n_train_docs"] and 1 <= data["test_docs"] <= p["n_test_docs"]
    assert 1 <= data["readout_vocab"] <= p["readout_size"] and within(
        pd.Series([data["test_coverage"]]), 0, 1
    )
    params = table("probe_params", ["kind", "mlp_width", "params", "budget", "deviation"])
    assert sorted(params["kind"]) == sorted(p["kinds"]) and (params["budget"] == p["probe_budget"]).all()
    assert np.allclose(params["deviation"], params["params"] / p["probe_budget"] - 1) and within(
        params["deviation"].abs(), 0, 0.05
    )
    by_doc = table("probe_by_doc", ["kind", "task", "seed", "doc", "step", "n", "ce_bits", "top1", "top5"])
    real = by_doc[by_doc["task"] == "real"]
    assert set(real["seed"]) == set(p["seeds"]) and set(real["step"]) == set(range(p["n_steps"]))
    assert real["doc"].nunique() == data["test_docs"] and (real["ce_bits"] >= 0).all()
    assert (by_doc["top1"] <= by_doc["top5"]).all() and (by_doc["top5"] <= by_doc["n"]).all()
    # every probe kind and seed is tested on the same examples
    counts = real.pivot_table(index=["doc", "step"], columns=["kind", "seed"], values="n")
    assert counts.notna().all().all() and (counts.nunique(axis=1) == 1).all()
    assert set(by_doc[by_doc["task"] == "control"]["kind"]) == set(p["control_kinds"])

    results = table("probe_results", ["kind", "task", "step", "metric", "value", "ci_lo", "ci_hi"])
    for (kind, task), rows in by_doc.groupby(["kind", "task"]):
        pooled = rows.groupby("step")[["ce_bits", "top1", "top5", "n"]].sum()
        got = results[(results["kind"] == kind) & (results["task"] == task)].set_index(["metric", "step"])
        for metric in ("ce_bits", "top1", "top5"):
            for step, want in (pooled[metric] / pooled["n"]).items():
                row = got.loc[(metric, step)]
                assert row["value"] == pytest.approx(want, rel=1e-9), (kind, task, metric, step)
                assert row["ci_lo"] - 1e-12 <= row["value"] <= row["ci_hi"] + 1e-12
                assert row["n_examples"] == pooled.loc[step, "n"] / rows["seed"].nunique()
    emb = per_doc_ce(real[real["kind"] == "emb"])
    for kind, rows in real.groupby("kind"):
        d = per_doc_ce(rows)
        diff = emb["ce_bits"] / emb["n"] - d["ce_bits"] / d["n"]  # per-document IG in bits
        for step, g in diff.groupby(level="step"):
            w = d["n"].xs(step, level="step")
            want = float((g.droplevel("step") * w).sum() / w.sum())
            row = results.query("kind == @kind and task == 'real' and metric == 'ig_bits' and step == @step")
            assert row["value"].item() == pytest.approx(want, rel=1e-9, abs=1e-12), (kind, step)
    top1 = results[results["metric"] == "top1"].set_index(["kind", "task", "step"])["value"]
    for row in results[results["metric"] == "selectivity"].itertuples():
        want = top1[(row.kind, "real", row.step)] - top1[(row.kind, "control", row.step)]
        assert row.value == pytest.approx(want, abs=1e-12)

    pairwise = table(
        "probe_pairwise", ["kind_a", "kind_b", "step", "ce_diff_bits", "ci_lo", "ci_hi", "p_value"]
    )
    kinds = sorted(real["kind"].unique())
    assert len(pairwise) == len(kinds) * (len(kinds) - 1) // 2 * p["n_steps"]
    for row in pairwise.itertuples():
        a, b = per_doc_ce(real[real["kind"] == row.kind_a]), per_doc_ce(real[real["kind"] == row.kind_b])
        sel = a.index.get_level_values("step") == row.step
        w = a["n"][sel]
        want = float(((a["ce_bits"] / a["n"] - b["ce_bits"] / b["n"])[sel] * w).sum() / w.sum())
        assert row.ce_diff_bits == pytest.approx(want, rel=1e-9, abs=1e-12)
        assert row.ci_lo - 1e-12 <= row.ce_diff_bits <= row.ci_hi + 1e-12 and 0 <= row.p_value <= 1

    gap = table("information_gap", ["kv_probe", "step", "gap_bits", "ci_lo", "ci_hi", "p_value", "verdict"])
    h = per_doc_ce(real[real["kind"] == "h"])
    for kv, rows in gap.groupby("kv_probe"):
        d = per_doc_ce(real[real["kind"] == kv])
        per_step = rows[rows["step"] >= 0].set_index("step")["gap_bits"]
        for step, value in per_step.items():
            sel = h.index.get_level_values("step") == step
            w = h["n"][sel]
            want = float(((h["ce_bits"] / h["n"] - d["ce_bits"] / d["n"])[sel] * w).sum() / w.sum())
            assert value == pytest.approx(want, rel=1e-9, abs=1e-12), (kv, step)
        steps = per_step.index.to_numpy(dtype=float)
        slope = np.polyfit(steps, per_step.to_numpy(), 1)[0]  # least squares, by numpy
        summary = rows[rows["step"] == -1].iloc[0]
        assert summary["gap_bits"] == pytest.approx(slope, rel=1e-6, abs=1e-12)
        grows = "grows with k" if summary["ci_lo"] > 0 else None
        assert grows is None or summary["verdict"].startswith(grows)


def test_saved_tables_of_notebook_04(smoke_run):
    """The query-error tables restate one another: the first sequence's per-step means (``by_step``) and
    accepted / rejected means (``vs_acceptance``) are the means of its per-anchor rows (``positions``); the
    per-head table counts every anchor of every sequence; the verdict's differences and the causal check's
    alphas and MATs are recomputed from the tables they summarize."""
    p = smoke_params("04")
    keys = ["drafter", "estimator", "level", "variant", "sequence", "step"]
    by_step = table("query_error_by_step", [*keys, "n", "out_err", "kl_bits", "recall@4", "cosine"])
    positions = table("query_error_positions", [*keys, "anchor", "accepted", "out_err", "kl_bits"])
    assert set(by_step["step"]) <= set(range(p["n_steps"])) and (by_step["n"] > 0).all()
    assert within(by_step["cosine"].dropna(), -1, 1) and within(by_step["recall@4"].dropna(), 0, 1)
    assert (by_step["out_err"].dropna() >= 0).all() and (by_step["kl_bits"].dropna() >= -1e-6).all()
    first = positions.groupby(keys[:-2])["sequence"].first().iloc[0]
    pos = positions[positions["sequence"] == first]
    got = by_step[by_step["sequence"] == first].set_index(keys)
    metrics = ["out_err", "kl_bits", "js_bits", "cosine", "recall@4", "unavailable_mass"]
    checked = 0
    for key, rows in pos.groupby(keys):
        row = got.loc[key]
        assert row["n"] == len(rows), key  # head pairs x anchors of that step
        for m in metrics:
            assert row[m] == pytest.approx(rows[m].mean(), rel=1e-4, abs=1e-6, nan_ok=True), (key, m)
        checked += 1
    assert checked == len(got) > 0
    vs = table("query_error_vs_acceptance", [*keys, "accepted", "n", "out_err"])
    head = pos[pos["level"] == "head"]
    for key, rows in head.groupby([*keys, "accepted"]):
        row = vs.set_index([*keys, "accepted"]).loc[key]
        assert row["out_err"] == pytest.approx(rows["out_err"].mean(), rel=1e-4, abs=1e-6), key
        assert row["n"] == rows["anchor"].nunique()
    by_head = table(
        "query_error_by_head", ["drafter", "estimator", "level", "variant", "step", "n", "matched"]
    )
    per = ["drafter", "estimator", "level", "variant", "step"]
    assert (by_head.groupby(per)["n"].sum() == by_step.groupby(per)["n"].sum()).all()  # every anchor, once
    mine = by_head[(by_head["level"] == "head") & (by_head["estimator"] == "drafter") & by_head["matched"]]
    mine = mine[mine["variant"] == "with_sink"]  # each drafter query head matches one target head
    assert (mine.groupby(["drafter", "drafter_layer", "drafter_head", "step"]).size() == 1).all()
    # the figures' slices are the full tables' rows
    by_seq = table(
        "query_error_by_sequence", ["drafter", "estimator", "variant", "sequence", "step", "out_err"]
    )
    assert len(by_seq) == (by_step["level"] == "head").sum()
    accepted = table(
        "query_error_accepted", ["drafter", "estimator", "variant", "sequence", "step", "accepted"]
    )
    assert len(accepted) == (vs["variant"].eq("with_sink") & vs["estimator"].isin(["drafter", "stale"])).sum()

    verdict = table("query_error_verdict", ["drafter", "level", "variant", "step", "diff", "ci_lo", "ci_hi"])
    for row in verdict.itertuples():
        d = by_step[(by_step["drafter"] == row.drafter) & (by_step["level"] == row.level)]
        d = d[d["variant"] == row.variant]
        wide = d.pivot_table(index="sequence", columns=["estimator", "step"], values="out_err")
        diff = wide["drafter"] - wide["stale"]  # [sequences, steps]
        want = diff.mean(axis=1).mean() if row.step == -1 else diff[row.step].mean()
        # by_step is saved to 6 significant digits
        assert row.diff == pytest.approx(want, rel=1e-4, abs=1e-7), (row.drafter, row.level, row.step)
        assert row.diff == pytest.approx(row.drafter_mean - row.stale_mean, rel=1e-6, abs=1e-9)
        assert row.ci_lo - 1e-12 <= row.diff <= row.ci_hi + 1e-12 and row.beats_stale == (row.ci_hi < 0)

    causal_by_seq = table(
        "query_causal_by_sequence", ["drafter", "lam", "sequence", "step", "attempts", "accepts"]
    )
    causal = table("query_causal_check", ["drafter", "lam", "step", "alpha_conditional", "n_attempts", "mat"])
    assert set(causal["lam"]) == set(p["lambdas"])
    sums = causal_by_seq.groupby(["drafter", "lam", "step"])[["attempts", "accepts"]].sum()
    for (drafter, lam), rows in causal.groupby(["drafter", "lam"]):
        reach = 1.0
        mat = 1.0
        for row in rows.sort_values("step").itertuples():
            att, acc = sums.loc[(drafter, lam, row.step)]
            assert (row.n_attempts, row.n_accepts) == (att, acc) and 0 <= acc <= att
            alpha = acc / att if att else math.nan
            assert row.alpha_conditional == pytest.approx(alpha, nan_ok=True)
            reach *= alpha if att else 0.0
            mat += reach
        assert (rows["mat"] == rows["mat"].iloc[0]).all() and rows["mat"].iloc[0] == pytest.approx(mat)


def test_saved_tables_of_notebook_07(smoke_run):
    """SpecPV's tables restate their per-prompt rows: fidelity means, speed sums, tokens/s, speedups against
    plain and lossless decoding of the same drafter and context, MATs with the bonus counted; strict and
    lossless runs reproduce plain decoding; the cost fit is refitted from the timed forwards, and the
    per-token curves and crossovers are recomputed from it (the model itself: test_specpv_cost.py)."""
    from kvshot_lib.evaluation import specpv_cost

    p = smoke_params("07")
    run = json.loads((RESULTS / "specpv_run.json").read_text())
    assert run["contexts"] == sorted(run["contexts"]) and len(run["contexts"]) == len(p["contexts"])
    runs = table(
        "specpv_fidelity_runs", ["context", "budget", "full_every", "mode", "n_tokens", "exact_match"]
    )
    assert sorted(set(runs["budget"])) == sorted(p["budgets"]) and sorted(set(runs["full_every"])) == sorted(
        p["full_everys"]
    )
    assert (runs["n_tokens"] == p["fidelity_max_new_tokens"]).all()
    assert (runs["exact_match"] == (runs["first_divergence"] == runs["n_tokens"])).all()
    assert (
        within(runs["top1_agreement"], 0, 1)
        and within(runs["rouge_l"], 0, 1)
        and (runs["kl_mean"] >= 0).all()
    )
    fidelity = table(
        "specpv_fidelity", ["context", "budget", "full_every", "mode", "exact_match", "n_prompts"]
    )
    keys = ["context", "budget", "full_every", "mode"]
    means = runs.groupby(keys)[
        ["exact_match", "first_divergence", "kl_mean", "rouge_l", "n_rollbacks"]
    ].mean()
    for row in fidelity.itertuples():
        want = means.loc[(row.context, row.budget, row.full_every, row.mode)]
        assert row.n_prompts == p["n_fidelity_prompts"]
        for col in want.index:
            assert getattr(row, col) == pytest.approx(want[col]), col

    rows = table(
        "specpv_speed_rows", ["drafter", "context", "method", "n_tokens", "decode_s", "exact_match_vs_ar"]
    )
    speed = table(
        "specpv_speed", ["drafter", "context", "method", "tokens_per_s", "speedup_vs_ar", "mat_full"]
    )
    assert set(speed["drafter"]) == set(run["drafters"]) and set(speed["method"]) == {
        "ar",
        "lossless",
        *p["speed_variants"],
    }
    exact = speed[speed["method"].isin(["lossless", "strict"])]
    assert (exact["exact_match_vs_ar"] == 1.0).all(), "lossless and strict decoding reproduce plain decoding"
    skeys = ["drafter", "context", "method", "budget", "full_every"]
    sums = rows.groupby(skeys).sum(numeric_only=True)
    tps = {}
    for row in speed.itertuples():
        s = sums.loc[(row.drafter, row.context, row.method, row.budget, row.full_every)]
        assert (row.n_tokens, row.accepted_full, row.cycles_full) == (
            s["n_tokens"],
            s["accepted_full"],
            s["cycles_full"],
        )
        assert row.tokens_per_s == pytest.approx(s["n_tokens"] / s["decode_s"])
        want_mat = (
            (s["accepted_full"] + s["cycles_full"]) / s["cycles_full"] if s["cycles_full"] else math.nan
        )
        assert row.mat_full == pytest.approx(want_mat, nan_ok=True)
        want_mat = (
            (s["accepted_partial"] + s["cycles_partial"]) / s["cycles_partial"]
            if s["cycles_partial"]
            else math.nan
        )
        assert row.mat_partial == pytest.approx(want_mat, nan_ok=True)
        assert row.full_ms_per_token == pytest.approx(1000 * s["full_s"] / s["n_tokens"])
        tps[(row.drafter, row.context, row.method)] = row.tokens_per_s
    for row in speed.itertuples():
        assert row.speedup_vs_ar == pytest.approx(row.tokens_per_s / tps[(row.drafter, row.context, "ar")])
        assert row.speedup_vs_lossless == pytest.approx(
            row.tokens_per_s / tps[(row.drafter, row.context, "lossless")]
        )

    costs = table("specpv_forward_costs", ["length", "rows", "seconds", "what"])
    assert sorted(set(costs["length"])) == sorted(x for x in p["cost_lengths"] if x <= max(run["contexts"]))
    fit = specpv_cost.fit_costs(costs)
    assert fit == pytest.approx(run["cost_fit"], rel=1e-6) and all(v >= 0 for v in fit.values())
    crossover = table("specpv_crossover", ["budget", "full_every", "machine", "crossover_tokens", "draft_s"])
    curves = table(
        "specpv_cost_curves", ["budget", "full_every", "machine", "length", "lossless_ms", "specpv_ms"]
    )
    cpu = crossover[crossover["machine"] == "this CPU (fitted)"]
    assert len(cpu) == len(p["speed_budgets"]) * len(p["speed_full_everys"])
    fwd, ref = specpv_cost.cpu_forward(fit), specpv_cost.cpu_refresh(fit)
    for row in cpu.itertuples():
        args = (row.budget, row.full_every, row.draft_s, row.drafted, row.mat_full, row.mat_partial)
        want = specpv_cost.crossover(fwd, ref, *args)
        assert row.crossover_tokens == pytest.approx(want, nan_ok=True)
        sel = curves[(curves["machine"] == row.machine) & (curves["budget"] == row.budget)]
        for c in sel[sel["full_every"] == row.full_every].itertuples():
            a, b = specpv_cost.per_token_seconds(c.length, fwd, ref, *args)
            assert (c.lossless_ms, c.specpv_ms) == pytest.approx((1000 * a, 1000 * b))
            assert c.ratio == pytest.approx(a / b)
