"""The static-cache decode path (``target_cache="static"``) gives plain greedy decoding's tokens, keeps its cache
exact, and pads blocks to the CUDA graphs' widths without changing a token.

On a CPU the same code runs without graphs: ``PAD_ON_CPU`` makes it run every block at its graph's padded width
eagerly, so the padding, the pad rows' mask and the slot writes that a GPU replays are all checked here.
"""

import pytest
import torch
from conftest import random_prompts, spread_target, trained_like

from kvshot_lib.decoding import DecodeConfig, autoregressive_generate, speculative_generate
from kvshot_lib.drafters import resolve_drafter
from kvshot_lib.target import StaticKVCache, block_mask, prepare, static_cache, width_for
from kvshot_lib.target import forward as seam

MAX_NEW = 12
MODES = [
    ("ar", {}),
    ("chain", dict(chain_depth=3)),
    ("tree", dict(tree_depth=5, tree_top_k=3, tree_budget=12)),
]


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3"])
def target(request):
    return spread_target(request.param)


# every drafter padded to the graphs' widths; the exact widths with the drafters that move and read the K/V
CASES = [(d, True) for d in ("self", "early-exit-4", "hidden", "kv", "hybrid")]
CASES += [(d, False) for d in ("self", "early-exit-4", "kv")]


def reference(target, prompt):
    cfg = DecodeConfig(mode="ar", max_new_tokens=MAX_NEW, stop_token_ids=(), target_cache="dynamic")
    return autoregressive_generate(target, prompt, cfg).token_ids


@pytest.mark.parametrize(
    "drafter_name,padded", CASES, ids=[f"{d}-{'padded' if p else 'exact'}" for d, p in CASES]
)
def test_static_cache_equals_plain_greedy_decoding(target, drafter_name, padded, monkeypatch):
    """Chain, tree and plain decoding on the static cache, against plain decoding on a DynamicCache; the cache
    after every cycle holds exactly the committed tokens' K/V (a fresh forward of them, to float noise: 1e-4)."""
    monkeypatch.setattr(static_cache, "PAD_ON_CPU", padded)
    if drafter_name in ("self", "early-exit-4"):
        drafter = resolve_drafter(drafter_name, target, seed=7)
    else:
        drafter = trained_like(target, drafter_name)
    caches = []

    def check_cache(committed, cache):
        caches.append(type(cache))
        assert cache.get_seq_length() == committed.shape[1]  # the committed tokens before the new root
        fresh = seam.new_cache(target.model)
        seam.forward(target.model, committed, fresh)
        for li in (0, len(fresh.layers) - 1):
            k, v = seam.layer_kv(cache, li)
            torch.testing.assert_close(k, fresh.layers[li].keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v, fresh.layers[li].values, atol=1e-4, rtol=1e-4)

    accepted, hook = (
        0,
        check_cache if drafter_name in ("self", "kv") else None,
    )  # the K/V-moving and -reading ones
    for prompt in random_prompts(3, seed=11):
        ref = reference(target, prompt)
        for mode, kw in MODES:
            cfg = DecodeConfig(
                mode=mode, max_new_tokens=MAX_NEW, stop_token_ids=(), target_cache="static", **kw
            )
            out = speculative_generate(target, drafter, prompt, cfg, on_cycle=hook)
            assert out.token_ids == ref, f"{drafter_name} {mode} {kw}: differs from plain greedy decoding"
            accepted += sum(out.step_accepts)
    if drafter_name == "self":  # multi-token commits ran, and the tree's accepted paths were moved into place
        assert set(caches) == {StaticKVCache} and accepted > 40


def test_auto_is_dynamic_on_a_cpu_and_static_on_a_gpu():
    cfg = DecodeConfig()
    assert not cfg.static_cache(torch.device("cpu"))
    assert cfg.static_cache(torch.device("cuda"))
    assert DecodeConfig(target_cache="static").static_cache(torch.device("cpu"))
    assert not DecodeConfig(target_cache="dynamic").static_cache(torch.device("cuda"))
    with pytest.raises(ValueError, match="target_cache must be one of"):
        DecodeConfig(target_cache="paged").validate()


def test_widths():
    assert [width_for(n) for n in (1, 2, 3, 5, 9, 61, 64, 65, 128, 129)] == [
        1,
        2,
        4,
        8,
        16,
        64,
        64,
        128,
        128,
        129,
    ]
    # the widest block: the root, the largest proposal, prompt lookup's tokens
    assert DecodeConfig(mode="tree", tree_budget=60, chain_depth=8).widest_block() == 61
    assert (
        DecodeConfig(mode="chain", chain_depth=8, tree_budget=4, lookup=True, lookup_tokens=8).widest_block()
        == 17
    )
    assert DecodeConfig(mode="ar").widest_block() == 1


def small_config():
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, hidden_size=8)


def small_cache(max_len: int = 8) -> StaticKVCache:
    return StaticKVCache(small_config(), max_len, "cpu", torch.float32)


def test_block_mask_worked_by_hand():
    """Two committed slots, a block of 2 padded to 4, 8 slots: 0 marks what a row sees."""
    cache = small_cache()
    cache.length = 2
    seen = block_mask(cache, n=2, width=4, mask=None, dtype=torch.float32)[0, 0] == 0  # [4, 8]
    want = torch.tensor(
        [
            [1, 1, 1, 0, 0, 0, 0, 0],  # block row 0: the prefix and itself
            [1, 1, 1, 1, 0, 0, 0, 0],  # block row 1: the prefix, row 0 and itself
            [1, 1, 0, 0, 1, 0, 0, 0],  # pad row 2: the prefix and its own slot
            [1, 1, 0, 0, 0, 1, 0, 0],  # pad row 3
        ],
        dtype=torch.bool,
    )
    assert torch.equal(seen.cpu(), want)
    # a tree's mask: node 2 is the root's child, not node 1's
    tree = torch.zeros(1, 1, 3, 5)
    tree[0, 0, 2, 3] = torch.finfo(torch.float32).min
    tree[0, 0, 0, 3:] = torch.finfo(torch.float32).min
    tree[0, 0, 1, 4] = torch.finfo(torch.float32).min
    seen = block_mask(cache, n=3, width=3, mask=tree, dtype=torch.float32)[0, 0] == 0
    assert seen[2, :5].tolist() == [True, True, True, False, True]
    assert not seen[:, 5:].any()


def test_prepare_pads_and_refuses_what_does_not_fit():
    cache = small_cache()
    cache.length = 3
    ids, pos, mask, slots = prepare(cache, torch.tensor([[7, 8, 9]]), torch.tensor([[3, 4, 4]]), None, 4)
    assert (
        ids.tolist() == [[7, 8, 9, 0]] and pos.tolist() == [[3, 4, 4, 4]] and slots.tolist() == [3, 4, 5, 6]
    )
    assert mask.shape == (1, 1, 4, 8)
    with pytest.raises(ValueError, match="does not fit"):
        prepare(cache, torch.tensor([[1, 2]]), None, None, 8)
    with pytest.raises(ValueError, match="one sequence at a time"):
        prepare(cache, torch.zeros(2, 1, dtype=torch.long), None, None, 1)


def test_crop_and_load_follow_the_dynamic_cache():
    cache = small_cache()
    cache.length = 6
    cache.crop(-2)
    assert cache.get_seq_length() == 4
    cache.crop(3)
    assert cache.get_seq_length() == 3
    cache.crop(5)  # keeps at most 5: nothing to drop
    assert cache.get_seq_length() == 3
    dyn = seam.new_cache(small_config())
    k = torch.randn(1, 1, 5, 4)
    for li in range(2):
        dyn.update(k + li, -k, li)
    cache.load(dyn)
    assert cache.get_seq_length() == 5
    assert torch.equal(seam.layer_kv(cache, 1)[0].cpu(), (k + 1))
    with pytest.raises(ValueError, match="slots"):
        small_cache(max_len=4).load(dyn)


def test_compiled_layers_compiles_the_norms_and_mlps_and_undoes_it(tiny_qwen3):
    """``DecodeConfig.compile_target``'s context: inside it every decoder layer's RMSNorms (Qwen3's q/k norms too)
    and MLP run compiled; after it (an error included) none does, and the weights' names are untouched."""
    from kvshot_lib.target import graphs

    model = tiny_qwen3.model
    names = list(model.state_dict())
    mods = graphs.fused_modules(model)
    n_layers = model.config.num_hidden_layers
    assert len(mods) == n_layers * 5  # input, post-attention, q and k norms, and the MLP
    with pytest.raises(RuntimeError, match="inside"):
        with graphs.compiled_layers(model):
            assert all(m._compiled_call_impl is not None for m in mods)
            raise RuntimeError("inside")
    assert all(m._compiled_call_impl is None for m in mods) and list(model.state_dict()) == names
