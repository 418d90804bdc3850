"""The acceptance metrics on hand-computed examples, and their consistency with each other."""

import math

import pytest

from kvshot_lib.evaluation import metrics


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
