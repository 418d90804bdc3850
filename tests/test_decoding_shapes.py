"""Draft shapes chosen by expected speed: the optimum on a synthetic cost model, computed by hand; the early stop
and prompt lookup change which tokens are verified, never which are committed.

The synthetic machine (milliseconds): verifying a block of k tokens costs ``10 + 2k``, chain or tree; a commit
costs nothing; the drafter's first call costs 3 and an ``expand`` of n nodes ``1 + 0.5 n``. Per-step acceptance
(conditional) is 0.9, 0.8, 0.7, 0.5, 0.3, so a chain's node values are .9, .72, .504, .252, .0756, and a chain of
k drafts costs ``3 + 1.5 (k - 1) + 10 + 2 (k + 1) = 13.5 + 3.5 k``:

    k          0      1      2      3      4
    E          1    1.9   2.62  3.124  3.376
    T (ms)    12     17   20.5     24   27.5
    E / T  .0833  .1118  .1278  .1302  .1228      -> k = 3
"""

import pytest
import torch
from conftest import random_prompts

from kvshot_lib.decoding import (
    AcceptanceModel,
    CostModel,
    DecodeConfig,
    DrafterCost,
    DraftTree,
    SpeedModel,
    autoregressive_generate,
    best_chain_length,
    best_size,
    chosen_chain,
    generate,
    select_by_value,
)
from kvshot_lib.drafters import NgramDrafter, SelfDrafter

ALPHAS = (0.9, 0.8, 0.7, 0.5, 0.3)
MS = 1e-3


def synthetic_cost(drafter: str = "d") -> CostModel:
    table = {k: (10 + 2 * k) * MS for k in (1, 2, 4, 8, 16, 32, 64)}
    expand = {n: (1 + 0.5 * n) * MS for n in (1, 2, 4, 8)}
    costs = {drafter: DrafterCost(3 * MS, expand), "ngram": DrafterCost(0.1 * MS, {1: 0.1 * MS})}
    return CostModel("synthetic", "fp32", 256, table, dict(table), 0.0, costs)


class StepAcceptance(AcceptanceModel):
    """Acceptance by draft depth only: ALPHAS[depth], whatever the drafter's confidence."""

    def rate(self, source, depth, q):
        return ALPHAS[min(depth, len(ALPHAS) - 1)]

    def continue_rate(self, source, depth):
        return ALPHAS[min(depth, len(ALPHAS) - 1)]


class CountingSession:
    """A drafter that always proposes token 1 and counts its calls."""

    d2t, hidden_layers = None, ()

    def __init__(self):
        self.starts = self.expands = 0

    def start_cycle(self, committed, view):
        self.starts += 1
        return torch.tensor([0.0, 5.0, 0.0, 0.0])

    def expand(self, tokens, parents):
        self.expands += 1
        return torch.tensor([[0.0, 5.0, 0.0, 0.0]] * len(tokens))

    def end_cycle(self):
        pass


def test_best_chain_length_and_best_size_pick_the_hand_computed_optimum():
    cost = synthetic_cost()
    k, rate = best_chain_length(ALPHAS, cost, "d", max_depth=5)
    assert k == 3 and rate == pytest.approx(3.124 / (24 * MS))
    # the tree-size rule on values sorted best first, 5 ms already spent:
    # n = 0..5: 1/17, 1.5/19, 1.9/21, 2.2/23, 2.3/25, 2.35/27 ms -> n = 3
    n, rate = best_size([0.5, 0.4, 0.3, 0.1, 0.05], 5 * MS, lambda k: cost.verify(k))
    assert n == 3 and rate == pytest.approx(2.2 / (23 * MS))
    assert best_size([], 5 * MS, lambda k: cost.verify(k)) == (0, pytest.approx(1 / (17 * MS)))


def test_chosen_chain_stops_drafting_where_the_next_token_does_not_pay():
    """The early stop drafts 3 tokens (2 expand calls): a 4th would bring .252 expected tokens for 1.5 ms plus
    2 ms of verification, and the best rate with it, 3.376 / 27.5 ms, is below 3.124 / 24 ms. Without the early
    stop the chain is drafted to its cap (4 expand calls, 9 ms) and cut to 4 tokens: with that drafting paid,
    3.376 / 29 ms beats 3.124 / 27 and 3.4516 / 31."""
    speed = SpeedModel(synthetic_cost(), "d", StepAcceptance())
    committed = torch.tensor([[2, 3, 1]])
    session = CountingSession()
    tree, spent = chosen_chain(session, committed, None, 5, speed)
    assert (session.starts, session.expands, len(tree)) == (1, 2, 3)
    assert spent == pytest.approx((3 + 1.5 * 2) * MS)
    assert tree.values == pytest.approx([0.9, 0.72, 0.504])
    assert len(select_by_value(tree, spent, speed, 8)) == 3
    speed.early_stop = False
    session = CountingSession()
    tree, spent = chosen_chain(session, committed, None, 5, speed)
    assert (session.expands, len(tree)) == (4, 5)
    kept = select_by_value(tree, spent, speed, 8)
    assert len(kept) == 4 and kept.parents == [-1, 0, 1, 2]


def test_select_by_value_keeps_ancestors_and_the_budget():
    tree = DraftTree()
    a = tree.add(5, -1, 0, 0.9, "drafter", 0.9)
    tree.add(6, -1, 0, 0.1, "drafter", 0.1)
    b = tree.add(7, a, 1, 0.8, "drafter", 0.72)
    tree.add(8, b, 2, 0.9, "lookup", 0.65)
    speed = SpeedModel(synthetic_cost(), "d")
    kept = select_by_value(tree, 3 * MS, speed, budget=3)
    assert kept.tokens == [5, 7, 8] and kept.parents == [-1, 0, 1] and kept.sources[-1] == "lookup"


def test_acceptance_model_learns_from_verified_nodes():
    acc = AcceptanceModel()
    tree = DraftTree()
    a = tree.add(5, -1, 0, 0.55, "drafter", 0.55)
    tree.add(6, -1, 0, 0.15, "drafter", 0.15)
    tree.add(7, a, 1, 0.55, "drafter", 0.3)
    prior = acc.rate("drafter", 0, 0.55)
    assert prior == pytest.approx(0.55)  # the bin's middle confidence
    for _ in range(20):
        acc.observe(tree, [a])  # node a accepted, its sibling and its child rejected
    assert acc.rate("drafter", 0, 0.55) > 0.9 and acc.rate("drafter", 0, 0.15) < 0.05
    assert acc.rate("drafter", 1, 0.55) < 0.1  # depth 1 is calibrated apart
    assert acc.continue_rate("drafter", 0) > 0.9 and acc.continue_rate("drafter", 1) < 0.1


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_early_stop_and_lookup_never_change_the_greedy_output(llama, mode):
    """Greedy decoding with shapes chosen by expected speed, early stop on and off, with and without prompt
    lookup in the proposal, reproduces plain decoding token for token (the noisy self drafter is right about
    half the time). Lookup that really proposes is tested on a small vocabulary in test_decoding_sampling.py."""
    drafter = SelfDrafter(llama, noise=1.0)
    cost = synthetic_cost("self")
    caps = dict(
        chain_depth=6, tree_depth=5, tree_top_k=3, tree_budget=16, max_new_tokens=24, stop_token_ids=()
    )
    accepted = 0
    for prompt in random_prompts(3, seed=11):
        ref = autoregressive_generate(llama, prompt, DecodeConfig(mode="ar", **caps)).token_ids
        for early_stop in (True, False):
            for lookup in (False, True):
                speed = SpeedModel(cost, "self", early_stop=early_stop)
                cfg = DecodeConfig(mode=mode, shape="chosen", lookup=lookup, speed=speed, **caps)
                out = generate(llama, prompt, cfg, drafter)
                assert out.token_ids == ref, (early_stop, lookup)
                accepted += sum(out.accepted_per_cycle)
    assert accepted > 0, "no draft was ever accepted"


def test_fixed_shapes_with_lookup_reproduce_plain_decoding(llama):
    ngram = NgramDrafter(llama.info.vocab_size)
    prompt = random_prompts(1, seed=5)[0]
    prompt = prompt + prompt[:30]
    cfg = dict(max_new_tokens=20, stop_token_ids=(), tree_top_k=2, tree_budget=6)
    ref = autoregressive_generate(llama, prompt, DecodeConfig(mode="ar", **cfg)).token_ids
    for mode in ("chain", "tree"):
        out = generate(
            llama, prompt, DecodeConfig(mode=mode, lookup=True, **cfg), SelfDrafter(llama, noise=2.0)
        )
        assert out.token_ids == ref
    assert generate(llama, prompt, DecodeConfig(mode="chain", **cfg), ngram).token_ids == ref


def test_a_chosen_shape_without_a_speed_model_is_refused():
    with pytest.raises(ValueError, match="needs speed=SpeedModel"):
        DecodeConfig(mode="tree", shape="chosen").validate()
    with pytest.raises(ValueError, match="shape must be one of"):
        DecodeConfig(shape="fast").validate()


def test_a_declining_drafter_drafts_nothing_in_a_chosen_tree(llama):
    """Prompt lookup without a match returns all -inf logits: a chosen tree then holds no node (not NaN values)."""
    ngram = NgramDrafter(llama.info.vocab_size)
    speed = SpeedModel(synthetic_cost("ngram"), "ngram")
    cfg = DecodeConfig(mode="tree", shape="chosen", speed=speed, max_new_tokens=6, stop_token_ids=())
    out = generate(llama, list(range(100, 130)), cfg, ngram)  # no bigram repeats
    ref = autoregressive_generate(
        llama, list(range(100, 130)), DecodeConfig(mode="ar", max_new_tokens=6, stop_token_ids=())
    )
    assert out.token_ids == ref.token_ids and out.drafted_per_cycle[0] == 0  # 129 is never followed earlier
    assert all(v == v for v in speed.acceptance.seen.values())
