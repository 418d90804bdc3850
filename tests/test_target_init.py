"""Target initialization of the KV drafter's attention: on the target's own normalized input, the drafter's
post-RoPE queries and keys are the target's, and a drafter trained from it says so in its checkpoint."""

import pytest
import torch

from kvshot_lib.drafters import (
    DrafterConfigError,
    build_drafter,
    drafter_config_for,
    init_attention_from_target,
)
from kvshot_lib.target import capture
from kvshot_lib.training import TrainConfig, TrainConfigError


@pytest.mark.parametrize("layers", [[2], [1, 3]])
def test_queries_and_keys_start_as_the_targets(tiny_llama, layers):
    info = tiny_llama.info
    group = info.n_heads // info.n_kv_heads
    cfg = drafter_config_for(tiny_llama, "kv", kv_layers=layers, query_group=group, draft_vocab_size=64)
    d = build_drafter(cfg, tiny_llama, torch.arange(64), seed=0)
    init_attention_from_target(d, tiny_llama)
    ids = torch.randint(0, 2000, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), capture(tiny_llama.model, layers, hidden=True, kv=True, queries=True) as rec:
        out = tiny_llama.model(ids, output_hidden_states=True)
    attn = d.layers[0].self_attn
    cos, sin = d.rope(torch.arange(12))
    for j, li in enumerate(layers):
        x = out.hidden_states[li]  # [1, T, H] the input of target layer li
        with torch.no_grad():
            a = d.layers[0].input_norm(x)  # ones: the target's weight is folded into the projections
            q = attn.query(a, cos, sin)  # [1, nInj*G, T, D]
            k, v = attn.key_value(a, cos, sin)  # [1, nInj, T, D]
        heads = slice(j * info.n_kv_heads, (j + 1) * info.n_kv_heads)
        torch.testing.assert_close(k[:, heads], rec.keys_at(li), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v[:, heads], rec.values_at(li), atol=1e-4, rtol=1e-4)
        qh = slice(j * info.n_heads, (j + 1) * info.n_heads)
        torch.testing.assert_close(q[:, qh], rec.queries_at(li), atol=1e-4, rtol=1e-4)


def test_only_the_kv_drafter_takes_it(tiny_llama):
    cfg = drafter_config_for(tiny_llama, "hidden", draft_vocab_size=64)
    with pytest.raises(DrafterConfigError, match="KV-only"):
        init_attention_from_target(build_drafter(cfg, tiny_llama, torch.arange(64), seed=0), tiny_llama)
    with pytest.raises(TrainConfigError, match="KV-only"):
        TrainConfig(paradigm="hybrid", regime="ttt", init_from="target")
