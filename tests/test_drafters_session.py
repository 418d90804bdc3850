"""Decode sessions compute exactly what training computed, across cycles and trees (tiny models)."""

import pytest
import torch

from kvshot_lib.drafters import (
    DraftSession,
    TargetView,
    TrainedDraftSession,
    build_drafter,
    drafter_config_for,
)
from kvshot_lib.training import batch_from_target

# (paradigm, kv_mode, n_layers, extra config): the last KV variants bias their target-KV scores by distance
# and give the target's KV a softmax of its own
VARIANTS = [
    ("hidden", "concat", 2, {}),
    ("kv", "concat", 1, {}),
    ("kv", "linear_rope", 2, {}),
    ("hybrid", "linear", 2, {}),
    ("kv", "concat", 2, {"kv_recency": 3}),
    ("kv", "linear", 2, {"kv_recency": 3, "kv_softmax": "separate"}),
    ("hidden", "concat", 2, {"fc_norm": True, "norm_output": True}),  # EAGLE 3.1
    ("hybrid", "linear", 1, {"fc_norm": True, "norm_output": True}),
]
ATOL = 2e-5


def drafter(target, paradigm, mode, n_layers, extra=None):
    cfg = drafter_config_for(
        target, paradigm, n_layers=n_layers, kv_mode=mode, draft_vocab_size=512, **(extra or {})
    )
    d = build_drafter(cfg, target, torch.arange(512) * 3, seed=0)
    with torch.no_grad():  # leave the identity/zero initializations so that every path matters
        for p in d.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return d.eval()


@torch.no_grad()
def view(target, ids, since=0):
    """The engine's view before drafting after ``ids``: cache of positions 0..P-1, hidden states since ``since``."""
    P = len(ids) - 1
    out = target.model(input_ids=ids[None, :P], use_cache=True, output_hidden_states=True)
    return TargetView(
        cache=out.past_key_values, hidden={i: out.hidden_states[i + 1][:, since:P] for i in range(8)}
    )


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 3000, (16,), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("paradigm,mode,n_layers,extra", VARIANTS)
def test_session_matches_training_unroll(tiny_target, ids, paradigm, mode, n_layers, extra):
    """On both target families (Llama, Qwen3): decode-time logits equal the training unroll's, step by step."""
    d = drafter(tiny_target, paradigm, mode, n_layers, extra)
    K, T = 4, len(ids)
    with torch.no_grad():
        un = d(batch_from_target(tiny_target, ids, torch.ones(T, dtype=torch.bool), d.cfg), K)
        train_logits = [d.logits(h)[0] for h in un.outs]  # each [N, V_draft]
    for i in (0, 3, 9):  # branch i: root x_{i+1}; then the chain x_{i+2}, x_{i+3}, ...
        s = d.new_session()
        assert isinstance(s, DraftSession) and s.d2t is d.d2t
        assert s.hidden_layers == (d.cfg.hidden_layers if paradigm != "kv" else ())
        got = [s.start_cycle(ids[None, : i + 2], view(tiny_target, ids[: i + 2]))]
        for k in range(1, K):
            got.append(s.expand(ids[i + 1 + k : i + 2 + k], torch.tensor([k - 2]))[0])
        s.end_cycle()
        for k in range(K):
            torch.testing.assert_close(got[k], train_logits[k][i], atol=ATOL, rtol=0)


@pytest.mark.parametrize("paradigm,mode,n_layers,extra", VARIANTS)
def test_tree_and_cycles(tiny_llama, ids, paradigm, mode, n_layers, extra):
    d = drafter(tiny_llama, paradigm, mode, n_layers, extra)
    a, b, c, e = 11, 22, 33, 44
    s = d.new_session()
    s.start_cycle(ids[None, :8], view(tiny_llama, ids[:8]))
    s.expand(torch.tensor([a, b]), torch.tensor([-1, -1]))
    tree = s.expand(torch.tensor([c, e]), torch.tensor([0, 1]))  # c under a, e under b
    s.end_cycle()
    # a node sees its ancestors only: c's logits equal those of the chain a -> c
    chain = d.new_session()
    chain.start_cycle(ids[None, :8], view(tiny_llama, ids[:8]))
    chain.expand(torch.tensor([a]), torch.tensor([-1]))
    torch.testing.assert_close(
        tree[0], chain.expand(torch.tensor([c]), torch.tensor([0]))[0], atol=ATOL, rtol=0
    )
    # a parent added in the same call is handled (level by level)
    same = d.new_session()
    same.start_cycle(ids[None, :8], view(tiny_llama, ids[:8]))
    both = same.expand(torch.tensor([b, e]), torch.tensor([-1, 0]))
    torch.testing.assert_close(both[1], tree[1], atol=ATOL, rtol=0)
    # next cycle: the target accepted x_8, x_9 and gives x_10 as bonus; only new hidden states are passed
    root2 = s.start_cycle(ids[None, :11], view(tiny_llama, ids[:11], since=7))
    fresh = d.new_session()
    torch.testing.assert_close(
        root2, fresh.start_cycle(ids[None, :11], view(tiny_llama, ids[:11])), atol=ATOL, rtol=0
    )
    torch.testing.assert_close(
        s.expand(torch.tensor([a]), torch.tensor([-1])),
        fresh.expand(torch.tensor([a]), torch.tensor([-1])),
        atol=ATOL,
        rtol=0,
    )


def test_session_grows_past_its_capacity(tiny_llama):
    d = drafter(tiny_llama, "hybrid", "concat", 1)
    ids = torch.randint(0, 3000, (40,), generator=torch.Generator().manual_seed(2))
    small = TrainedDraftSession(d, capacity=4, node_capacity=2)
    big = d.new_session()
    for x in (small, big):
        x.start_cycle(ids[None, :30], view(tiny_llama, ids[:30]))
    chain = [
        (
            small.expand(torch.tensor([t]), torch.tensor([k - 1])),
            big.expand(torch.tensor([t]), torch.tensor([k - 1])),
        )
        for k, t in enumerate(range(5))
    ]
    for x, y in chain:
        torch.testing.assert_close(x, y, atol=ATOL, rtol=0)
