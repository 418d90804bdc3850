"""Record a target's hidden states, post-RoPE keys/values and post-RoPE queries during any forward pass.

Everything goes through transformers' own seams, with no forked modeling file:

* hidden states: a forward hook on each chosen decoder layer (``model.model.layers[i]``); the record is
  that layer's output, i.e. the residual stream after layer ``i`` (before the final norm);
* keys, values and queries: a registered attention function (``AttentionInterface``) that wraps the
  model's own one (sdpa or eager), records its inputs for the chosen layers and then calls it. The keys
  and values there are exactly what the cache stores (after RoPE, before GQA repetition); only the
  positions of the current forward are recorded. A matching ``AttentionMaskInterface`` entry is
  registered too: without it a multi-token step on a cache silently gets no mask.

``capture`` is a context manager; hooks, the attention-implementation switch and the per-module marks
are always undone in ``finally``, even when the forward raises.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

_IMPL = "kvshot_capture"


@dataclass
class Captured:
    """Per-layer records, one entry per forward pass run inside the context.

    hidden[l]:  list of [B, T, hidden]
    keys[l], values[l]: list of [B, kv_heads, T, head_dim]   (post-RoPE, as the cache holds them)
    queries[l]: list of [B, heads, T, head_dim]               (post-RoPE)
    """

    hidden: dict[int, list[Tensor]] = field(default_factory=lambda: defaultdict(list))
    keys: dict[int, list[Tensor]] = field(default_factory=lambda: defaultdict(list))
    values: dict[int, list[Tensor]] = field(default_factory=lambda: defaultdict(list))
    queries: dict[int, list[Tensor]] = field(default_factory=lambda: defaultdict(list))

    @staticmethod
    def _cat(records: dict[int, list[Tensor]], layer: int, dim: int) -> Tensor:
        if layer not in records or not records[layer]:
            raise KeyError(f"nothing was captured for layer {layer}; captured layers: {sorted(records)}")
        return torch.cat(records[layer], dim=dim)

    def hidden_at(self, layer: int) -> Tensor:  # [B, T_total, hidden]
        return self._cat(self.hidden, layer, dim=1)

    def keys_at(self, layer: int) -> Tensor:  # [B, kv_heads, T_total, head_dim]
        return self._cat(self.keys, layer, dim=2)

    def values_at(self, layer: int) -> Tensor:  # [B, kv_heads, T_total, head_dim]
        return self._cat(self.values, layer, dim=2)

    def queries_at(self, layer: int) -> Tensor:  # [B, heads, T_total, head_dim]
        return self._cat(self.queries, layer, dim=2)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layer list of a Llama/Qwen3-style causal LM."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(
            f"{type(model).__name__} has no .model.layers; capture supports Llama/Qwen3-style models."
        )
    return layers


def _capturing_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    rec: Captured | None = getattr(module, "_kvshot_record", None)
    if rec is not None:
        layer, want_kv, want_q = module.layer_idx, module._kvshot_kv, module._kvshot_q
        q_len = query.shape[2]
        if want_q:
            rec.queries[layer].append(query.detach())  # [B, H, q_len, D]
        if want_kv:
            rec.keys[layer].append(key[:, :, -q_len:].detach())  # [B, kvH, q_len, D]
            rec.values[layer].append(value[:, :, -q_len:].detach())
    inner_impl = module._kvshot_inner
    if inner_impl == "eager":
        return _eager_fn(module)(module, query, key, value, attention_mask, **kwargs)
    return ALL_ATTENTION_FUNCTIONS[inner_impl](module, query, key, value, attention_mask, **kwargs)


def _eager_fn(module):
    import sys

    return sys.modules[type(module).__module__].eager_attention_forward


def _register(inner_impl: str) -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(_IMPL, _capturing_attention)
    AttentionMaskInterface.register(_IMPL, ALL_MASK_ATTENTION_FUNCTIONS[inner_impl])


@contextmanager
def capture(
    model: torch.nn.Module,
    layers: Sequence[int],
    hidden: bool = True,
    kv: bool = True,
    queries: bool = False,
) -> Iterator[Captured]:
    """Record the chosen decoder layers' hidden states / K,V / queries for every forward in the block.

    >>> with capture(model, [1, 14, 26], queries=True) as rec:
    ...     model(input_ids)
    >>> rec.queries_at(14).shape   # [B, heads, T, head_dim]
    """
    blocks = decoder_layers(model)
    layers = sorted(set(int(i) for i in layers))
    bad = [i for i in layers if not 0 <= i < len(blocks)]
    if bad:
        raise ValueError(
            f"layers {bad} out of range: the model has {len(blocks)} decoder layers (0..{len(blocks) - 1})."
        )
    rec = Captured()
    handles = []
    config = model.config
    old_impl = config._attn_implementation
    try:
        if hidden:
            for i in layers:

                def hook(_mod, _inp, out, i=i):
                    rec.hidden[i].append(
                        (out[0] if isinstance(out, tuple) else out).detach()
                    )  # [B, T, hidden]

                handles.append(blocks[i].register_forward_hook(hook))
        if kv or queries:
            inner = old_impl if old_impl not in (None, _IMPL) else "sdpa"
            _register(inner)
            for b in blocks:
                b.self_attn._kvshot_inner = inner
            for i in layers:
                attn = blocks[i].self_attn
                attn._kvshot_record, attn._kvshot_kv, attn._kvshot_q = rec, kv, queries
            config._attn_implementation = _IMPL
        yield rec
    finally:
        for h in handles:
            h.remove()
        config._attn_implementation = old_impl
        for b in blocks:
            for name in ("_kvshot_record", "_kvshot_kv", "_kvshot_q", "_kvshot_inner"):
                if hasattr(b.self_attn, name):
                    delattr(b.self_attn, name)
