"""Capture is exact: it changes nothing, and what it records is what the model really computed."""

import math

import pytest
import torch

from kvshot_lib.target import capture, decoder_layers
from kvshot_lib.target import forward as seam

LAYERS = [0, 3, 7]


def _ids(seed, shape):
    return torch.randint(0, 49152, shape, generator=torch.Generator().manual_seed(seed))


def test_logits_identical_with_and_without_capture(tiny_target):
    model = tiny_target.model
    ids = _ids(0, (2, 17))
    ref = seam.forward(model, ids).logits
    with capture(model, LAYERS, hidden=True, kv=True, queries=True):
        got = seam.forward(model, ids).logits
    assert torch.equal(ref, got)


def test_captured_kv_equal_cache_contents_over_prefill_and_decode(tiny_target):
    model = tiny_target.model
    cache = seam.new_cache(model)
    with capture(model, LAYERS) as rec:
        seam.forward(model, _ids(1, (2, 11)), cache)
        seam.forward(model, _ids(2, (2, 4)), cache)  # multi-token step
        seam.forward(model, _ids(3, (2, 1)), cache)
    for layer in LAYERS:
        keys, values = seam.layer_kv(cache, layer)
        assert torch.equal(rec.keys_at(layer), keys)  # [B, kvH, 16, D]
        assert torch.equal(rec.values_at(layer), values)
        assert rec.keys_at(layer).shape[2] == 16


def test_hidden_states_match_output_hidden_states(tiny_target):
    model = tiny_target.model
    ids = _ids(4, (1, 9))
    with capture(model, LAYERS, kv=False) as rec:
        out = seam.forward(model, ids, hidden_states=True)
    for layer in LAYERS[:-1]:  # the last layer's entry in output_hidden_states is after the final norm
        assert torch.equal(rec.hidden_at(layer), out.hidden_states[layer + 1])


def test_queries_reproduce_attention_output(tiny_target):
    """softmax(q kᵀ/√d + causal) v from the captured q and K/V equals the input of each layer's o_proj."""
    model, info = tiny_target.model, tiny_target.info
    blocks = decoder_layers(model)
    o_inputs = {}
    hooks = [
        blocks[i].self_attn.o_proj.register_forward_pre_hook(
            lambda _m, args, i=i: o_inputs.__setitem__(i, args[0])
        )
        for i in LAYERS
    ]
    try:
        with capture(model, LAYERS, hidden=False, kv=True, queries=True) as rec:
            seam.forward(model, _ids(5, (2, 13)))
    finally:
        for h in hooks:
            h.remove()
    groups = info.n_heads // info.n_kv_heads
    for layer in LAYERS:
        q = rec.queries_at(layer)  # [B, H, T, D]
        k = rec.keys_at(layer).repeat_interleave(groups, dim=1)  # [B, H, T, D]
        v = rec.values_at(layer).repeat_interleave(groups, dim=1)
        T = q.shape[2]
        scores = q @ k.transpose(-1, -2) / math.sqrt(info.head_dim)  # [B, H, T, T]
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        attn = scores.softmax(-1) @ v  # [B, H, T, D]
        expected = attn.transpose(1, 2).reshape(2, T, -1)  # [B, T, H*D]
        torch.testing.assert_close(o_inputs[layer], expected, atol=1e-5, rtol=1e-5)


def test_everything_is_undone_even_when_the_forward_raises(tiny_llama):
    model = tiny_llama.model
    blocks = decoder_layers(model)
    impl = model.config._attn_implementation
    before = [
        dict(b._forward_hooks) for b in blocks
    ]  # transformers may keep hooks of its own (hidden states)
    with pytest.raises(RuntimeError, match="boom"):
        with capture(model, LAYERS, hidden=True, kv=True, queries=True):
            seam.forward(model, _ids(6, (1, 5)))
            raise RuntimeError("boom")
    assert model.config._attn_implementation == impl
    for b, hooks in zip(blocks, before):
        assert dict(b._forward_hooks) == hooks
        assert not [n for n in vars(b.self_attn) if n.startswith("_kvshot")]
    ref = seam.forward(model, _ids(7, (1, 5))).logits
    with capture(model, LAYERS):
        assert torch.equal(seam.forward(model, _ids(7, (1, 5))).logits, ref)


def test_out_of_range_layer_is_a_clear_error(tiny_llama):
    with pytest.raises(ValueError, match="out of range"):
        with capture(tiny_llama.model, [8]):
            pass
