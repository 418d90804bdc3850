"""`kvshot run --dry-run`: what a profile needs (memory, disk, time per notebook) before anything runs, and a
one-line refusal where this machine is short; a too-small disk is simulated through ``shutil.disk_usage``."""

from __future__ import annotations

import json
from collections import namedtuple

import pytest

from kvshot_lib import cli, needs, runner
from kvshot_lib.target import QWEN3_8B_CONFIG

Usage = namedtuple("Usage", "total used free")


@pytest.fixture
def machine(monkeypatch):
    """A machine with ``free`` bytes of disk and plenty of RAM (no GPU, as here)."""

    def set_disk(free: float):
        monkeypatch.setattr(needs.shutil, "disk_usage", lambda path: Usage(2 * free + 1, free + 1, int(free)))
        monkeypatch.setattr(needs, "_available_ram", lambda: 512 * needs.GIB)

    return set_disk


def test_qwen3_8b_trains_online_by_default_and_plans_no_feature_store():
    profile = runner.load_profile("qwen3-8b")
    assert profile.parameters["data_source"] == "online"
    online, _ = runner.check_needs("qwen3-8b")
    store, _ = runner.check_needs("qwen3-8b", sets={"data_source": "store"})
    total = {t: float(r.splitlines()[-2].split()[2]) for t, r in (("online", online), ("store", store))}
    assert total["store"] - total["online"] > 50  # GB: 1,000 conversations x 2,048 tokens x ~44 KB per token
    assert "8.19B parameters" in online and "no feature store (online)" in online


def test_dry_run_refuses_a_too_small_disk_in_one_line(machine, capsys):
    machine(free=5e9)
    assert cli.main(["run", "--profile", "qwen3-8b", "--set", "device=cpu", "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert "notebook" in out and "02" in out  # the plan is printed before the refusal
    line = err.strip()
    assert "\n" not in line and line.startswith(
        "kvshot run: profile 'qwen3-8b' needs more than this machine has"
    )
    assert "disk:" in line and "5.0 GB free" in line and "GB short" in line
    assert "memory" not in line  # 512 GiB of RAM is enough: only the disk is short


def test_dry_run_passes_where_the_machine_has_enough_and_a_real_run_refuses_where_not(machine, capsys):
    machine(free=1e13)
    assert cli.main(["run", "--profile", "smoke", "--dry-run"]) == 0
    assert "fits" in capsys.readouterr().out
    machine(free=0)
    assert cli.main(["run", "--profile", "smoke"]) == 2  # refused before any notebook starts
    assert "--force runs anyway" in capsys.readouterr().err


def test_a_cuda_profile_on_a_machine_without_cuda_is_refused(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    _, short = runner.check_needs("qwen3-8b")
    assert "GPU memory" in short and "this machine has no CUDA GPU" in short


def test_time_and_training_memory_come_from_a_gpu_check_result(tmp_path, monkeypatch):
    train = dict(tokens_per_s=1000.0, peak_memory_gib=40.0, batch_size=2, max_len=2048, draft_vocab_size=32000,
                 checkpoint_bytes=int(1e9))  # fmt: skip
    result = dict(
        machine=dict(gpu="Some GPU"),
        data=dict(max_len=2048, mean_tokens_per_conversation=1000.0),
        stages={
            "build": dict(peak_memory_gib=14.0),
            "extraction": dict(tokens_per_s=5000.0, bytes_per_token=45000),
            "plain_decoding": dict(tokens_per_s=50.0),
            **{f"train_{p}-ttt": train for p in ("hidden", "kv", "hybrid")},
        },
    )
    (tmp_path / "gpu_check_some-gpu.json").write_text(json.dumps(result))
    monkeypatch.setattr(needs, "RESULTS_DIR", tmp_path)
    report, _ = runner.check_needs("qwen3-8b", only=["05"])
    row = next(line.split() for line in report.splitlines() if line.startswith("05"))
    weights = needs.target_params(dict(QWEN3_8B_CONFIG)) * 2 / needs.GIB
    assert float(row[1]) == pytest.approx(40.0 - 14.0 + weights, abs=0.05)  # the measured peak, real weights
    assert float(row[3]) == pytest.approx(
        12 * 1000 * 2 * 1000 / 1000 / 3600, abs=0.05
    )  # 12 runs at 1,000 tok/s
    assert "gpu_check_some-gpu.json" in report and "measured" in row[4]
