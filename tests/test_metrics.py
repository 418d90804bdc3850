"""The acceptance metrics on hand-computed examples, and their consistency with each other; the bootstrap
intervals around them (pooled and paired by turn)."""

import math

import numpy as np
import pytest
import torch

from kvshot_lib.evaluation import (
    AcceptanceRun,
    acceptance_summary,
    bootstrap_acceptance,
    generation_table,
    metrics,
    paired_mat_difference,
)


def test_alpha_is_conditional_and_reach_is_the_running_product():
    # 10 cycles at depth 3: 8 accept step 0; of those, 6 accept step 1; of those, 3 accept step 2.
    attempts, accepts = [10, 8, 6], [8, 6, 3]
    alpha = metrics.alpha_conditional(attempts, accepts)
    assert alpha == pytest.approx([0.8, 0.75, 0.5])
    assert metrics.p_reach(alpha) == pytest.approx([0.8, 0.6, 0.3])  # = accepts[k] / attempts[0] here


def test_mat_counts_the_bonus_token_and_matches_alpha_on_full_depth_chains():
    per_cycle = [0, 0, 1, 1, 2, 2, 2, 3, 3, 3]  # accepted drafts per cycle, depth 3
    attempts = [10, 8, 6]
    accepts = [sum(a > 0 for a in per_cycle), sum(a > 1 for a in per_cycle), sum(a > 2 for a in per_cycle)]
    assert metrics.mean_accepted_tokens(per_cycle) == pytest.approx(1 + 17 / 10)
    alpha = metrics.alpha_conditional(attempts, accepts)
    assert metrics.mat_from_alpha(alpha) == pytest.approx(metrics.mean_accepted_tokens(per_cycle))


def test_reach_stays_right_when_some_cycles_are_shorter():
    # 4 cycles drafted 2 steps, 2 cycles only 1 (capped): step 1 was attempted only where reachable.
    alpha = metrics.alpha_conditional([6, 3], [4, 3])  # 4 of 6 pass step 0; 3 of the 3 offered pass step 1
    assert metrics.p_reach(alpha) == pytest.approx([4 / 6, 4 / 6])


def test_retention_and_missing_steps():
    alpha = [0.8, 0.7, 0.7, 0.6, 0.6, 0.6, 0.4]
    assert metrics.retention(alpha) == pytest.approx(0.5)
    assert math.isnan(metrics.retention(alpha[:3]))
    assert math.isnan(metrics.alpha_conditional([0], [0])[0])
    assert math.isnan(metrics.mean_accepted_tokens([]))


def test_sum_step_counts_adds_ragged_lists_and_rejects_nonsense():
    att, acc = metrics.sum_step_counts([([3, 2], [2, 1]), ([4], [1]), ([2, 1, 1], [1, 1, 0])])
    assert (att, acc) == ([9, 3, 1], [4, 2, 0])
    with pytest.raises(ValueError):
        metrics.sum_step_counts([([1], [2])])


def test_acceptance_by_step_records_and_speedup():
    rows = metrics.acceptance_by_step([10, 8, 6], [8, 6, 3], max_steps=2)
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[1]["p_reach"] == pytest.approx(0.6) and rows[1]["n_attempts"] == 8
    assert metrics.speedup(30.0, 20.0) == pytest.approx(1.5)
    assert metrics.tokens_per_second(10, 2.0) == 5.0


def test_retention_needs_enough_attempts_at_both_steps():
    alpha = [0.5, 0.4, 0.4, 0.3, 0.3, 0.3, 0.2]
    assert metrics.retention(alpha) == pytest.approx(0.2 / 0.5)
    enough = [100, 50, 40, 30, 25, 22, 20]
    assert metrics.retention(alpha, attempts=enough) == pytest.approx(0.4)
    assert math.isnan(metrics.retention(alpha, attempts=[100, 50, 40, 30, 25, 22, 19]))
    assert math.isnan(metrics.retention(alpha, attempts=enough, min_attempts=21))


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
