"""Seen against unseen conversations (``diagnostics/memorization.py``): per-conversation sums that add up to the
held-out evaluation's, a gap worked out by hand, and intervals that cover zero when both sets come from one
distribution and exclude it when they do not."""

import numpy as np
import pandas as pd
import pytest

from kvshot_lib.diagnostics import paired_difference, per_sequence, seen_unseen_gap


def table(hits, ns, ces, k=0):
    return pd.DataFrame(dict(sequence=range(len(hits)), k=k, hits=hits, n=ns, ce_sum=ces))


def test_the_gap_is_seen_minus_unseen_pooled_over_conversations():
    # seen: 3 of 4 and 1 of 2 hit (4/6), cross-entropy 2.0 + 1.0 over 6 branches (0.5);
    # unseen: 1 of 4 and 1 of 2 (2/6), cross-entropy 4.0 + 2.0 over 6 (1.0)
    got = seen_unseen_gap(table([3, 1], [4, 2], [2.0, 1.0]), table([1, 1], [4, 2], [4.0, 2.0]), n_boot=50)
    acc, ce = (got[got["measure"] == m].iloc[0] for m in ("acc", "ce"))
    assert acc["seen"] == pytest.approx(4 / 6) and acc["unseen"] == pytest.approx(2 / 6)
    assert acc["gap"] == pytest.approx(1 / 3) and ce["gap"] == pytest.approx(-0.5)
    assert acc["n_seen"] == 6 and acc["conversations_unseen"] == 2
    assert (got["lo"] <= got["gap"] + 1e-12).all() and (got["gap"] <= got["hi"] + 1e-12).all()


def sample(rng, p, conversations=40, branches=50):
    hits = rng.binomial(branches, p, conversations)
    return table(hits, [branches] * conversations, rng.gamma(2.0, 1.0, conversations) * branches)


def test_intervals_cover_zero_for_one_distribution_and_exclude_it_for_two():
    rng = np.random.default_rng(1)
    covered = 0
    for rep in range(40):
        got = seen_unseen_gap(sample(rng, 0.7), sample(rng, 0.7), n_boot=400, seed=rep)
        covered += int(((got["lo"] <= 0) & (got["hi"] >= 0)).all())
    # two independent 95% intervals per replicate: both cover with P ~ 0.90 (a little less for a percentile
    # bootstrap on 40 conversations), 36 of 40 expected; 30 lies ~2.5 sd below
    assert covered >= 30
    got = seen_unseen_gap(sample(rng, 0.8), sample(rng, 0.7), n_boot=400).set_index("measure")
    assert got.loc["acc", "lo"] > 0.05 and got.loc["acc", "gap"] == pytest.approx(0.1, abs=0.03)


def test_the_paired_difference_is_x_minus_y_on_seen_minus_the_same_on_unseen():
    # seen: x hits 3/4 and 1/2 (4/6), y 2/4 and 1/2 (3/6): +1/6; unseen: both 1/4 and 1/2: 0
    seen_x, seen_y = table([3, 1], [4, 2], [1.0, 1.0]), table([2, 1], [4, 2], [2.0, 1.0])
    unseen = table([1, 1], [4, 2], [3.0, 3.0])
    got = paired_difference(seen_x, seen_y, unseen, unseen, n_boot=50).set_index("measure")
    assert got.loc["acc", "on_seen"] == pytest.approx(1 / 6) and got.loc["acc", "did"] == pytest.approx(1 / 6)
    assert got.loc["ce", "did"] == pytest.approx(-1 / 6) and got.loc["ce", "on_unseen"] == 0
    assert got.loc["ce", "on_unseen_lo"] == got.loc["ce", "on_unseen_hi"] == 0  # the same table twice
    assert (got["on_seen_lo"] <= got["on_seen"] + 1e-12).all() and (
        got["on_seen"] <= got["on_seen_hi"] + 1e-12
    ).all()
    with pytest.raises(ValueError, match="same conversations"):
        paired_difference(seen_x, table([1], [4], [1.0]), unseen, unseen)


def test_pairing_cancels_what_varies_between_conversations():
    """Two equally good drafters on conversations of very different difficulty: the paired interval covers 0 and
    is several times narrower than one drafter's unpaired seen-unseen interval."""
    rng = np.random.default_rng(2)

    def both(conversations=40, branches=200):
        p = rng.uniform(0.3, 0.9, conversations)  # each conversation's difficulty, shared by the two drafters
        return [
            table(rng.binomial(branches, p), [branches] * conversations, [1.0] * conversations) for _ in "xy"
        ]

    (sx, sy), (ux, uy) = both(), both()
    paired = paired_difference(sx, sy, ux, uy, n_boot=1000).set_index("measure").loc["acc"]
    unpaired = seen_unseen_gap(sx, ux, n_boot=1000).set_index("measure").loc["acc"]
    assert paired["lo"] <= 0 <= paired["hi"]
    assert (paired["hi"] - paired["lo"]) * 2 < unpaired["hi"] - unpaired["lo"]


def test_per_conversation_sums_add_up_to_the_held_out_evaluation(tiny_llama, tokenizer, tmp_path):
    from conftest import trained_like

    from kvshot_lib.corpus import extract_features, tokenize_sharegpt
    from kvshot_lib.training import EvalSet, evaluate_per_step

    split = tokenize_sharegpt(tokenizer, "eval", 3, 60, seed=0)
    store = extract_features(tiny_llama, split, out_dir=tmp_path / "f")
    drafter = trained_like(tiny_llama, "hidden")
    evals = EvalSet.build(store, drafter.cfg, tiny_llama, len(split), 2)
    got = per_sequence(drafter, evals, 3, 2)
    want = evaluate_per_step(drafter, evals, 3)
    assert set(got["sequence"]) <= set(range(len(split)))
    for k in range(3):
        at_k = got[got["k"] == k]
        assert at_k["n"].sum() == want[f"n_{k}"]
        assert at_k["hits"].sum() / at_k["n"].sum() == pytest.approx(want[f"acc_{k}"])
        assert at_k["ce_sum"].sum() / at_k["n"].sum() == pytest.approx(want[f"ce_{k}"], rel=1e-5)
