"""The measuring harness around the engine: the exact greedy replay of notebook 03, the speed benchmark of
notebook 06 (incl. Hugging Face's generate as a reference), and ``kvshot generate`` / ``kvshot bench``."""

import json
import math
from dataclasses import replace

import pytest
import torch
from conftest import random_prompts

from kvshot_lib import cli
from kvshot_lib.decoding import DecodeConfig, GenerationResult, autoregressive_generate, speculative_generate
from kvshot_lib.drafters import (
    SelfDrafter,
    build_drafter,
    drafter_config_for,
    drafters_for_run,
    resolve_drafter,
)
from kvshot_lib.evaluation import Reference, acceptance, replay_greedy, runs_table, speedup


def _counts(r):
    return r.token_ids, r.accepted_per_cycle, r.step_attempts, r.step_accepts, r.stop_reason


def test_greedy_replay_reproduces_the_engine_cycle_for_cycle(llama):
    d2t = torch.sort(torch.randperm(49152, generator=torch.Generator().manual_seed(0))[:1024]).values
    drafters = {
        "early-exit-4": resolve_drafter("early-exit-4", llama),
        "ngram": resolve_drafter("ngram", llama),
        "self": SelfDrafter(llama),
        "hidden": build_drafter(
            drafter_config_for(llama, "hidden", draft_vocab_size=1024), llama, d2t, seed=0
        ),
        "kv": build_drafter(drafter_config_for(llama, "kv", draft_vocab_size=1024), llama, d2t, seed=0),
    }
    for prompt in random_prompts(3, seed=4):
        prompt = prompt + prompt[:5]  # something for the n-gram drafter to find
        ref = autoregressive_generate(
            llama, prompt, DecodeConfig(mode="ar", max_new_tokens=16, stop_token_ids=())
        )
        stop = ref.token_ids[11]  # a stop inside the output: the replay must cut where the engine does
        for name, drafter in drafters.items():
            for mode in ("chain", "tree"):
                cfg = DecodeConfig(
                    mode=mode,
                    max_new_tokens=16,
                    chain_depth=5,
                    tree_depth=4,
                    tree_top_k=3,
                    tree_budget=10,
                    stop_token_ids=(stop,),
                )
                engine = speculative_generate(llama, drafter, prompt, cfg)
                replay = replay_greedy(llama, drafter, Reference(0, 0, prompt, ref.token_ids), cfg)
                assert _counts(replay) == _counts(engine), f"{name} {mode}"


def test_drafters_for_run_without_a_run_dir_gives_only_the_named_baselines(llama):
    drafters, note = drafters_for_run(None, llama, ["ngram"])
    assert list(drafters) == ["ngram"] and note == "Baselines: ngram."
    with pytest.raises(ValueError, match="Unknown baseline drafters"):
        drafters_for_run(None, llama, ["ngram", "bogus"])  # still checked without a run


def test_mtbench_runs_and_tables(llama):
    drafters, note = drafters_for_run("/nonexistent-run-dir", llama, ["ngram", "random"])
    assert "No trained drafters" in note and list(drafters) == ["ngram", "random"]
    base = DecodeConfig(max_new_tokens=6, chain_depth=3, tree_depth=3, tree_top_k=2, tree_budget=4)
    refs = acceptance.greedy_references(llama, 2, 6, progress=False)
    assert [(r.question_id, r.turn) for r in refs] == [(81, 0), (81, 1), (82, 0), (82, 1)]
    assert len(refs[1].prompt_ids) > len(refs[0].prompt_ids) + 6, "turn 2 holds turn 1 and its answer"
    runs = acceptance.run_greedy_replay(
        llama, drafters, refs, acceptance.mode_configs(base, ["chain", "tree"]), progress=False
    )
    import dataclasses

    hot = dataclasses.replace(base, temperature=1.0)
    runs += acceptance.run_engine(
        llama, {"random": drafters["random"]}, 1, acceptance.mode_configs(hot, ["chain"]), progress=False
    )
    table = acceptance.acceptance_table(runs)
    assert list(table.columns[:9]) == [
        "drafter",
        "paradigm",
        "regime",
        "mode",
        "temperature",
        "step",
        "alpha_conditional",
        "p_reach",
        "n_attempts",
    ]
    assert set(table["temperature"]) == {0.0, 1.0}
    summary = acceptance.acceptance_summary(runs)
    assert len(summary) == 5 and (summary["n_generations"] == [4, 4, 4, 4, 2]).all()
    # every number recounted from the runs' raw results, cycle by cycle, without the metrics module
    for run, (_, row) in zip(runs, summary.iterrows()):
        attempts, accepts = hand_counts(run.results)
        rows = table[(table["drafter"] == run.drafter) & (table["mode"] == run.mode)]
        rows = rows[rows["temperature"] == run.temperature].sort_values("step")
        assert rows["n_attempts"].tolist() == attempts and rows["n_accepts"].tolist() == accepts
        reach = 1.0
        for k, r in enumerate(rows.itertuples()):
            alpha = accepts[k] / attempts[k] if attempts[k] else float("nan")
            reach *= alpha
            assert r.alpha_conditional == pytest.approx(alpha, nan_ok=True)
            assert r.p_reach == pytest.approx(reach, nan_ok=True)
        cycles = [a for res in run.results for a in res.accepted_per_cycle]
        assert row["mat"] == pytest.approx(sum(a + 1 for a in cycles) / len(cycles))
        alpha_0 = accepts[0] / attempts[0] if attempts and attempts[0] else float("nan")  # no draft at all
        assert row["n_cycles"] == len(cycles) and row["alpha_0"] == pytest.approx(alpha_0, nan_ok=True)


def hand_counts(results) -> tuple[list[int], list[int]]:
    """Attempts and acceptances per draft step, added up by hand over generations of any length."""
    depth = max((len(r.step_attempts) for r in results), default=0)
    attempts, accepts = [0] * depth, [0] * depth
    for r in results:
        for k in range(len(r.step_attempts)):
            attempts[k] += r.step_attempts[k]
            accepts[k] += r.step_accepts[k]
    return attempts, accepts


def result(
    n_tokens: int, accepted_per_cycle: list[int], attempts: list[int], accepts: list[int], seconds=0.0
):
    r = GenerationResult(list(range(n_tokens)), 10, "max_new_tokens", accepted_per_cycle)
    r.step_attempts, r.step_accepts, r.total_s = attempts, accepts, seconds
    return r


def test_acceptance_tables_match_numbers_worked_out_by_hand():
    """Two chain generations of depth 3 and 2. The first has three cycles: 2 accepted (step 2 rejected),
    0 accepted (step 0 rejected), 3 accepted; the second one cycle: 1 accepted (step 1 rejected).
    Step 0: 4 attempts, 3 accepts; step 1: 3, 2; step 2: 2, 1. So alpha = 3/4, 2/3, 1/2; the reach
    probability is 3/4, 1/2, 1/4; MAT = (3 + 1 + 4 + 2) / 4 cycles = 2.5."""
    run = acceptance.AcceptanceRun("d", "kv", "ttt", "chain", 0.0)
    run.results = [result(9, [2, 0, 3], [3, 2, 2], [2, 2, 1]), result(3, [1], [1, 1], [1, 0])]
    table = acceptance.acceptance_table([run])
    assert table["n_attempts"].tolist() == [4, 3, 2] and table["n_accepts"].tolist() == [3, 2, 1]
    assert table["alpha_conditional"].tolist() == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert table["p_reach"].tolist() == pytest.approx([3 / 4, 1 / 2, 1 / 4])
    row = acceptance.acceptance_summary([run]).iloc[0]
    assert row["mat"] == 2.5 and row["alpha_0"] == 0.75 and row["n_cycles"] == 4
    assert row["n_generations"] == 2 and row["n_tokens"] == 12
    assert math.isnan(row["alpha_6"]) and math.isnan(row["retention"])  # no step 6
    # retention = alpha_6 / alpha_0 once both steps have 20 attempts: (10/20) / (30/40) = 2/3
    deep = acceptance.AcceptanceRun("d", "kv", "ttt", "chain", 0.0)
    deep.results = [result(80, [1] * 40, [40, 30, 25, 24, 22, 21, 20], [30, 25, 24, 22, 21, 20, 10])]
    assert acceptance.acceptance_summary([deep]).iloc[0]["retention"] == pytest.approx(2 / 3)
    deep.results[0].step_attempts[6], deep.results[0].step_accepts[6] = 19, 10
    assert math.isnan(acceptance.acceptance_summary([deep]).iloc[0]["retention"])  # 19 attempts: noise


def test_speedup_table_matches_numbers_worked_out_by_hand():
    """Plain decoding: 20 tokens in 2.5 s (8 tokens/s). A chain method: 20 tokens in 1.25 s (16 tokens/s,
    speedup 2.0), cycles accepting 3, 1 and 2 (MAT (4 + 2 + 3) / 3 = 3.0), one of its two outputs equal to
    plain decoding's (exact match 0.5). At temperature 1 the speedup is against that temperature's plain
    decoding (10 tokens in 2 s against 10 in 1 s: 0.5) and exact match is undefined."""
    greedy, hot = DecodeConfig(mode="ar"), DecodeConfig(mode="ar", temperature=1.0)
    ar = speedup.Method("ar", "-", greedy, [result(10, [], [], [], 1.0), result(10, [], [], [], 1.5)])
    chain = speedup.Method(
        "chain",
        "x",
        replace(greedy, mode="chain"),
        [result(10, [3, 1], [], [], 0.5), result(10, [2], [], [], 0.75)],
    )
    chain.results[1].token_ids = [9] * 10  # differs from plain decoding's second output
    ar_hot = speedup.Method("ar", "-", hot, [result(10, [], [], [], 1.0)])
    chain_hot = speedup.Method("chain", "x", replace(hot, mode="chain"), [result(10, [4], [], [], 2.0)])
    table = speedup.speedup_table([ar, chain, ar_hot, chain_hot], machine="hand").set_index(
        ["method", "temperature"]
    )
    assert table.loc[("ar", 0.0), "tokens_per_s"] == 8.0 and table.loc[("chain", 0.0), "tokens_per_s"] == 16.0
    assert table.loc[("chain", 0.0), "speedup_vs_ar"] == 2.0 and table.loc[("chain", 0.0), "mat"] == 3.0
    assert (
        table.loc[("chain", 0.0), "exact_match_vs_ar"] == 0.5
        and table.loc[("ar", 0.0), "exact_match_vs_ar"] == 1
    )
    assert table.loc[("chain", 1.0), "speedup_vs_ar"] == 0.5 and math.isnan(
        table.loc[("chain", 1.0), "exact_match_vs_ar"]
    )
    assert math.isnan(table.loc[("ar", 0.0), "mat"]) and table.loc[("chain", 0.0), "n_tokens"] == 20


def test_speedup_table_summarizes_repetitions_by_hand():
    """Three repetitions, each of one prompt. Plain decoding: 10 tokens in 1, 2 and 1 s; a chain: 10 tokens in
    0.5, 0.5 and 1 s. Per repetition the chain's speedup is 2, 4 and 1: median 2, range 1-4; tokens/s 20, 20, 10:
    median 20, range 10-20. Its cycles (3 per repetition, 1 accepted each) take 0.25 s of drafting, 0.5 of
    verification and 0.05 of commit in all: 27.8, 55.6 and 5.6 ms a cycle over 9 cycles. Plain decoding spends
    4 s on 27 decoded tokens (the first of each prompt comes with its prefill, here 0): 148 ms a token, so 1.5x
    needs MAT 1.5 * 88.9 / 148.1 = 0.9."""
    greedy = DecodeConfig(mode="ar")
    ar = speedup.Method(
        "ar", "-", greedy, [result(10, [], [], [], t) for t in (1.0, 2.0, 1.0)], reps=[0, 1, 2]
    )
    chain = speedup.Method(
        "chain",
        "x",
        replace(greedy, mode="chain"),
        [result(10, [1, 1, 1], [], [], t) for t in (0.5, 0.5, 1.0)],
    )
    chain.reps = [0, 1, 2]
    for r in chain.results:
        r.draft_s, r.verify_s, r.commit_s = 0.25 / 3, 0.5 / 3, 0.05 / 3
    table = speedup.speedup_table([ar, chain], machine="hand").set_index("method")
    row = table.loc["chain"]
    assert (row["speedup_vs_ar"], row["speedup_min"], row["speedup_max"]) == (2.0, 1.0, 4.0)
    assert (row["tokens_per_s"], row["tokens_per_s_min"], row["tokens_per_s_max"]) == (20.0, 10.0, 20.0)
    assert (row["mat"], row["n_reps"], row["n_prompts"], row["n_tokens"]) == (2.0, 3, 1, 30)
    assert row["draft_ms_per_cycle"] == pytest.approx(250 / 9) and row[
        "commit_ms_per_cycle"
    ] == pytest.approx(50 / 9)
    assert row["mat_for_1_5x"] == pytest.approx(1.5 * (0.8 / 9) / (4.0 / 27))
    runs = runs_table([ar, chain])
    assert runs[runs["method"] == "chain"]["speedup_vs_ar"].tolist() == [2.0, 4.0, 1.0]


def test_speed_benchmark_table_and_hf_generate_agree_with_our_greedy_loop(llama):
    drafters = {"ngram": resolve_drafter("ngram", llama), "self": SelfDrafter(llama)}
    plan = speedup.run_mtbench_benchmark(
        llama,
        drafters,
        1,
        turns=2,
        methods=speedup.METHODS,
        temperatures=(0.0, 1.0),
        base=DecodeConfig(max_new_tokens=8),
        progress=False,
    )
    assert all(len(m.results) == 2 for m in plan), "one question, two turns, every method"
    assert not any(m.method == "combined" and m.drafter == "ngram" for m in plan), "lookup joined to itself"
    assert plan[0].results[1].prompt_len > plan[0].results[0].prompt_len + 8, "turn 2 holds the first answer"
    table = speedup.speedup_table(plan, machine="test")
    assert list(table.columns[:7]) == [
        "method",
        "drafter",
        "temperature",
        "tokens_per_s",
        "speedup_vs_ar",
        "mat",
        "exact_match_vs_ar",
    ]
    greedy = table[table["temperature"] == 0]
    assert (greedy["exact_match_vs_ar"] == 1.0).all(), greedy[["method", "drafter", "exact_match_vs_ar"]]
    assert set(greedy["method"]) == set(speedup.METHODS)
    assert table[table["temperature"] == 1]["exact_match_vs_ar"].isna().all()
    assert "hf_prompt_lookup" not in set(table[table["temperature"] == 1]["method"])
    # the table is the plan's raw results, summed by hand (the formulas: test_speedup_table_matches_...)
    assert len(table) == len(plan)
    for m, row in zip(plan, table.itertuples()):
        tokens, seconds = sum(len(r.token_ids) for r in m.results), sum(r.total_s for r in m.results)
        assert (row.method, row.drafter, row.n_tokens) == (m.method, m.drafter, tokens)
        assert row.tokens_per_s == pytest.approx(tokens / seconds)
    # the self drafter accepts every greedy draft: with chain_depth 4, the 8 new tokens of each prompt are
    # 1 (prefill) + 5 + 2, i.e. the cycles [4, 1], so MAT = (5 + 2) / 2 (no stop token in these outputs)
    self_chain = table[
        (table["method"] == "chain") & (table["drafter"] == "self") & (table["temperature"] == 0)
    ]
    assert self_chain[["n_tokens", "mat"]].values.tolist() == [[2 * 8, 3.5]]


def test_kvshot_generate_json_matches_hf_generate(llama, capsys, monkeypatch):
    from kvshot_lib.decoding import cli as gen_cli

    monkeypatch.setattr(gen_cli, "load_cli_target", lambda args: llama)  # the spread test target
    cli.main(
        [
            "generate",
            "--target",
            "tiny-llama",
            "--drafter",
            "self",
            "--mode",
            "tree",
            "--mt-bench",
            "5",
            "--max-new-tokens",
            "10",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"token_ids", "text", "accepted_per_cycle", "tokens_per_s"}
    from kvshot_lib.corpus import chat_prompt_ids, load_mtbench, mtbench_messages

    prompt = chat_prompt_ids(llama.tokenizer, mtbench_messages(load_mtbench(5)[-1]))
    hf = speedup.hf_generate(llama, prompt, DecodeConfig(max_new_tokens=10))
    assert out["token_ids"] == hf.token_ids and len(out["token_ids"]) == 10


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--drafter", "ngram", "--mode", "ar"], "decodes without a drafter"),
        (["--drafter", "none", "--mode", "tree"], "needs a drafter"),
        (["--drafter", "not-a-drafter"], "unknown drafter"),
        (["--drafter", "/"], "not a drafter checkpoint"),
        (["--drafter", "ngram", "--temperature", "-1"], "temperature"),
        (["--drafter", "ngram", "--mt-bench", "0"], "1..80"),
    ],
)
def test_cli_rejects_bad_arguments_before_loading_anything(argv, message, monkeypatch):
    from kvshot_lib.decoding import cli as gen_cli

    monkeypatch.setattr(
        gen_cli, "load_cli_target", lambda args: pytest.fail("loaded a model for bad arguments")
    )
    if "--mt-bench" not in argv:
        argv = [*argv, "--prompt", "hi"]
    with pytest.raises(SystemExit, match=message):
        cli.main(["generate", *argv])
