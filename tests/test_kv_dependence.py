"""The KV-reading drafters depend on the *content* of the target's KV, causally, in training and in decoding.

Issue 12: with the target K/V that reach the KV-only drafter zeroed consistently in training and decoding,
the suite still passed all but one test. These tests fail on such a drafter (see the note at the end):

* in the training unroll, replacing the target's K/V at one position ``j`` changes the logits of every
  branch ``i >= j`` at every draft step (they see positions ``0..i``) and leaves every branch ``i < j``
  *bitwise* unchanged (no later position leaks into a draft); zeroing the target's K/V changes every row;
* in a decode session driven as the engine drives it (``start_cycle`` with a ``TargetView`` holding the
  target's cache, then ``expand``), the same perturbation of the cache leaves the cycles that committed
  fewer than ``j + 1`` positions bitwise unchanged, changes the root and every drafted node of the later
  cycles, and gives exactly the training unroll's logits on the perturbed batch.

The hybrid drafter reads the target's K/V through its cross-attention only; the same checks hold for it.
``tests/test_kv_copy_task.py`` shows the KV-only drafter *learns* from what the K/V hold.

Checked against a variant of the code in which the KV-only drafter's ``inject`` (the one way the target's
K/V reach it, in training and in decoding) gets zeros: every ``kv`` case here fails (the logits no longer
move), the ``hybrid`` cases pass. ``python tests/mutation_kv_cut.py`` reruns that check.
"""

from dataclasses import replace

import pytest
import torch

from kvshot_lib.drafters import TargetView, build_drafter, drafter_config_for
from kvshot_lib.training import batch_from_target

# (paradigm, kv_mode, n_layers, kv_recency): the recency variant adds a learned bias by distance to the scores
VARIANTS = [
    ("kv", "concat", 1, 0),
    ("kv", "linear_rope", 2, 0),
    ("kv", "concat", 2, 3),
    ("hybrid", "concat", 1, 0),
    ("hybrid", "linear", 2, 0),
]
T, K = 16, 3
MOVED = 1e-2  # a row "changes" when a logit moves by more than this (float noise ~1e-6; seen: >= 0.1)
ATOL = 2e-5  # decoding against the training unroll (as in test_drafters_session.py)


def drafter(target, paradigm, mode, n_layers, kv_recency):
    cfg = drafter_config_for(
        target, paradigm, n_layers=n_layers, kv_mode=mode, draft_vocab_size=512, kv_recency=kv_recency
    )
    d = build_drafter(cfg, target, torch.arange(512) * 3, seed=0)
    with torch.no_grad():  # off the identity/zero initializations, so that every path carries signal
        g = torch.Generator().manual_seed(1)
        for p in d.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return d.eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 3000, (T,), generator=torch.Generator().manual_seed(4))


def noise_like_position(keys: torch.Tensor, seed: int) -> torch.Tensor:
    """``[heads, D]`` random K/V of twice the spread of the real ones: a different token's cache entry."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(keys.shape[-2:], generator=g) * 2 * keys.std()


def batch_with(batch, j: int, new_k: torch.Tensor, new_v: torch.Tensor):
    """``batch`` whose target K/V at position ``j`` are ``new_k``, ``new_v`` (``[heads, D]``)."""
    keys, values = batch.keys.clone(), batch.values.clone()  # [B, T, heads, D]
    keys[:, j], values[:, j] = new_k, new_v
    return replace(batch, keys=keys, values=values)


def cache_with(cache, kv_layers, j: int, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
    """The same change in a target cache: heads ``[a*kvH, (a+1)*kvH)`` of the batch are layer ``kv_layers[a]``."""
    for a, layer in enumerate(kv_layers):
        lk, lv = cache.layers[layer].keys, cache.layers[layer].values  # [1, kvH, P, D]
        kvh = lk.shape[1]
        if j < lk.shape[2]:
            lk[0, :, j] = new_k[a * kvh : (a + 1) * kvh]
            lv[0, :, j] = new_v[a * kvh : (a + 1) * kvh]


def zero_cache(cache, kv_layers) -> None:
    for layer in kv_layers:
        cache.layers[layer].keys.zero_()
        cache.layers[layer].values.zero_()


@torch.no_grad()
def unroll_logits(d, batch) -> list[torch.Tensor]:
    return [d.logits(h)[0] for h in d(batch, K).outs]  # per step [N, V_draft]


def moved_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).abs().amax(-1) > MOVED  # [rows]


@pytest.mark.parametrize("paradigm,mode,n_layers,recency", VARIANTS)
def test_training_unroll_reads_the_target_kv_causally(tiny_llama, ids, paradigm, mode, n_layers, recency):
    d = drafter(tiny_llama, paradigm, mode, n_layers, recency)
    batch = batch_from_target(tiny_llama, ids, torch.ones(T, dtype=torch.bool), d.cfg)
    base = unroll_logits(d, batch)
    for j in (0, 5, 11):
        new_k, new_v = noise_like_position(batch.keys, j), noise_like_position(batch.values, 100 + j)
        moved = unroll_logits(d, batch_with(batch, j, new_k, new_v))
        for k in range(K):
            assert torch.equal(moved[k][:j], base[k][:j]), f"step {k}: a branch before {j} saw position {j}"
            changed = moved_rows(moved[k][j:], base[k][j:])
            assert changed.all(), (
                f"step {k}: branches {(j + torch.nonzero(~changed)[:, 0]).tolist()} ignore it"
            )
    zeroed = unroll_logits(
        d, replace(batch, keys=torch.zeros_like(batch.keys), values=torch.zeros_like(batch.values))
    )
    for k in range(K):
        assert moved_rows(zeroed[k], base[k]).all(), f"step {k}: some branch ignores the target's K/V"


def session_logits(d, target, ids, cycles, edit=None) -> list[torch.Tensor]:
    """Drive one session as the engine does: cycle ``c`` has committed ``ids[:P+1]`` (``P = cycles[c]``); its
    view holds the target's cache of positions ``0..P-1`` (changed by ``edit``) and the hidden states committed
    since the previous cycle; it drafts the chain ``ids[P+1], ids[P+2]``. Returns per cycle ``[3, V_draft]``."""
    s, out, given = d.new_session(), [], 0
    for P in cycles:
        with torch.no_grad():
            o = target.model(input_ids=ids[None, :P], use_cache=True, output_hidden_states=True)
        if edit is not None:
            edit(o.past_key_values)
        hidden = {layer: o.hidden_states[layer + 1][:, given:P] for layer in d.hidden_layers}
        root = s.start_cycle(ids[None, : P + 1], TargetView(o.past_key_values, hidden))
        chain = s.expand(ids[P + 1 : P + 3], torch.tensor([-1, 0]))  # root -> ids[P+1] -> ids[P+2]
        s.end_cycle()
        out.append(torch.cat([root[None], chain]))
        given = P
    return out


@pytest.mark.parametrize("paradigm,mode,n_layers,recency", VARIANTS)
def test_decode_session_reads_the_target_kv_causally(tiny_llama, ids, paradigm, mode, n_layers, recency):
    d = drafter(tiny_llama, paradigm, mode, n_layers, recency)
    layers = d.cfg.kv_layers
    cycles, j = (4, 8, 12), 6
    batch = batch_from_target(tiny_llama, ids, torch.ones(T, dtype=torch.bool), d.cfg)
    new_k, new_v = noise_like_position(batch.keys, 7), noise_like_position(batch.values, 8)
    base = session_logits(d, tiny_llama, ids, cycles)
    moved = session_logits(d, tiny_llama, ids, cycles, lambda c: cache_with(c, layers, j, new_k, new_v))
    zeroed = session_logits(d, tiny_llama, ids, cycles, lambda c: zero_cache(c, layers))
    for P, b, m, z in zip(cycles, base, moved, zeroed):
        assert moved_rows(z, b).all(), f"cycle at P={P}: a draft ignores the zeroed cache"
        if P <= j:  # position j is not committed yet
            assert torch.equal(m, b), f"cycle at P={P} saw position {j}, which is not in its cache"
        else:
            assert moved_rows(m, b).all(), f"cycle at P={P}: the root or a drafted node ignores position {j}"
    # decoding reads exactly what training reads: branch P-1, steps 0..2, of the perturbed batch
    train = unroll_logits(d, batch_with(batch, j, new_k, new_v))
    for P, m in zip(cycles, moved):
        torch.testing.assert_close(m, torch.stack([train[k][P - 1] for k in range(K)]), atol=ATOL, rtol=0)
