"""The measuring harness around the engine: the exact greedy replay of notebook 03, the speed benchmark of
notebook 06 (incl. Hugging Face's generate as a reference), and ``kvshot generate`` / ``kvshot bench``."""

import json

import pytest
import torch
from conftest import random_prompts

from kvshot_lib import cli
from kvshot_lib.decoding import DecodeConfig, autoregressive_generate, speculative_generate
from kvshot_lib.drafters import (
    SelfDrafter,
    build_drafter,
    drafter_config_for,
    drafters_for_run,
    resolve_drafter,
)
from kvshot_lib.evaluation import Reference, acceptance, replay_greedy, speedup


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
    assert (table["p_reach"] <= table["alpha_conditional"] + 1e-12).all()
    summary = acceptance.acceptance_summary(runs)
    assert len(summary) == 5 and (summary["mat"] >= 1).all()
    assert (summary["n_generations"] == [4, 4, 4, 4, 2]).all()


def test_speed_benchmark_table_and_hf_generate_agree_with_our_greedy_loop(llama):
    drafters = {"ngram": resolve_drafter("ngram", llama), "self": SelfDrafter(llama)}
    plan = speedup.run_mtbench_benchmark(
        llama,
        drafters,
        1,
        turns=2,
        temperatures=(0.0, 1.0),
        base=DecodeConfig(max_new_tokens=8),
        progress=False,
    )
    assert all(len(m.results) == 2 for m in plan), "one question, two turns, every method"
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
    assert (table[table["method"] == "ar"]["speedup_vs_ar"] == 1.0).all()


def test_kvshot_generate_json_matches_hf_generate(llama, capsys, monkeypatch):
    import kvshot_lib.decoding.cli as gen_cli

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
    import kvshot_lib.decoding.cli as gen_cli

    monkeypatch.setattr(
        gen_cli, "load_cli_target", lambda args: pytest.fail("loaded a model for bad arguments")
    )
    if "--mt-bench" not in argv:
        argv = [*argv, "--prompt", "hi"]
    with pytest.raises(SystemExit, match=message):
        cli.main(["generate", *argv])
