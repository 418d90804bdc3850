"""Speculative decoding at replayed acceptance (``decoding/replay.py``): the profile, the draws, and an output that is
its reference's whatever the drafter drafts."""

from __future__ import annotations

import csv
from dataclasses import replace

import pytest
import torch
from conftest import random_prompts
from test_device_draft import make_drafter

from kvshot_lib.decoding import (
    DecodeConfig,
    DraftTree,
    ReplayedAcceptance,
    autoregressive_generate,
    mat_of,
    profile_for_mat,
    speculative_generate,
)
from kvshot_lib.target import REPO_ROOT


def paper_rows() -> dict[str, tuple[float, ...]]:
    with open(REPO_ROOT / "figures/onpolicy/data/paper_table5.csv") as f:
        return {r["paper_row"]: (tuple(float(r[f"alpha_{k}"]) for k in range(7)), float(r["mat"])) for r in csv.DictReader(f)}  # fmt: skip


def test_the_mat_of_each_paper_row_is_its_published_mat():
    """MAT = 1 + sum_k prod_{j<=k} alpha_j over the 7 published steps gives Table 5's MAT column (published to 2
    decimals from alphas published to 3: within 0.01)."""
    for name, (alphas, mat) in paper_rows().items():
        assert abs(mat_of(alphas, 7) - mat) < 0.01, name


def test_a_profile_stretched_to_a_tree_mat_keeps_its_shape():
    alphas = paper_rows()["EAGLE-3, 1 layer (hidden-only)"][0]
    got = profile_for_mat(alphas, 5.01, 8)  # Table 4's hidden tree, depth 8
    assert abs(mat_of(got, 8) - 5.01) < 1e-9 and all(0 < a <= 1 for a in got)
    below = [(g, a) for g, a in zip(got, alphas) if g < 1]
    assert len({round(g / a, 9) for g, a in below}) == 1  # one factor for every uncapped step
    with pytest.raises(ValueError, match="out of reach"):
        profile_for_mat(alphas, 9.5, 8)


def test_drawn_lengths_average_the_profile():
    alphas = (0.7, 0.6, 0.5)
    r = ReplayedAcceptance([0] * 10, alphas, seed=1)
    draws = [r.draw(4) for _ in range(40_000)]
    expected = mat_of(alphas, 4) - 1
    var = sum((d - expected) ** 2 for d in draws) / len(draws)
    assert abs(sum(draws) / len(draws) - expected) < 4 * (var / len(draws)) ** 0.5
    assert max(draws) == 4 and min(draws) == 0


def test_a_tree_path_carries_the_reference():
    tree = DraftTree([5, 6, 7, 8], [-1, -1, 0, 2], [0, 0, 1, 2])
    path, bonus = ReplayedAcceptance([1, 2, 3, 4, 5, 6], (1.0,)).choose(tree, 1)
    assert path == [0, 2, 3] and [tree.tokens[i] for i in path] == [2, 3, 4] and bonus == 5
    path, bonus = ReplayedAcceptance([1, 2, 3, 4, 5, 6], (0.0,)).choose(tree, 1)
    assert path == [] and bonus == 2


@pytest.mark.parametrize("name", ["hidden", "kv", "block-kv"])
@pytest.mark.parametrize("loop", ["host", "device"])
def test_replayed_generation_commits_plain_decoding(llama, name, loop):
    """Whatever the drafter drafts, the output is plain decoding's; at alpha = 1 every cycle accepts its whole
    depth, at alpha = 0 none."""
    d = make_drafter(llama, name)
    prompt = random_prompts(1, 21)[0]
    base = DecodeConfig(
        max_new_tokens=20,
        stop_token_ids=(),
        chain_depth=3,
        tree_depth=3,
        tree_top_k=2,
        tree_budget=10,
        draft_loop=loop,
    )
    plain = autoregressive_generate(llama, prompt, replace(base, mode="ar")).token_ids
    for mode in ("chain", "tree"):
        cfg = replace(base, mode=mode)
        for alpha, accepted in ((1.0, 3), (0.0, 0)):
            r = speculative_generate(llama, d, prompt, cfg, replay=ReplayedAcceptance(plain, (alpha,)))
            assert r.token_ids == plain, (mode, alpha)
            assert set(r.accepted_per_cycle[:-1]) == {accepted}, (
                mode,
                alpha,
            )  # the last cycle may be cut short
        r = speculative_generate(llama, d, prompt, cfg, replay=ReplayedAcceptance(plain, (0.6, 0.5)))
        assert r.token_ids == plain and torch.tensor(r.accepted_per_cycle).le(3).all()
