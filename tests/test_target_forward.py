"""The seam to the target (kvshot_lib/target/forward.py): a cached forward equals the full one, crop and
keep_positions cut the cache as they say, features come from one pass, and the cache argument follows the
installed transformers."""

import torch

from kvshot_lib.target import forward as seam


def test_cached_steps_equal_one_full_forward_and_crop_rolls_back(tiny_llama):
    model = tiny_llama.model
    ids = torch.randint(0, 3000, (1, 12), generator=torch.Generator().manual_seed(0))
    full = seam.forward(model, ids).logits  # [1, 12, V]
    cache = seam.new_cache(model)
    seam.forward(model, ids[:, :7], cache)
    assert seam.cache_length(cache) == 7
    step = seam.forward(model, ids[:, 7:10], cache, positions=torch.arange(7, 10)[None]).logits
    torch.testing.assert_close(step, full[:, 7:10], atol=1e-5, rtol=1e-5)
    seam.crop(cache, 8)  # drop positions 8, 9
    assert seam.cache_length(cache) == 8
    again = seam.forward(model, ids[:, 8:12], cache, positions=torch.arange(8, 12)[None]).logits
    torch.testing.assert_close(again, full[:, 8:12], atol=1e-5, rtol=1e-5)
    copy = seam.clone_cache(cache, model.config)
    seam.crop(copy, 3)
    assert seam.cache_length(cache) == 12 and seam.cache_length(copy) == 3  # the copy is its own


def test_keep_positions_and_layer_kv(tiny_llama):
    model = tiny_llama.model
    ids = torch.randint(0, 3000, (1, 9), generator=torch.Generator().manual_seed(1))
    cache = seam.new_cache(model)
    seam.forward(model, ids, cache)
    k0, v0 = (x.clone() for x in seam.layer_kv(cache, 2))  # [1, kvH, 9, D]
    keep = torch.tensor([0, 3, 4, 8])
    seam.keep_positions(cache, keep)
    k1, v1 = seam.layer_kv(cache, 2)
    assert torch.equal(k1, k0[:, :, keep]) and torch.equal(v1, v0[:, :, keep])


def test_sequence_features_are_the_full_forwards(tiny_llama):
    model = tiny_llama.model
    ids = torch.randint(0, 3000, (2, 10), generator=torch.Generator().manual_seed(2))
    f = seam.sequence_features(
        model, ids, hidden_layers=(1, 3), kv_layers=(2,), query_layers=(2,), logits=True
    )
    out = seam.forward(model, ids, seam.new_cache(model), hidden_states=True)
    torch.testing.assert_close(f.logits, out.logits)
    torch.testing.assert_close(f.final, out.hidden_states[-1])
    torch.testing.assert_close(f.hidden[3], out.hidden_states[4])  # layer 3's output
    cache = seam.new_cache(model)
    seam.forward(model, ids, cache)
    torch.testing.assert_close(f.keys[2], seam.layer_kv(cache, 2)[0])  # post-RoPE, as the cache holds them
    assert f.queries[2].shape == (2, tiny_llama.info.n_heads, 10, tiny_llama.info.head_dim)


def test_the_cache_goes_by_the_name_the_model_takes():
    class Current(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, **kw):
            return cache

    class Older(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kw):
            return past_key_values

    marker = object()
    assert seam.forward(Current(), None, marker) is marker
    assert seam.forward(Older(), None, marker) is marker
