"""The graph-ready draft loop (``decoding/device_draft.py`` over ``drafters/static_steps.py``) on tiny models, CPU.

* the fixed-width beam keeps the nodes, parents and ancestor matrix worked out by hand on a small case;
* for every trained paradigm (hidden EAGLE-3 and EAGLE 3.1, KV-only with and without its recency bias, hybrid,
  cross, the no-target control, block), the device chain drafts the host chain's tokens and the device tree the
  host dynamic tree's nodes, cycle after cycle, and greedy decoding with either equals plain greedy decoding;
* nothing inside the loop reads the device back (``item``, ``tolist``, ``bool``, ``int``, ``float`` counted);
* a drafter's next session takes over its buffers (the addresses a captured graph reads), two live ones never share.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import random_prompts

from kvshot_lib.decoding import (
    DecodeConfig,
    autoregressive_generate,
    beam_loop,
    chain_loop,
    device_chain,
    device_tree,
    draft_chain,
    draft_dynamic_tree,
    speculative_generate,
)
from kvshot_lib.drafters import TargetView, ancestor_matrix, build_drafter, drafter_config_for
from kvshot_lib.target import forward as seam

# name -> drafter_config_for overrides
VARIANTS = {
    "hidden": dict(paradigm="hidden"),
    "eagle3.1": dict(paradigm="hidden", fc_norm=True, norm_output=True),
    "kv": dict(paradigm="kv", n_layers=2, kv_mode="linear_rope"),
    "kv-recency": dict(paradigm="kv", n_layers=2, kv_recency=3, kv_softmax="separate", kv_mode="linear"),
    "hybrid": dict(paradigm="hybrid", n_layers=2, kv_mode="linear"),
    "cross": dict(paradigm="cross"),
    "none": dict(paradigm="none"),
    "block-kv": dict(paradigm="block", context="kv", block_size=4, regime="parallel"),
    "block-both": dict(paradigm="block", context="both", block_size=3, regime="parallel"),
}


def make_drafter(target, name: str):
    over = dict(VARIANTS[name])
    cfg = drafter_config_for(target, over.pop("paradigm"), draft_vocab_size=512, **over)
    d = build_drafter(cfg, target, torch.arange(512) * 7, seed=0)
    with torch.no_grad():  # off the identity/zero initializations, so that every path matters
        g = torch.Generator().manual_seed(3)
        for p in d.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return d.eval()


# ------------------------------------------------------------------------------------ the beam, worked by hand


class TableSteps:
    """Fake fixed-shape steps: the root's distribution, and each node's children's by its token alone."""

    ROOT = [0.5, 0.3, 0.1, 0.05, 0.05]
    BY_TOKEN = {
        0: [0.1, 0.05, 0.62, 0.2, 0.03],
        1: [0.02, 0.08, 0.15, 0.7, 0.05],
        2: [0.9, 0.04, 0.03, 0.02, 0.01],
        3: [0.01, 0.02, 0.03, 0.04, 0.9],
    }

    def __init__(self):
        self.root_logits = torch.tensor(self.ROOT).log()  # [V]
        self.calls = []

    def step(self, tokens, rows, level):
        self.calls.append((tokens.tolist(), None if rows is None else rows.tolist(), level))
        return torch.tensor([self.BY_TOKEN[t // 10] for t in tokens.tolist()]).log()  # [w, V]


def test_the_beam_keeps_the_hand_worked_tree():
    """k = 2, depth 3, budget 5 (draft id j is target id 10 j). Level 0: 0 (.5), 1 (.3). Their children: 0->2 .31,
    0->3 .10, 1->3 .21, 1->2 .045; the beam keeps 0->2 and 1->3. Theirs: 0->2->0 .279, 0->2->1 .0124, 1->3->4 .189,
    1->3->3 .0084. The 5 best: .5, .31, .3, .279, .21, kept in candidate order (level by level)."""
    steps = TableSteps()
    nodes, anc = beam_loop(steps, depth=3, k=2, budget=5, d2t=torch.arange(5) * 10)
    tokens, parents, depths = nodes.tolist()
    assert tokens == [0, 10, 20, 30, 0]  # 0, 1, 0->2, 1->3, 0->2->0
    assert parents == [-1, -1, 0, 1, 2] and depths == [0, 0, 1, 1, 2]
    # the steps ran the beam: level 0 the root's two children, level 1 the best child of each (rows 0 and 1)
    assert steps.calls == [([0, 10], None, 0), ([20, 30], [0, 1], 1)]
    rows = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 2, 4}, 5: {0, 1, 3, 5}}
    assert anc.tolist() == [[c in rows[b] for c in range(6)] for b in range(6)]
    assert torch.equal(anc, ancestor_matrix(parents))


def test_a_budget_past_every_candidate_keeps_them_all():
    nodes, anc = beam_loop(TableSteps(), depth=2, k=2, budget=100, d2t=None)
    assert nodes.shape == (3, 6) and nodes[2].tolist() == [0, 0, 1, 1, 1, 1]  # 2 + 2 x 2 candidates


# ------------------------------------------------------------------ the device loop against the host loop


def views(target, ids: torch.Tensor, cuts: list[int], layers):
    """The engine's view at each cut P: the cache of positions 0..P-1 and the hidden states since the last cut."""
    out, last = [], 0
    ids = ids.to(target.model.device)
    for P in cuts:
        cache = seam.new_cache(target.model)
        res = seam.forward(target.model, ids[None, :P], cache, hidden_states=True)
        hidden = {i: res.hidden_states[i + 1][:, last:P] for i in layers}
        out.append((ids[None, : P + 1], TargetView(cache=cache, hidden=hidden)))
        last = P
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_device_drafts_are_the_host_drafts(llama, name):
    """Cycle after cycle (the context growing), the device chain's tokens are the host chain's and the device
    tree's nodes are the host dynamic tree's (the same root-to-node paths)."""
    d = make_drafter(llama, name)
    ids = torch.tensor(random_prompts(1, 7)[0] + random_prompts(1, 8)[0])[:30]
    layers = d.hidden_layers
    host, dev = d.new_session(), d.new_session()
    for committed, view in views(llama, ids, [5, 9, 17, 24], layers):
        chain = draft_chain(host, committed, view, 4)
        host.end_cycle()
        got = device_chain(dev, committed, view, 4)
        dev.end_cycle()
        assert got.tokens == chain.tokens and got.parents == chain.parents and got.depths == chain.depths
    host, dev = d.new_session(), d.new_session()
    for committed, view in views(llama, ids, [6, 11, 20], layers):
        tree = draft_dynamic_tree(host, committed, view, 4, 3, 10)
        host.end_cycle()
        got = device_tree(dev, committed, view, 4, 3, 10)
        dev.end_cycle()
        assert sorted(paths(got)) == sorted(paths(tree))
        assert torch.equal(got.ancestors(), ancestor_matrix(got.parents))


def paths(tree) -> list[tuple[int, ...]]:
    """Every node as the tokens from the root down to it."""
    out = []
    for i in range(len(tree)):
        path, j = [], i
        while j >= 0:
            path.append(tree.tokens[j])
            j = tree.parents[j]
        out.append(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_decoding_with_the_device_loop_equals_plain_decoding(llama, name):
    d = make_drafter(llama, name)
    base = DecodeConfig(
        max_new_tokens=24, stop_token_ids=(), chain_depth=4, tree_depth=4, tree_top_k=3, tree_budget=10
    )
    for prompt in random_prompts(2, 11):
        plain = autoregressive_generate(llama, prompt, replace(base, mode="ar")).token_ids
        for mode in ("chain", "tree"):
            cfg = replace(base, mode=mode, draft_loop="device")
            assert speculative_generate(llama, d, prompt, cfg).token_ids == plain, (name, mode)


def test_the_self_drafter_falls_back_to_the_host_loop(llama):
    """A session without fixed-shape steps (the target drafting for itself) drafts on the host under
    draft_loop="device": every draft accepted, output equal to plain decoding."""
    from kvshot_lib.drafters import SelfDrafter

    prompt = random_prompts(1, 12)[0]
    base = DecodeConfig(max_new_tokens=16, stop_token_ids=(), chain_depth=4, draft_loop="device")
    plain = autoregressive_generate(llama, prompt, replace(base, mode="ar")).token_ids
    r = speculative_generate(llama, SelfDrafter(llama), prompt, base)
    assert r.token_ids == plain and max(r.accepted_per_cycle) == 4


# ----------------------------------------------------------------------------------- no host sync in the loop


@pytest.mark.parametrize("name", ["hidden", "kv-recency", "hybrid", "block-kv"])
def test_nothing_in_the_draft_loop_reads_the_device(llama, monkeypatch, name):
    """Neither the cycle's start (ingesting the new context, the root's logits, copying them into the steps) nor
    the loops read a value back: the cycle's one host read is the result's."""
    d = make_drafter(llama, name)
    ids = torch.tensor(random_prompts(1, 9)[0] + random_prompts(1, 10)[0])[:20]
    ((committed, view),) = views(llama, ids, [12], d.hidden_layers)
    session = d.new_session()
    reads = []
    for method in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        real = getattr(torch.Tensor, method)

        def counted(self, *a, _real=real, _name=method, **k):
            reads.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, method, counted)
    logits = session.start_cycle(committed, view)
    chain_steps, tree_steps = session.static_steps(1, 4), session.static_steps(3, 4)
    chain_steps.begin(session, logits)
    tree_steps.begin(session, logits)
    chain_loop(chain_steps, min(4, chain_steps.max_levels), session.d2t)
    beam_loop(tree_steps, min(4, tree_steps.max_levels), 3, 10, session.d2t)
    monkeypatch.undo()
    assert reads == []


# ------------------------------------------------------------------------------------- buffers kept for graphs


def test_the_next_session_takes_over_the_buffers_and_live_ones_never_share(llama):
    d = make_drafter(llama, "hybrid")
    a = d.new_session()
    b = d.new_session()  # a is alive: b has its own
    assert a.own.k[0].data_ptr() != b.own.k[0].data_ptr() and a.tgt is not b.tgt
    address = b.own.k[0].data_ptr()
    del a, b
    c = d.new_session()  # the last holder is gone: c takes its buffers over, reading the target's KV afresh
    assert c.own.k[0].data_ptr() == address and c.tgt.n == 0


def test_draft_loop_is_validated():
    with pytest.raises(ValueError, match="draft_loop must be one of"):
        DecodeConfig(draft_loop="gpu").validate()
    cpu = torch.device("cpu")
    assert not DecodeConfig().device_draft(cpu) and DecodeConfig(draft_loop="device").device_draft(cpu)
    assert not DecodeConfig(draft_loop="device", temperature=1.0).device_draft(cpu)
