"""The reference run's remote-job transport (``scripts/reference/``) on the CPU: the plan, what a job brings
back, the checkpoints, the merge.

* Reference checkpoints (bf16, trainable weights only) load on the CPU with their target and refuse another
  one (another architecture, or the same architecture with other weights); split files reassemble exactly.
* ``run_job.py job`` refuses bad arguments before any long work (no target is loaded).
* What a job writes is checked against the device's limits; the merge replaces a rerun row and draws the figures.
"""

import json
import subprocess
import sys
import tarfile

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import assert_reference_checkpoint, trained_like

from kvshot_lib.drafters import load_drafter
from kvshot_lib.evaluation import (
    AcceptanceRun,
    acceptance_summary,
    bootstrap_acceptance,
    generation_table,
    paired_mat_difference,
)
from kvshot_lib.reference import PlanError, load_plan, tables
from kvshot_lib.target import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts" / "reference"))
from transport import merge, outputs  # noqa: E402

RUN_JOB = REPO_ROOT / "scripts" / "reference" / "run_job.py"


def test_reference_checkpoint_is_bf16_trainable_only_and_loads_on_cpu(tiny_llama, tmp_path):
    d = trained_like(tiny_llama, "hybrid")
    (path,) = outputs.export_checkpoint(d, tmp_path, "hybrid-ttt")
    folder = outputs.import_checkpoint([path], tmp_path / "ckpt")
    assert_reference_checkpoint(d, [folder / "model.safetensors"], folder, tiny_llama)


def test_a_checkpoint_over_the_file_limit_is_split_and_reassembled(tiny_llama, tmp_path, monkeypatch):
    d = trained_like(tiny_llama, "kv")
    (whole,) = (
        outputs.export_checkpoint(d, tmp_path / "one", "kv-ttt") if (tmp_path / "one").mkdir() is None else ()
    )
    monkeypatch.setattr(outputs, "MAX_FILE", outputs.MiB + 60_000)  # ~60 KB per part after the 1 MiB margin
    parts = outputs.export_checkpoint(d, tmp_path, "kv-ttt")
    assert len(parts) > 1 and all(p.stat().st_size < outputs.MiB + 60_000 for p in parts)
    a = load_drafter(outputs.import_checkpoint(parts, tmp_path / "a"), tiny_llama)
    b = load_drafter(outputs.import_checkpoint([whole], tmp_path / "b"), tiny_llama)
    for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), n


def test_output_limits_are_checked(tmp_path):
    job = tmp_path / "j01"
    job.mkdir()
    for i in range(8):
        (job / f"f{i}.csv").write_text("x\n")
    assert outputs.check_limits(tmp_path) == []
    (job / "f8.csv").write_text("x\n")
    with pytest.raises(outputs.OutputLimitError, match="9 files"):
        outputs.check_limits(tmp_path)
    (job / "f8.csv").unlink()
    (job / "deep" / "er").mkdir(parents=True)
    (job / "deep" / "er" / "x.csv").write_text("x")
    with pytest.raises(outputs.OutputLimitError, match="two folders down"):
        outputs.check_limits(tmp_path)


def test_plan_rows_follow_the_issue_and_resolve_like_and_best(tmp_path):
    plan = load_plan("reference-gpu")
    assert list(plan.rows)[:4] == ["none-ttt", "hidden-ttt", "kv2-ttt", "hybrid-ttt"]  # the issue's order
    assert plan.headline_rows() == ["none-ttt", "hidden-ttt", "kv2-ttt", "hybrid-ttt"]
    seeds = [r for r in plan.rows if r.endswith(("-s1", "-s2"))]
    assert (
        len(seeds) == 8
        and plan.rows["kv2-ttt-s2"].params["kv_mode"] == plan.rows["kv2-ttt"].params["kv_mode"]
    )
    assert plan.rows["hybrid-from-hidden-ttt"].init_row == "hidden-ttt"
    assert all(r.params["data_source"] == "online" for r in plan.rows.values())
    assert {r for j in plan.jobs.values() for r in j.rows} == set(plan.rows)  # every row has a job
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "parameters: {target: tiny-llama}\nreference:\n  data: {responses: original}\n  training: {}\n"
        "  rows: [{name: a, paradigm: hidden, regime: ttt}]\n  jobs: [{name: j, rows: [a, b]}]\n"
    )
    with pytest.raises(PlanError, match=r"rows \['b'\]"):
        load_plan(str(bad))
    bad.write_text(bad.read_text().replace("rows: [a, b]", "rows: [a]").replace("regime: ttt", "regime: tt"))
    with pytest.raises(PlanError, match="regime"):
        load_plan(str(bad))


def run_job(*args, env=None):
    return subprocess.run(
        [sys.executable, str(RUN_JOB), *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.parametrize(
    "args,match",
    [
        (["job", "j99", "--out", "/tmp"], "unknown job 'j99'"),
        (["job", "j01", "--rows", "nope", "--out", "/tmp"], "unknown row 'nope'"),
        (["job", "j01", "--minutes", "12", "--out", "/tmp"], "minutes must be in"),
        (["job", "j01", "--device", "cpu"], "no output folder"),
        (["job", "j01", "--device", "cuda", "--out", "/tmp"], "CUDA is not available"),
        (["job", "j01", "--device", "cpu", "--out", "/tmp"], "not staged"),
        (["stage", "runs/reference-payload/part-x.bin"], "no payload part"),
    ],
)
def test_job_command_refuses_bad_arguments_before_long_work(args, match, tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("OUT",)}
    env["KVSHOT_CACHE"] = str(tmp_path)  # a bare machine: nothing staged
    done = run_job(*args, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert match in done.stderr
    assert "environment" not in done.stdout  # no job started: nothing was loaded or written


def fake_job(root, job, rows, started, acc0):
    """A job output folder as a train job writes it (tables only)."""
    scratch = root / f"scratch-{job}"
    for d, a in zip(rows, acc0):
        (scratch / "rows" / d).mkdir(parents=True)
        label = dict(drafter=d, paradigm=d.split("-")[0], regime="ttt")
        pd.DataFrame(
            [dict(step=s, loss=5.0 - s, acc_0=a * s / 3, tokens=100, **label) for s in (1, 2, 3)]
        ).to_csv(scratch / "rows" / d / "training_history.csv", index=False)
        evals = [
            dict(step=s, **{f"acc_{k}": a * s / 3 * 0.9**k for k in range(7)}, n_0=50, ce_0=1.0, **label)
            for s in (1, 2, 3)
        ]
        pd.DataFrame(evals).to_csv(scratch / "rows" / d / "heldout_eval.csv", index=False)
        per_step = [dict(**label, draft_step=k, accuracy=a * 0.9**k, n=50) for k in range(7)]
        pd.DataFrame(per_step).to_csv(scratch / "rows" / d / "per_step_accuracy.csv", index=False)
    summary = [
        dict(drafter=d, paradigm=d.split("-")[0], regime="ttt", train_tokens=300, seconds=1.0, acc_0=a)
        for d, a in zip(rows, acc0)
    ]
    pd.DataFrame(summary).to_csv(scratch / "summary.csv", index=False)
    (scratch / "environment.json").write_text(
        json.dumps(dict(job=job, kind="train", rows=rows, started=started, gpu="test"))
    )
    out = root / "returned" / job
    out.mkdir(parents=True)
    with tarfile.open(out / outputs.TABLES, "w:gz") as t:
        for f in scratch.rglob("*"):
            if f.is_file():
                t.add(str(f), arcname=str(f.relative_to(scratch)))
    return out


def test_merge_replaces_rerun_rows_and_draws_the_figures(tmp_path):
    plan = load_plan("reference-gpu", smoke=True)
    fake_job(tmp_path, "j01", ["none-ttt", "hidden-ttt"], "2026-01-01 10:00:00", [0.2, 0.5])
    merge.merge(plan, [tmp_path / "returned"], root=tmp_path / "repo")
    fake_job(tmp_path, "j02", ["hidden-ttt"], "2026-01-02 10:00:00", [0.6])  # a rerun of hidden-ttt
    rec = merge.merge(plan, [tmp_path / "returned" / "j02"], root=tmp_path / "repo")
    data = tmp_path / "repo" / "figures" / "reference-gpu" / "data"
    rows = pd.read_csv(data / "reference_rows.csv").set_index("drafter")
    assert sorted(rows.index) == ["hidden-ttt", "none-ttt"] and rows.loc["hidden-ttt", "acc_0"] == 0.6
    per_step = pd.read_csv(data / "per_step_accuracy.csv")
    assert per_step[per_step.drafter == "hidden-ttt"].set_index("draft_step").loc[
        0, "accuracy"
    ] == pytest.approx(0.6)
    history = pd.read_csv(data / "training_history.csv")
    assert len(history.query("drafter == 'hidden-ttt'")) == 3  # not 6
    none = history.query("drafter == 'none-ttt'").set_index("step")["acc_0"]
    assert none[1] == 0.066667 and none[2] == 0.13333  # 0.2 x 1/3 and x 2/3, kept to 5 significant digits
    assert set(rec["figures"]) == {"02_per_step_accuracy", "02_training_curves", "02_heldout_over_training"}
    table = pd.read_csv(data / "reference_table.csv").set_index("drafter")
    assert table.loc["hidden-ttt", "heldout_mat"] == pytest.approx(
        1 + sum(0.6 ** (k + 1) * 0.9 ** (k * (k + 1) / 2) for k in range(7))
    )
    figs = tmp_path / "repo" / "figures" / "reference-gpu"
    done = subprocess.run(
        [sys.executable, "-m", "kvshot_lib.cli", "figures", "--profile", str(figs), "--out", str(tmp_path / "again")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for png in figs.glob("*.png"):
        assert (tmp_path / "again" / png.name).read_bytes() == png.read_bytes()


class FakeResult:
    def __init__(self, attempts, accepts, per_cycle, n_tokens=10, prompt_len=20):
        self.step_attempts, self.step_accepts, self.accepted_per_cycle = attempts, accepts, per_cycle
        self.token_ids, self.draft_s, self.prompt_len = [0] * n_tokens, 0.0, prompt_len


def test_bootstrap_point_values_match_the_summary_and_lie_in_the_interval():
    g = torch.Generator().manual_seed(0)
    results = []
    for _ in range(30):
        att = [30, 25, 20, 16, 12, 9, 7]
        acc = [int(torch.randint(a // 3, a + 1, (1,), generator=g)) for a in att]
        results.append(FakeResult(att, acc, torch.randint(0, 5, (30,), generator=g).tolist()))
    run = AcceptanceRun("d", "hidden", "ttt", "chain", 0.0, results)
    boot = bootstrap_acceptance([run], n_boot=200).set_index("metric")
    summary = acceptance_summary([run]).iloc[0]
    assert boot.loc["mat", "value"] == pytest.approx(summary["mat"])
    assert boot.loc["alpha_0", "value"] == pytest.approx(summary["alpha_0"])
    assert boot.loc["retention", "value"] == pytest.approx(summary["retention"])
    for m in ("alpha_0", "alpha_6", "mat", "retention"):
        assert boot.loc[m, "lo"] <= boot.loc[m, "value"] <= boot.loc[m, "hi"]
        assert boot.loc[m, "lo"] < boot.loc[m, "hi"]


def test_retention_below_the_attempt_minimum_has_no_value_and_no_interval():
    # 15 + 4 = 19 pooled attempts at step 6, one short of the minimum; a resample drawing the first generation
    # twice has 30, so without the guard the interval would come from such resamples alone
    results = [
        FakeResult([40] * 6 + [15], [30] * 6 + [10], [2] * 10),
        FakeResult([40] * 6 + [4], [30] * 6 + [2], [2] * 10),
    ]
    run = AcceptanceRun("d", "hidden", "ttt", "chain", 0.0, results)
    boot = bootstrap_acceptance([run], n_boot=200).set_index("metric")
    assert np.isnan(boot.loc["retention", ["value", "lo", "hi"]].astype(float)).all()
    assert not np.isnan(boot.loc["alpha_6", ["value", "lo", "hi"]].astype(float)).any()


def test_paired_mat_difference_is_the_difference_of_pooled_mats_and_cancels_what_turns_share():
    g = torch.Generator().manual_seed(0)
    prompts = [int(p) for p in torch.randint(20, 400, (40,), generator=g)]
    # turns differ a lot in how easy they are (0 to 3 accepted per cycle), for both drafters alike; the drafter
    # accepts one more draft than the n-gram drafter every 4th cycle of every turn
    easy = [int(e) for e in torch.randint(0, 4, (40,), generator=g)]
    base = [FakeResult([], [], [e] * 8, prompt_len=p) for e, p in zip(easy, prompts)]
    better = [
        FakeResult([], [], [e + (c % 4 == 0) for c in range(8)], prompt_len=p) for e, p in zip(easy, prompts)
    ]
    runs = [
        AcceptanceRun("ngram", "ngram", "", "chain", 0.0, base),
        AcceptanceRun("d", "hidden", "ttt", "chain", 0.0, better),
    ]
    diff = paired_mat_difference(generation_table(runs), [("d - n-gram", "d", "ngram")], n_boot=500).iloc[0]
    by_hand = (sum(easy) * 8 + 2 * 40) / (8 * 40) - sum(easy) * 8 / (8 * 40)  # MAT = 1 + accepted / cycles
    assert diff["mat_diff"] == pytest.approx(by_hand) == pytest.approx(0.25)
    # the gap is the same on every turn, so a paired interval is tight around it although the turns vary
    assert diff["lo"] == pytest.approx(0.25) and diff["hi"] == pytest.approx(0.25) and diff["p"] < 0.01
    unpaired = bootstrap_acceptance(runs, n_boot=500).query("metric == 'mat'").set_index("drafter")
    assert (unpaired["hi"] - unpaired["lo"]).min() > 10 * (diff["hi"] - diff["lo"] + 1e-3)
    # other turns do not pair up: no row
    other = [FakeResult([], [], r.accepted_per_cycle, prompt_len=r.prompt_len + 1) for r in better]
    runs[1] = AcceptanceRun("d", "hidden", "ttt", "chain", 0.0, other)
    assert paired_mat_difference(generation_table(runs), [("d - n-gram", "d", "ngram")], n_boot=50).empty


def test_regeneration_archives_split_under_the_limit_and_reinstall(tmp_path):
    folder = tmp_path / "cache" / "regenerated" / "smollm2-135m-abc"
    folder.mkdir(parents=True)
    shards = []
    for i in range(3):
        recs = [dict(id=f"c{i}-{j}", messages=[{"role": "user", "content": "x" * 400}]) for j in range(2)]
        (folder / f"shard-{i:05d}.json").write_text(json.dumps(recs))
        shards.append(dict(file=f"shard-{i:05d}.json", conversations=2, generated_tokens=10))
    (folder / "manifest.json").write_text(json.dumps(dict(shards=shards)))
    out = tmp_path / "out" / "regen"
    out.mkdir(parents=True)
    parts = outputs.add_regenerated(out, folder, raw_budget=1000)
    assert [p.name for p in parts] == [f"regenerated-smollm2-135m-abc.part{k}of3.tar.gz" for k in (1, 2, 3)]
    merged = merge._keep_regenerated(out, tmp_path / "repo", "reference")
    assert len(merged) == 3
    fresh = tmp_path / "fresh"
    assert merge.install_regenerated(tmp_path / "repo" / "data" / "reference" / "regenerated", fresh) == [
        folder.name
    ]
    for f in folder.iterdir():
        assert (fresh / "regenerated" / folder.name / f.name).read_bytes() == f.read_bytes()
    assert (
        merge.install_regenerated(tmp_path / "repo" / "data" / "reference" / "regenerated", fresh) == []
    )  # up to date


def test_significant_rounds_float_columns_once():
    df = pd.DataFrame(dict(step=[1, 2], loss=[150.11708068847656, 1e-05], acc=[0.0030864197530864196, 0.0]))
    got = tables.significant(df, 5)
    assert got["loss"].tolist() == [150.12, 1e-05] and got["acc"].tolist() == [0.0030864, 0.0]
    assert got["step"].tolist() == [1, 2] and got["step"].dtype == df["step"].dtype  # integers untouched
    pd.testing.assert_frame_equal(tables.significant(got, 5), got)  # rounding again changes nothing
