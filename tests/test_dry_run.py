"""`kvshot run --dry-run`: what a profile needs (memory, disk, time per notebook) before anything runs, and a
one-line refusal where this machine is short; a too-small disk is simulated through ``shutil.disk_usage``."""

from __future__ import annotations

import json
from collections import namedtuple

import pytest

from kvshot_lib import cli, needs, run_time, runner
from kvshot_lib.target import QWEN3_8B_CONFIG
from kvshot_lib.user_errors import EXIT_MACHINE_SHORT

RESULTS = run_time.RESULTS_DIR

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
    assert (
        cli.main(["run", "--profile", "qwen3-8b", "--set", "device=cpu", "--dry-run"]) == EXIT_MACHINE_SHORT
    )
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
    assert cli.main(["run", "--profile", "smoke"]) == EXIT_MACHINE_SHORT  # refused before any notebook starts
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
    monkeypatch.setattr(needs, "RESULTS_DIR", tmp_path)  # where plan_needs looks for rates
    report, _ = runner.check_needs("qwen3-8b", only=["05"])
    row = next(line.split() for line in report.splitlines() if line.startswith("05"))
    weights = run_time.target_params(dict(QWEN3_8B_CONFIG)) * 2 / needs.GIB
    assert float(row[1]) == pytest.approx(40.0 - 14.0 + weights, abs=0.05)  # the measured peak, real weights
    # 12 runs at 1,000 tok/s, each 1,000 steps + 20 gradient probes (every 50) of 2 x 1,000 tokens, and two
    # held-out evaluations of 200 sequences x 1,000 tokens, forward only (a third of a step's cost per token)
    per_run = (1000 + 20) * 2 * 1000 + 2 * 200 * 1000 / 3
    assert float(row[3]) == pytest.approx(12 * per_run / 1000 / 3600, abs=0.005)
    assert "gpu_check_some-gpu.json" in report and "measured" in row[4]


SMOLLM2 = dict(family="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
               tie_word_embeddings=True, max_position_embeddings=8192)  # fmt: skip
DEMO = RESULTS / "make_demo_amd-epyc-2cores-avx512bf16.json"


def test_store_bytes_come_from_the_targets_own_shape():
    # three hidden layers, their K and V, the final hidden state, in bf16 (2 bytes)
    assert needs.store_bytes_per_token(SMOLLM2) == 2 * (3 * 576 + 3 * 2 * 3 * 64 + 576) == 6912
    assert needs.store_bytes_per_token(dict(QWEN3_8B_CONFIG)) == 2 * (3 * 4096 + 3 * 2 * 8 * 128 + 4096)


def test_a_cpu_dry_run_uses_the_cpu_table_and_smollm2s_store_size(monkeypatch):
    """On a CPU the rates are the committed CPU table's, not the H200 check's; the store is SmolLM2's size, read
    from the table's architecture where the converted model is not there yet (a fresh clone)."""
    monkeypatch.setattr(needs, "target_shape", lambda name: None)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    full = _full("default")
    planned, context = needs.plan_needs(full, sorted(full))
    assert context["rates_file"].name.startswith("cpu_rates_") and context["shape"]["hidden_size"] == 576
    table = json.loads(context["rates_file"].read_text())
    mean, bpt = (
        table["data"]["mean_tokens_per_conversation"],
        table["stages"]["extraction"]["bytes_per_token"],
    )
    assert abs(bpt - 6912) < 50  # measured on SmolLM2: its own shape, not the 8B's 45 KB
    n_conv = full["00"]["n_train_conversations"] + full["00"]["n_eval_conversations"]
    assert planned[0].cache_gb == pytest.approx(n_conv * mean * bpt / 1e9)  # ~1.1 GB, not 7.8
    assert planned[0].cache_gb < 2


def test_the_default_dry_run_matches_make_demo_within_35_percent():
    """The committed make demo run (one thread, AMD EPYC AVX512-BF16): every notebook within +-35% of the CPU
    estimate, except 01, whose probes' own training has no measured rate and is not counted (so it is under)."""
    full = _full("default")
    planned, _ = needs.plan_needs(full, sorted(full))
    measured = {k[:2]: v for k, v in json.loads(DEMO.read_text())["notebooks"].items()}
    ratios = {n.notebook: n.hours * 3600 / measured[n.notebook] for n in planned}
    assert all(0.65 <= r <= 1.35 for nb, r in ratios.items() if nb != "01"), ratios
    assert ratios["01"] < 1
    assert sum(n.hours for n in planned) * 3600 == pytest.approx(sum(measured.values()), rel=0.1)


def _full(profile: str) -> dict:
    defaults = {n: runner.notebook_parameters(p) for n, p in runner.list_notebooks().items()}
    plan = runner.plan_run(runner.load_profile(profile))
    return {nb.name[:2]: {**defaults[nb.name[:2]], **p} for nb, p in plan}


RATES = dict(stages=dict(extraction=dict(tokens_per_s=1000.0), plain_decoding=dict(tokens_per_s=10.0),
                         drafting=dict(step_rel=0.1)))  # fmt: skip


def test_greedy_replay_is_costed_as_replay_not_as_decoding():
    """Notebook 03 at T=0, one question (2 turns of 32 tokens), prompt lookup and one trained drafter, chain and
    tree. Worked by hand at 10 tok/s plain decoding (0.1 s a step), 1,000 tok/s target passes, a one-layer
    drafter step of 0.1 plain steps, prompt lookup's 0.01, and the assumed MATs (chain 1.6, tree 2.3, lookup 1.5)."""
    p = dict(max_new_tokens=32, temperatures=[0.0], n_questions=1, n_questions_sampled=0, modes=["chain", "tree"],
             chain_depth=8, tree_depth=7, tree_budget=24, baseline_drafters=["ngram"], greedy_replay=True)  # fmt: skip
    full = {"02": {"drafters": [{"paradigm": "hidden", "regime": "ttt"}]}}
    prompt = (100 + 130 + 32) / 2  # turn 1's prompt, turn 2's with the first answer
    references = 2 * 32 * 0.1 + 2 * prompt / 1000  # plain decoding, prefill included
    passes = 2 * (prompt + 32) / 1000  # one forward over each prompt + answer, shared by every drafter
    lookup = (
        64 / 1.5 * 1.5 * 0.01 * 0.1 + 64 / 1.5 * 7 * 0.01 * 0.1
    )  # chain: calls up to the first wrong draft
    hidden = 64 / 1.6 * 1.6 * 0.1 * 0.1 + 64 / 2.3 * 7 * 0.1 * 0.1  # tree: every level drafted
    got = run_time.acceptance_seconds(p, full, run_time.Rates(RATES))
    assert got == pytest.approx(references + passes + lookup + hidden)
    assert got < references + 2 * 2 * 64 * 0.1  # far below every drafter's tokens at the plain-decoding rate


def test_the_engine_at_t1_pays_a_verification_forward_per_cycle():
    """T>0: tokens / MAT cycles, each c_v(k) / c_v(1) (measured: 1.5 at k = 9) plain steps and 8 drafter steps."""
    rates = dict(RATES, stages=dict(RATES["stages"], verification_cost=dict(
        rows=[dict(k=1, chain_rel=1.0, tree_rel=1.0), dict(k=9, chain_rel=1.5, tree_rel=1.4)])))  # fmt: skip
    d = run_time.Drafter("hidden-ttt")
    got = run_time.speculative_seconds(640, d, "chain", 8, 9, run_time.Rates(rates))
    assert got == pytest.approx(640 / 1.6 * (1.5 + 8 * 0.1) * 0.1)


def test_the_cuda_graph_rate_is_preferred_where_the_check_measured_it():
    eager = dict(stages=dict(plain_decoding=dict(tokens_per_s=22.35)))
    graphs = dict(stages=dict(plain_decoding=dict(tokens_per_s=22.35, graphs_tokens_per_s=104.9)))
    assert run_time.Rates(eager).decode() == 22.35 and run_time.Rates(graphs).decode() == 104.9
    assert run_time.Rates(graphs).hf_decode == 22.35  # transformers' own generate stays eager


def test_a_drafter_step_comes_from_a_measurement_where_there_is_one():
    """A one-layer drafter's step: the CPU table's measured step, else the check's chain cycle overhead per
    drafted token (0.6 c_v(1) over 6 drafts), else 2 of the target's 36 layers; a 5-layer block drafter, 3x."""
    table = run_time.Rates(dict(stages=dict(drafting=dict(step_rel=0.05))))
    check = run_time.Rates(dict(settings=dict(chain_depth=6), stages=dict(cycle_overhead=dict(
        chain=dict(overhead_over_cv1=0.6)))))  # fmt: skip
    bare = run_time.Rates(dict(stages={}), dict(QWEN3_8B_CONFIG))
    assert table.draft_step(1) == 0.05 and check.draft_step(1) == pytest.approx(0.1)
    assert bare.draft_step(1) == pytest.approx(2 / 36) and bare.draft_step(5) == pytest.approx(3 * 2 / 36)


def test_rates_of_another_target_are_scaled_by_parameters():
    big = dict(QWEN3_8B_CONFIG, vocab_size=49152)
    result = dict(target=dict(architecture=big, vocab_size=49152), stages=RATES["stages"])
    rates = run_time.Rates(result, SMOLLM2)
    assert not rates.same_target and rates.bytes_per_token is None  # the store is sized from SmolLM2's shape
    assert rates.decode() == pytest.approx(
        10.0 * run_time.target_params(big) / run_time.target_params(SMOLLM2)
    )


def test_the_qwen3_8b_speed_table_is_sized_for_5_percent_intervals():
    cv = 0.272  # the largest per-turn cv of cycles per token of a trained drafter at T=0 (the profile's comment)
    assert needs.turns_for_interval(cv) == 114  # (1.96 * 0.272 / 0.05)^2 = 113.7
    p = _full("qwen3-8b")["06"]
    turns = p["n_questions"] * p["turns"]
    assert turns >= 114 and 1.96 * cv / turns**0.5 <= 0.05
    assert p["n_questions"] <= 80  # MT-bench has 80 questions


def test_the_qwen3_8b_dry_run_with_the_committed_h200_check(tmp_path):
    """The committed H200 check measured the CUDA-graph path (94.9 tok/s): the whole qwen3-8b profile then fits in
    a day; without that rate (eager plain decoding, 14.8 tok/s on the same machine) it does not."""
    full, check = _full("qwen3-8b"), json.loads((RESULTS / "gpu_check_nvidia-h200.json").read_text())
    assert (
        check["stages"]["plain_decoding"]["graphs_tokens_per_s"]
        > 5 * check["stages"]["plain_decoding"]["tokens_per_s"]
    )
    hours = {}
    for path, graphs in ((tmp_path / "measured", True), (tmp_path / "eager", False)):
        path.mkdir()
        if not graphs:
            del check["stages"]["plain_decoding"]["graphs_tokens_per_s"]
        (path / "gpu_check_nvidia-h200.json").write_text(json.dumps(check))
        planned, _ = needs.plan_needs(full, sorted(full), path)
        hours[graphs] = sum(n.hours for n in planned)
    assert hours[True] <= 24 < hours[False]
