"""SpecPV's cost model and fidelity helpers against values worked out by hand (``evaluation/specpv_cost.py``,
``evaluation/specpv_fidelity.py``).

The hand-worked case: a forward of ``n`` rows on ``L`` cached tokens costs ``t(L, n) = 1 + 0.01 L`` (rows
free), drafting is free, 3 draft nodes per cycle, MAT 2 in full and in partial cycles, budget 100, a full
pass every P = 4 pending tokens.

* lossless: ``(0 + t(L, 4)) / 2 = (1 + 0.01 L) / 2``;
* SpecPV: ``k = ceil(4 / 2) = 2`` partial cycles on ``B' = 100 + 8 + 2 * 2 / 2 = 110`` tokens, each
  ``t(110, 4) = 2.1``; then one full pass ``t(L, 4 + 3 + 1) = 1 + 0.01 L`` and a rebuild ``r(L)``; over
  ``k m_p + m_f = 6`` tokens: ``(4.2 + 1 + 0.01 L + r(L)) / 6``;
* with ``r = 0``, SpecPV wins when ``5.2 + 0.01 L < 3 + 0.03 L``, i.e. ``L > 110``: the crossover is 111
  (at 110 the two are equal, which is not a win); with ``r(L) = 0.001 L``, when ``L > 2.2 / 0.019 = 115.8``:
  116.
"""

import math

import numpy as np
import pandas as pd
import pytest

from kvshot_lib.evaluation import specpv_cost, specpv_fidelity

ARGS = dict(budget=100, full_every=4, draft_s=0.0, drafted=3, mat_full=2.0, mat_partial=2.0)


def forward(L, n):
    return 1 + 0.01 * L


def no_refresh(L):
    return 0.0


@pytest.mark.parametrize("L", [200, 1000, 4096])
def test_per_token_seconds_by_hand(L):
    lossless, specpv = specpv_cost.per_token_seconds(L, forward, no_refresh, **ARGS)
    assert lossless == pytest.approx((1 + 0.01 * L) / 2)
    assert specpv == pytest.approx((2 * 2.1 + 1 + 0.01 * L) / 6)
    _, with_rebuild = specpv_cost.per_token_seconds(L, forward, lambda x: 0.5, **ARGS)
    assert with_rebuild == pytest.approx(specpv + 0.5 / 6)


def test_per_token_seconds_within_the_budget_or_every_cycle_full():
    """A context that fits the budget, or a full pass every cycle (P = 0), is lossless decoding."""
    a, b = specpv_cost.per_token_seconds(100, forward, no_refresh, **ARGS)
    assert a == b == pytest.approx(2 / 2)
    a, b = specpv_cost.per_token_seconds(5000, forward, no_refresh, **{**ARGS, "full_every": 0})
    assert a == b == pytest.approx(51 / 2)


def test_rows_and_partial_mat_enter_where_the_model_says():
    """``t(L, n) = n``: the lossless cycle verifies N + 1 = 4 rows; with MAT 3 in partial cycles,
    k = ceil(4 / 3) = 2 cycles of 4 rows, then a full pass of k m_p + N + 1 = 6 + 4 = 10 rows, over
    k m_p + m_f = 6 + 2 = 8 tokens: (8 + 10) / 8."""
    rows = lambda L, n: float(n)  # noqa: E731
    args = {**ARGS, "mat_partial": 3.0}
    lossless, specpv = specpv_cost.per_token_seconds(1000, rows, no_refresh, **args)
    assert lossless == pytest.approx(4 / 2) and specpv == pytest.approx(18 / 8)


def test_crossover_by_hand():
    assert specpv_cost.crossover(forward, no_refresh, **ARGS) == 111
    assert specpv_cost.crossover(forward, lambda L: 0.001 * L, **ARGS) == 116
    flat = lambda L, n: 1.0  # noqa: E731  (no cost grows with the context: SpecPV never wins)
    assert math.isnan(specpv_cost.crossover(flat, no_refresh, **ARGS))


def test_fit_costs_recovers_the_coefficients():
    """Timings made from known non-negative coefficients are fitted back exactly."""
    c = dict(c0=2e-3, c1=5e-5, c2=3e-7, c3=4e-8, r0=1e-4, r1=2e-6)
    rows = []
    for L in (64, 128, 256, 512, 1024):
        for n in (1, 4, 16, 32):
            seconds = c["c0"] + c["c1"] * n + c["c2"] * L + c["c3"] * L * n
            rows.append(dict(length=L, rows=n, seconds=seconds, what="forward"))
        rows.append(dict(length=L, rows=0, seconds=c["r0"] + c["r1"] * L, what="refresh"))
    fit = specpv_cost.fit_costs(pd.DataFrame(rows))
    assert fit == pytest.approx(c, rel=1e-6)
    assert specpv_cost.cpu_forward(fit)(300, 8) == pytest.approx(2e-3 + 8 * 5e-5 + 300 * 3e-7 + 2400 * 4e-8)
    assert specpv_cost.cpu_refresh(fit)(300) == pytest.approx(1e-4 + 300 * 2e-6)


def test_gpu_forward_by_hand():
    """One token on an empty cache is the weights' read: 8.19e9 params x 2 bytes / (0.8 x 3.35e12 B/s)."""
    weights = 8.19e9 * 2 / (0.8 * 3.35e12)
    assert specpv_cost.gpu_forward(overhead=False)(0, 1) == pytest.approx(weights)
    assert specpv_cost.gpu_forward()(0, 1) == pytest.approx(weights + 36 * 0.73e-3)
    kv = 1000 * 36 * 2 * 8 * 128 * 2 / (0.8 * 3.35e12)
    attention = 4 * 1000 * 32 * 128 * 36 / (0.5 * 989e12)
    assert specpv_cost.gpu_forward(overhead=False)(1000, 1) == pytest.approx(weights + kv + attention)


@pytest.mark.parametrize(
    "tokens, reference, index",
    [
        ([1, 2, 3], [1, 2, 3], 3),  # equal: the length
        ([1, 2, 3], [1, 9, 3], 1),  # the first difference
        ([7, 2], [1, 2], 0),
        ([1, 2], [1, 2, 3], 2),  # a prefix: the shorter length
        ([1, 2, 3, 4], [1, 2], 2),
        ([], [5], 0),
    ],
)
def test_first_divergence_by_hand(tokens, reference, index):
    assert specpv_fidelity.first_divergence(tokens, reference) == index


def test_crossover_tables_agree_with_the_model():
    """cost_model_table's CPU rows are the model's crossover and curves for the speed table's MATs, pooled:
    here 2 lossless rows with 3 + 5 accepted drafts over 2 + 2 cycles (MAT (8 + 4) / 4 = 3), 12 drafted
    nodes (3 per cycle), 0.4 s of drafting (0.1 per cycle), and a SpecPV row with 6 accepted over 3 partial
    cycles (MAT 3)."""
    speed = pd.DataFrame(
        [
            dict(method="lossless", cycles_full=2, accepted_full=3, draft_s=0.2, drafted=6),
            dict(method="lossless", cycles_full=2, accepted_full=5, draft_s=0.2, drafted=6),
            dict(method="specpv", budget=100, full_every=4, accepted_partial=6, cycles_partial=3),
        ]
    )
    fit = dict(c0=1.0, c1=0.0, c2=0.01, c3=0.0, r0=0.0, r1=0.0)
    rows, curves = specpv_cost.cost_model_table(speed, fit, [200, 400])
    cpu = rows[rows["machine"] == "this CPU (fitted)"].iloc[0]
    assert (cpu["mat_full"], cpu["mat_partial"], cpu["drafted"], cpu["draft_s"]) == pytest.approx(
        (3, 3, 3, 0.1)
    )
    args = dict(budget=100, full_every=4, draft_s=0.1, drafted=3, mat_full=3.0, mat_partial=3.0)
    assert cpu["crossover_tokens"] == specpv_cost.crossover(forward, no_refresh, **args)
    # by hand: lossless (0.1 + 1 + 0.01 L) / 3; SpecPV k = ceil(4 / 3) = 2 cycles of 0.1 + t(100 + 8 + 6 / 2, 4)
    # = 2.21, then 0.1 + 1 + 0.01 L, over 2 * 3 + 3 = 9 tokens: (5.52 + 0.01 L) / 9; it wins when
    # 5.52 + 0.01 L < 3.3 + 0.03 L, i.e. L > 111
    assert cpu["crossover_tokens"] == 112
    c = curves[(curves["machine"] == "this CPU (fitted)") & (curves["length"] == 400)].iloc[0]
    assert c["lossless_ms"] == pytest.approx(1000 * 5.1 / 3)
    assert c["specpv_ms"] == pytest.approx(1000 * 9.52 / 9)
    assert np.isclose(c["ratio"], (5.1 / 3) / (9.52 / 9))
