"""benchmarks/gpu_check.py at toy shapes on the CPU: the same code `make gpu-check` runs on a GPU at Qwen3-8B's shape.

The check reads a bundle that `make gpu-bundle` writes (tokenizer files, a ShareGPT slice, MT-bench) through
KVSHOT_ASSETS_DIR; here a small bundle is written and `make gpu-check GPU_SCALE=tiny` runs on it in seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvshot_lib.corpus import load_mtbench, load_sharegpt
from kvshot_lib.target import REPO_ROOT, assets, random_target

# the check's parts sit beside its script, which imports them so
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import gpu_stages  # noqa: E402


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("bundle") / "gpu_bundle"
    gpu_stages.write_bundle(out, n_conversations=40)
    return out


def test_the_bundle_holds_what_the_check_reads_and_no_weights(bundle):
    manifest = json.loads((bundle / "bundle.json").read_text())
    files = sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file())
    assert {
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
        "tokenizer/chat_template.jinja",
    } <= set(files)
    assert not [f for f in files if f.endswith(".safetensors")], "the bundle must not carry model weights"
    assert manifest["sharegpt_records"] == 40
    assert manifest["bytes"] == sum((bundle / f).stat().st_size for f in manifest["files"]) < 20e6
    before = os.environ.get("KVSHOT_ASSETS_DIR")
    with gpu_stages.bundle_assets(bundle):
        assert assets.sharegpt_json().is_relative_to(bundle) and assets.mtbench_jsonl().is_relative_to(bundle)
        conversations, counts = load_sharegpt()
        assert len(conversations) + sum(v for k, v in counts.items() if k != "ok") == 40
        assert len(load_mtbench()) == 80
    assert os.environ.get("KVSHOT_ASSETS_DIR") == before


@pytest.fixture(scope="module")
def result(bundle, tmp_path_factory):
    """`make gpu-check GPU_SCALE=tiny`: the Makefile's command (PYTHONPATH=., the bundle) with this interpreter."""
    out = tmp_path_factory.mktemp("results")
    make = [
        "make",
        "--no-print-directory",
        "gpu-check",
        "GPU_SCALE=tiny",
        f"GPU_BUNDLE={bundle}",
        f"PYTHON={sys.executable}",
        f"GPU_ARGS=--out-dir {out} --threads 1",
    ]
    run = subprocess.run(make, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"--bundle {bundle}" in run.stdout.splitlines()[0] and "PYTHONPATH=." in run.stdout.splitlines()[0]
    (dest,) = out.glob("gpu_check_*_tiny.json")
    return json.loads(dest.read_text()), dest


def test_tiny_check_reports_every_number_positive(result):
    r, dest = result
    assert r["errors"] == {}
    s = r["stages"]
    assert s["extraction"]["tokens_per_s"] > 0 and s["extraction"]["bytes_per_token"] > 0
    for paradigm in ("hidden", "kv", "hybrid"):
        row = s[f"train_{paradigm}-ttt"]
        assert row["tokens_per_s"] > 0 and row["timed_steps"] >= 1 and row["checkpoint_bytes"] > 0
    assert r["complete"] and list(s)[:6] == ["build", "plain_decoding", "verification_cost", "cycle_overhead",
                                             "replayed_acceptance", "greedy_equality"]  # most important first  # fmt: skip
    plain = s["plain_decoding"]
    assert plain["tokens_per_s"] > 0 and plain["graphs_tokens_per_s"] > 0
    assert plain["same_tokens"] == plain["prompts"]  # float32: the fast path decodes plain decoding's tokens
    assert s["verification_cost"]["eager_k1_ms"] > 0
    for mode in ("chain", "tree", "chain_host", "tree_host"):  # the draft loop on the device and on the host
        cyc = s["cycle_overhead"][mode]
        assert cyc["cycles"] > 0 and cyc["draft_ms"] > 0
        assert cyc["draft_loop"] == ("host" if mode.endswith("_host") else "device")
        # both are timings (taken apart, on shared cores): only that each was measured is a property
        assert cyc["verify_forward_ms"] > 0 and cyc["verify_ms"] > 0
    assert s["cycle_overhead"]["draft_capture_s"] == 0  # a CPU runs the draft loop eagerly: nothing captured
    for name, row in s.items():
        assert row["seconds"] > 0 and row["peak_memory_gib"] > 0, name
    cost = s["verification_cost"]["rows"]
    assert [c["k"] for c in cost] == list(gpu_stages.SCALES["tiny"].cv_sizes)
    assert cost[0]["chain_rel"] == 1.0 and all(c["chain_s"] > 0 and c["tree_s"] > 0 for c in cost)
    assert "151,936" in r["target"]["vocabulary_note"]  # says the vocabulary is not Qwen3's
    assert dest.name == f"gpu_check_{r['machine']['name']}_tiny.json"
    assert "| plain decoding, fast path |" in dest.with_suffix(".md").read_text()


def test_tiny_check_times_every_drafter_at_replayed_acceptance(result):
    """Each drafter, chain and tree, at the paper's acceptance: real drafting and verification, plain decoding's
    tokens committed (so every output equals it), the drawn MAT near the aimed one, every time positive."""
    r, dest = result
    rep = r["stages"]["replayed_acceptance"]
    scale = gpu_stages.SCALES["tiny"]
    assert "replayed acceptance" in rep["label"] and rep["plain_tokens_per_s"] > 0
    rows = rep["rows"]
    assert [(x["drafter"], x["mode"]) for x in rows] == [
        (d, m) for d in scale.replay_drafters for m in ("chain", "tree")
    ]
    for x in rows:
        assert "error" not in x, x
        assert x["equal_to_plain"] == rep["prompts"] == scale.replay_prompts
        assert x["tokens_per_s"] > 0 and x["speedup"] > 0 and x["draft_ms"] > 0 and x["cycles"] > 0
        depth = scale.replay_chain_depth if x["mode"] == "chain" else scale.replay_tree["tree_depth"]
        assert 1 <= x["mat"] <= depth + 1 and 1 < x["aimed_mat"] <= depth + 1
    hidden = {x["mode"]: x["draft_ms"] for x in rows if x["drafter"] == "hidden"}
    for x in rows:  # the drafting time against the hidden drafter's, in the same mode
        assert abs(x["draft_vs_hidden"] - (x["draft_ms"] / hidden[x["mode"]] - 1)) < 1e-3
    assert "| hybrid | tree |" in dest.with_suffix(".md").read_text()


def test_tiny_check_chain_and_tree_equal_plain_decoding(result):
    eq = result[0]["stages"]["greedy_equality"]
    assert eq["dtype"] == "float32" and eq["of"] == 16  # (3 fresh + self) x (chain, tree) x 2 prompts
    assert eq["equal"] == eq["of"], [row for row in eq["rows"] if not row["equal"]]
    assert eq["equal_until_tie"] == eq["of"] and 0 <= eq["near_tie_share"] < 0.5
    assert {row["mode"] for row in eq["rows"]} == {"chain", "tree"}
    assert max(row["mat"] for row in eq["rows"] if row["drafter"] == "self") > 1  # drafts accepted, committed


def test_the_float32_pass_casts_the_target_in_place(tokenizer):
    target = random_target(gpu_stages.SCALES["tiny"].config, "qwen3", tokenizer, "cpu", "bfloat16")
    fp32 = gpu_stages.float32_in_place(target, "cpu")
    assert fp32.model is target.model and fp32.info.dtype == "float32"
    assert {p.dtype for p in fp32.model.parameters()} == {torch.float32}


def test_a_check_killed_after_a_stage_leaves_that_stage(bundle, tmp_path):
    """The result is written after every stage: kill the tiny check once replayed acceptance is reported, and the
    JSON on disk holds its numbers and plain decoding's, and says the run is incomplete."""
    cmd = [sys.executable, "benchmarks/gpu_check.py", "--scale", "tiny", "--bundle", str(bundle)]
    cmd += ["--out-dir", str(tmp_path), "--threads", "1"]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    try:
        for line in proc.stdout:
            if line.startswith("[gpu-check] replayed_acceptance: {"):
                proc.kill()
                break
    finally:
        proc.kill()
        proc.wait(timeout=60)
    (dest,) = tmp_path.glob("gpu_check_*_tiny.json")
    r = json.loads(dest.read_text())
    assert r["complete"] is False and r["stages"]["plain_decoding"]["graphs_tokens_per_s"] > 0
    assert all(x["tokens_per_s"] > 0 for x in r["stages"]["replayed_acceptance"]["rows"])
    assert "greedy_equality" not in r["stages"]
    assert "incomplete" in dest.with_suffix(".md").read_text()
