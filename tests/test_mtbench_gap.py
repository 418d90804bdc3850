"""The MT-bench gap's pieces on hand-made cases (``diagnostics/mtbench_gap.py``): answer positions, where cycles
start, the references as a split, the binned accuracy and the decomposition, whose parts sum to the whole gap."""

import pandas as pd
import pytest
import torch

from kvshot_lib.decoding import GenerationResult
from kvshot_lib.diagnostics import (
    answer_positions,
    binned_accuracy,
    cycle_start_positions,
    gap_table,
    reference_split,
)
from kvshot_lib.evaluation import acceptance


def test_answer_positions_count_within_each_answer():
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    assert answer_positions(mask).tolist() == [-1, -1, 0, 1, 2, -1, 0, 1]


def test_cycles_start_after_the_prefill_token_and_each_accepted_run_plus_its_bonus():
    # 10 tokens: prefill gives token 0; cycle 1 drafts token 1 and accepts 2 (tokens 1, 2, bonus 3);
    # cycle 2 drafts token 4, accepts 0 (bonus 4); cycle 3 drafts token 5, accepts 3 (5, 6, 7, bonus 8);
    # cycle 4 drafts token 9, accepts 0 (bonus 9): 10 tokens
    res = GenerationResult(token_ids=list(range(10)), prompt_len=5, stop_reason="max_new_tokens")
    res.accepted_per_cycle = [2, 0, 3, 0]
    assert cycle_start_positions(res) == [1, 4, 5, 9]


def test_references_become_a_split_cut_at_the_generation_length():
    refs = [
        acceptance.Reference(1, 0, [5, 6, 7], [8, 9, 10, 11]),
        acceptance.Reference(1, 1, [5, 6], [12, 13]),
    ]
    split = reference_split(refs, [2, 2])
    assert [x.tolist() for x in split.ids] == [[5, 6, 7, 8, 9], [5, 6, 12, 13]]
    assert [m.tolist() for m in split.loss_mask] == [[False] * 3 + [True] * 2, [False] * 2 + [True] * 2]
    assert (
        split.source_ids == ["1-0", "1-1"] and split.spec["content"] != reference_split(refs).spec["content"]
    )


def rows(hits, positions, seqs, k=0):
    return pd.DataFrame(dict(sequence=seqs, k=k, answer_pos=positions, hit=hits))


def test_the_gap_splits_into_parts_that_sum_to_it():
    # held-out: sequence 0 has 4 branches (positions 0, 1, 70, 80; hits 1, 1, 0, 0), sequence 1 two (0, 90: 1, 0)
    held = rows([1, 1, 0, 0, 1, 0], [0, 1, 70, 80, 0, 90], [0, 0, 0, 0, 1, 1])
    # MT-bench: turn 0 has 4 branches (positions 1..4, hits 1, 0, 1, 1), cycles start at 1 and 3
    mt = rows([1, 0, 1, 1], [1, 2, 3, 4], [0, 0, 0, 0])
    got = gap_table(held, mt, {0: [1, 3]}, (1, 4), first_tokens=64, n_boot=20).set_index("name")
    # by hand: held-out 3/6 = 0.5; first 64 tokens 3/3 = 1.0; MT-bench 3/4; at cycle starts 2/2; alpha_0 1/4
    want = dict(heldout=0.5, heldout_first=1.0, mtbench_tf=0.75, mtbench_tf_starts=1.0, alpha_0=0.25)
    for name, value in want.items():
        assert got.loc[name, "value"] == pytest.approx(value)
    parts = dict(answer_position=-0.5, prompt_distribution=0.25, cycle_selection=-0.25, cycle_residual=0.75)
    for name, value in parts.items():
        assert got.loc[name, "value"] == pytest.approx(value)
    assert got.loc["total", "value"] == pytest.approx(sum(parts.values())) == pytest.approx(0.25)
    assert got.loc["heldout_first", "n"] == 3 and got.loc["mtbench_tf_starts", "n"] == 2
    assert (got["lo"] <= got["value"] + 1e-12).all() and (got["value"] <= got["hi"] + 1e-12).all()


def test_accuracy_binned_by_answer_position_with_each_bins_share():
    r = rows([1, 0, 1, 1], [3, 20, 40, 100], [0, 0, 0, 0]).assign(set="mtbench", drafter="d")
    got = binned_accuracy(r, "answer_pos").set_index("bin")
    assert list(got.index) == ["[0, 16)", "[16, 32)", "[32, 64)", "[64, 1000000000)"]
    assert list(got["accuracy"]) == [1.0, 0.0, 1.0, 1.0] and list(got["share"]) == [0.25] * 4


def test_outcome_rows_count_what_the_held_out_evaluation_counts(tiny_llama, tokenizer, tmp_path):
    """Per-branch rows on a tiny target: their hits per step average to evaluate_per_step's acc_k, every row is
    an answer token, and p1 is the target's own top-1 probability at the position that predicts it."""
    from conftest import trained_like

    from kvshot_lib.corpus import extract_features, tokenize_sharegpt
    from kvshot_lib.diagnostics import outcome_rows
    from kvshot_lib.training import EvalSet, evaluate_per_step

    split = tokenize_sharegpt(tokenizer, "eval", 3, 60, seed=0)
    store = extract_features(tiny_llama, split, out_dir=tmp_path / "f")
    drafter = trained_like(tiny_llama, "hidden")
    evals = EvalSet.build(store, drafter.cfg, tiny_llama, len(split), 2)
    head = tiny_llama.model.lm_head.weight.detach()
    rows = outcome_rows(drafter, evals, split, head, 3, 2)
    want = evaluate_per_step(drafter, evals, 3)
    for k in range(3):
        at_k = rows[rows["k"] == k]
        assert len(at_k) == want[f"n_{k}"] and at_k["hit"].mean() == pytest.approx(want[f"acc_{k}"])
    assert (rows["answer_pos"] >= 0).all() and rows["p1"].between(0, 1).all()
    r = rows.iloc[len(rows) // 2]
    seq = int(r["sequence"])
    token = [i for i, p in enumerate(answer_positions(split.loss_mask[seq])) if p == r["answer_pos"]]
    with torch.no_grad():
        logits = tiny_llama.model(split.ids[seq][None]).logits[0].float()  # [T, V]
    p1s = [float(torch.softmax(logits[t - 1], -1).max()) for t in token]  # where the row's token may sit
    assert min(abs(p - r["p1"]) for p in p1s) < 1e-3  # features are stored in float16
