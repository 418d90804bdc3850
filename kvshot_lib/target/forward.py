"""The one seam between the suite and the target model: every forward of the target goes through here.

* :func:`new_cache` gives an empty KV cache for a model, :func:`clone_cache` a private copy of one;
* :func:`forward` runs new tokens at given positions on a cache (or none), with an optional mask, the hidden
  states of every layer if asked and the logits of the last ``logits_to_keep`` positions; it passes the cache as
  transformers >= 5.24 wants it (``cache=``, which replaced ``past_key_values=``; the dependency floor), and as
  ``past_key_values=`` to a model whose forward has no ``cache`` argument (an older transformers on a borrowed
  GPU machine): this is the one place that knows both;
* :func:`layer_kv`, :func:`cache_length`, :func:`crop` and :func:`keep_positions` read and cut a cache;
* :func:`sequence_features` is "the target's features of a batch of sequences": the final hidden state, the hidden
  states of some layers and the post-RoPE K/V of some layers, in one cache-free forward. The feature store, online
  training, the per-sequence batches and the diagnostics all take their features from it.

``tests/test_layout.py`` fails on a target call (``model(``, ``.model.model(``) or a ``past_key_values=`` anywhere
else in the library.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import Tensor
from transformers import DynamicCache

from .capture import capture


def new_cache(model) -> DynamicCache:
    """An empty KV cache for ``model`` (a loaded target's ``.model``, or its config)."""
    return DynamicCache(config=getattr(model, "config", model))


def clone_cache(cache: DynamicCache, config) -> DynamicCache:
    """A private copy of ``cache`` (every layer's keys and values), for a model of ``config``."""
    out = new_cache(config)
    for i, layer in enumerate(cache.layers):
        out.update(layer.keys, layer.values, i)  # concatenation onto an empty layer: a copy
    return out


@functools.cache
def _cache_argument(model_class: type) -> str:
    """The name under which ``model_class.forward`` takes the KV cache: ``cache`` (transformers >= 5.24) or the
    older ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def forward(
    model,
    ids: Tensor,
    cache: DynamicCache | None = None,
    positions: Tensor | None = None,
    mask: Tensor | None = None,
    logits_to_keep: int = 0,
    hidden_states: bool = False,
):
    """One forward of ``ids [B, n]`` through the whole model (logits included). With ``cache`` the new tokens'
    K/V are appended to it; ``positions [B, n]`` (or ``[1, n]``) default to following the cache; ``mask`` is a
    2-D padding mask ``[B, T_total]`` or a 4-D attention mask; ``logits_to_keep=k`` keeps the last ``k``
    positions' logits (0: all). Returns transformers' output (``.logits``, ``.hidden_states``)."""
    return model(
        input_ids=ids,
        **{_cache_argument(type(model)): cache},
        use_cache=cache is not None,
        position_ids=positions,
        attention_mask=mask,
        logits_to_keep=logits_to_keep,
        output_hidden_states=hidden_states,
    )


def layer_kv(cache: DynamicCache, layer: int) -> tuple[Tensor, Tensor]:
    """The cached post-RoPE keys and values of ``layer``: each ``[B, kv_heads, T, head_dim]``."""
    entry = cache.layers[layer]
    return entry.keys, entry.values


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def crop(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` cached positions (in place)."""
    drop = cache_length(cache) - length
    if drop > 0:
        cache.crop(-drop)


def keep_positions(cache: DynamicCache, keep: Tensor) -> None:
    """Keep only the cached positions ``keep [m]`` (sorted indices), in order, in every layer (in place)."""
    for entry in cache.layers:
        entry.keys = entry.keys.index_select(2, keep)
        entry.values = entry.values.index_select(2, keep)


@dataclass
class Features:
    """What the target computes for a batch of sequences ``[B, T]`` (on its device, in its dtype)."""

    final: Tensor  # [B, T, H] the last hidden state, after the final norm
    hidden: dict[int, Tensor] = field(default_factory=dict)  # layer -> [B, T, H] its output (residual stream)
    keys: dict[int, Tensor] = field(default_factory=dict)  # layer -> [B, kv_heads, T, D] post-RoPE
    values: dict[int, Tensor] = field(default_factory=dict)  # layer -> [B, kv_heads, T, D]
    queries: dict[int, Tensor] = field(default_factory=dict)  # layer -> [B, heads, T, D] post-RoPE
    logits: Tensor | None = None  # [B, T, V] where asked for


def sequence_features(
    model,
    ids: Tensor,
    hidden_layers: Sequence[int] = (),
    kv_layers: Sequence[int] = (),
    query_layers: Sequence[int] = (),
    logits: bool = False,
) -> Features:
    """The target's features of ``ids [B, T]`` in one forward without a cache: the final hidden state, the chosen
    layers' hidden states, K/V and queries, and (``logits=True``) the LM head's logits."""
    dev = next(model.parameters()).device
    layers = sorted(set(hidden_layers) | set(kv_layers) | set(query_layers))
    kv = bool(kv_layers) or bool(query_layers)
    with capture(model, layers, hidden=bool(hidden_layers), kv=kv, queries=bool(query_layers)) as rec:
        if logits:
            out = forward(model, ids.to(dev), hidden_states=True)
            final, lg = out.hidden_states[-1], out.logits  # the last hidden state is after the final norm
        else:
            final, lg = model.model(input_ids=ids.to(dev), use_cache=False).last_hidden_state, None
    return Features(
        final=final,
        hidden={layer: rec.hidden_at(layer) for layer in hidden_layers},
        keys={layer: rec.keys_at(layer) for layer in kv_layers},
        values={layer: rec.values_at(layer) for layer in kv_layers},
        queries={layer: rec.queries_at(layer) for layer in query_layers},
        logits=lg,
    )
