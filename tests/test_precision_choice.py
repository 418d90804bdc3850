"""Precision by measurement (``target/precision.py``, ``decoding/cost_model.py``): ``auto`` decodes in the precision
whose cached plain decoding step is faster and trains in the one the cached training probe finds faster; a device
without native bf16 gets fp32 without any timing; the choice is printed once per process and recorded beside the
precision in the speed tables and the training record, with greedy exactness beside every bf16 speed.

Nothing here times a real workload for a choice: the cached timings are written first (``inject_*``), and the
functions that would time are replaced by ones that fail the test if called.
"""

import json
import math

import pytest
import torch
from conftest import random_prompts

from kvshot_lib.corpus import extract_features, tokenize_sharegpt
from kvshot_lib.decoding import DecodeConfig
from kvshot_lib.decoding import cost_model as cm
from kvshot_lib.evaluation import precision_setups, run_benchmark, runs_table, speed_table, speedup_table
from kvshot_lib.target import cache_dir, cast_target, machine_record, precision_label, resolve_precision
from kvshot_lib.target import precision as precision_module
from kvshot_lib.training import TrainConfig, train_drafter

FASTER = (0.100, 0.060)  # (fp32, bf16) seconds: bf16 1.67x as fast
SLOWER = (0.0385, 0.0394)  # the Intel Xeon's plain decoding, 26.0 vs 25.4 tok/s
NEAR_TIE = (0.100, 0.098)  # bf16 2% faster: inside BF16_MIN_GAIN, fp32 (exact) kept


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    """An empty cache and no choice made yet in this process; nothing may be timed for real."""
    monkeypatch.setenv("KVSHOT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(precision_module, "_CHOSEN", {})

    def refuse(*args, **kwargs):
        raise AssertionError("timed a real workload instead of reading the cached timings")

    monkeypatch.setattr(precision_module, "time_train_probe", refuse)
    monkeypatch.setattr(cm, "measure_verification", refuse)


@pytest.fixture
def no_bf16_cpu(monkeypatch):
    monkeypatch.setattr(precision_module, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma"}))


@pytest.fixture
def avx512_bf16_cpu(monkeypatch):
    """The Intel Xeon and AMD EPYC of the issue: AVX512-BF16, no AMX."""
    monkeypatch.setattr(precision_module, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))


def inject_probe(fp32_s: float, bf16_s: float, device="cpu") -> None:
    """Write the training probe's cached timings for this machine."""
    path = cache_dir() / "precision_probes.json"  # where the module docstring says it lives
    keys = {precision_module.train_probe_key(p, device): s for p, s in (("fp32", fp32_s), ("bf16", bf16_s))}
    path.write_text(json.dumps(keys))


def inject_cost_models(target, fp32_s: float, bf16_s: float) -> None:
    """Write a cached cost model of ``target`` in fp32 and in bf16 whose one-token forward takes the given
    seconds (bigger blocks cost more, as measured ones do)."""
    table = {}
    for dtype, step in ((torch.float32, fp32_s), (torch.bfloat16, bf16_s)):
        t = cast_target(target, dtype)
        key = cm.cost_key(t)
        chain = {k: step * (1 + 0.1 * (k - 1)) for k in cm.BLOCK_SIZES}
        table[key] = cm.CostModel(key, precision_label(dtype), 256, chain, chain, 1e-4).as_dict()
    (cache_dir() / "cost_models.json").write_text(json.dumps(table))


# ------------------------------------------------------------------------------------------------ training


@pytest.mark.parametrize(
    "timings, expected", [(FASTER, "bf16"), (SLOWER, "no"), (NEAR_TIE, "no")], ids=["faster", "slower", "tie"]
)
def test_training_auto_trains_in_the_precision_the_probe_measures_faster(avx512_bf16_cpu, timings, expected):
    inject_probe(*timings)
    assert resolve_precision("auto", "cpu") == expected
    assert resolve_precision("no", "cpu") == "no" and resolve_precision("bf16", "cpu") == "bf16"  # as asked
    record = machine_record(expected, "cpu", "auto")
    assert record["precision"] == {"no": "fp32"}.get(expected, expected)
    assert record["auto_precision"] == record["precision"]
    assert record["train_probe_ms_fp32"] == pytest.approx(1e3 * timings[0])
    assert record["train_probe_ms_bf16"] == pytest.approx(1e3 * timings[1])
    assert "auto_precision" not in machine_record("no", "cpu", "no"), "an explicit precision chose nothing"


def test_training_records_the_choice_and_both_timings(avx512_bf16_cpu, tiny_llama, tokenizer, tmp_path):
    """A drafter trained with ``mixed_precision: auto`` records, beside its precision, what auto measured."""
    inject_probe(*SLOWER)
    split = tokenize_sharegpt(tokenizer, "train", 2, 32, seed=0)
    train = extract_features(tiny_llama, split, out_dir=tmp_path / "t", precision="no")
    held = extract_features(tiny_llama, split, out_dir=tmp_path / "e", precision="no")
    settings = dict(
        paradigm="kv", regime="ttt", ttt_steps=2, train_steps=2, warmup_steps=1, draft_vocab_size=64
    )
    cfg = TrainConfig(**settings, eval_every=0, probe_every=0, save_every=0)  # mixed_precision: auto
    result = train_drafter(tiny_llama, train, held, cfg, tmp_path / "run", progress=False)
    machine = result.drafter.cfg.extra["machine"]
    assert machine["precision"] == "fp32" and machine["auto_precision"] == "fp32"
    assert (machine["train_probe_ms_fp32"], machine["train_probe_ms_bf16"]) == pytest.approx((38.5, 39.4))


# ------------------------------------------------------------------------------------------------ decoding


@pytest.mark.parametrize(
    "timings, expected",
    [(FASTER, torch.bfloat16), (SLOWER, torch.float32), (NEAR_TIE, torch.float32)],
    ids=["faster", "slower", "tie"],
)
def test_decoding_auto_decodes_in_the_precision_the_cost_model_measures_faster(
    avx512_bf16_cpu, tiny_llama, timings, expected
):
    inject_cost_models(tiny_llama, *timings)
    assert cm.decode_precision(tiny_llama, "auto") == expected
    choice = cm.decode_choice_for(tiny_llama)
    assert (choice.fp32_s, choice.bf16_s) == timings, "verify_chain[1] of each precision's cost model"
    assert cm.decode_precision(tiny_llama, "fp32") == torch.float32  # as asked, whatever auto measured
    assert cm.decode_precision(tiny_llama, "bf16") == torch.bfloat16


def test_a_plain_step_without_a_cost_model_is_measured_alone_once(avx512_bf16_cpu, tiny_llama, monkeypatch):
    """Where no cost model is cached, only the one-token forward is timed (k = 1), and then read back."""
    calls = []

    def measure(target, context, sizes, reps, kernel):
        calls.append((precision_label(next(target.model.parameters()).dtype), sizes))
        return {1: 0.02 if calls[-1][0] == "bf16" else 0.03}, {1: 0.0}, 0.0

    monkeypatch.setattr(cm, "measure_verification", measure)
    assert cm.decode_precision(tiny_llama, "auto") == torch.bfloat16
    assert calls == [("fp32", (1,)), ("bf16", (1,))]
    monkeypatch.setattr(precision_module, "_CHOSEN", {})  # a new process: read back from the disk cache
    assert cm.decode_choice_for(tiny_llama).bf16_s == 0.02 and len(calls) == 2


def test_the_speed_tables_record_the_choice_and_exactness_beside_bf16(avx512_bf16_cpu, tiny_llama):
    """``precisions=("fp32", "auto")``: auto adds a bf16 setup only where bf16 measured faster; every row carries
    the choice and both plain-step timings, and every greedy bf16 row its share of outputs equal to bf16 plain
    decoding."""
    prompts = random_prompts(2, seed=3)
    base = DecodeConfig(max_new_tokens=6, chain_depth=2, stop_token_ids=())
    for timings, labels in ((FASTER, ["fp32", "bf16"]), (SLOWER, ["fp32"])):
        inject_cost_models(tiny_llama, *timings)
        precision_module._CHOSEN.clear()
        setups = precision_setups(tiny_llama, {}, ("fp32", "auto"))
        assert [s.precision for s in setups] == labels
        plan = run_benchmark(
            tiny_llama, {}, prompts, methods=("ar", "hf_generate"), base=base, setups=setups, progress=False
        )
        for table in (runs_table(plan), speedup_table(plan, machine="test")):
            assert set(table["precision"]) == set(labels)
            assert (table["auto_precision"] == labels[-1]).all()
            for column, seconds in zip(("plain_step_ms_fp32", "plain_step_ms_bf16"), timings):
                assert table[column].tolist() == pytest.approx([1e3 * seconds] * len(table)), column
            greedy = table[table["precision"] == labels[-1]]
            assert greedy["exact_match_vs_ar"].between(0, 1).all()  # a share, beside every speed
            assert (greedy.loc[greedy["method"] == "ar", "exact_match_vs_ar"] == 1).all()
    plain = run_benchmark(tiny_llama, {}, prompts, methods=("ar",), base=base, progress=False)
    table = speedup_table(plain, machine="test")  # auto not asked for: empty choice columns, in their place
    assert (table["auto_precision"] == "").all() and table["plain_step_ms_fp32"].isna().all()
    assert (
        list(table.columns[table.columns.get_loc("precision") + 1 :][: len(speed_table.AUTO_COLUMNS)])
        == speed_table.AUTO_COLUMNS
    )


# ---------------------------------------------------------------------------------- no bf16, and printing


def test_without_native_bf16_auto_is_fp32_without_measuring(no_bf16_cpu, tiny_llama, capsys):
    inject_probe(*FASTER)  # even a (stale) faster bf16 on disk is not read: the flags rule bf16 out
    inject_cost_models(tiny_llama, *FASTER)
    assert resolve_precision("auto", "cpu") == "no"
    assert cm.decode_precision(tiny_llama, "auto") == torch.float32
    assert precision_module.decode_dtype("auto") == torch.float32
    record = machine_record("no", "cpu", "auto")
    assert record["auto_precision"] == "fp32" and math.isnan(record["train_probe_ms_bf16"])
    err = capsys.readouterr().err
    assert err.count("has no native bf16: nothing timed") == 2, err  # training, decoding


def test_auto_without_a_target_to_time_decodes_in_fp32(avx512_bf16_cpu, capsys):
    """``decode_dtype("auto")`` has no target to time: fp32, the exact reference, and it says so."""
    assert precision_module.decode_dtype("auto") == torch.float32
    assert "nothing timed here, so fp32, the exact reference" in capsys.readouterr().err


def test_the_choice_and_both_timings_are_printed_once_per_process(avx512_bf16_cpu, tiny_llama, capsys):
    inject_probe(*FASTER)
    inject_cost_models(tiny_llama, *SLOWER)
    for _ in range(3):
        assert resolve_precision("auto", "cpu") == "bf16"
        machine_record("bf16", "cpu", "auto")
        assert cm.decode_precision(tiny_llama, "auto") == torch.float32
    precision_setups(tiny_llama, {}, ("fp32", "auto"))
    lines = capsys.readouterr().err.splitlines()
    train = [x for x in lines if "precision auto for training" in x]
    decode = [x for x in lines if "precision auto for decoding" in x]
    assert len(train) == 1 and len(decode) == 1, lines
    assert train[0].startswith("kvshot: precision auto for training: bf16")
    assert "fp32 100.00 ms, bf16 60.00 ms" in train[0]
    assert decode[0].startswith("kvshot: precision auto for decoding: fp32")
    assert "fp32 38.50 ms, bf16 39.40 ms" in decode[0]
