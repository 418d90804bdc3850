"""The one seam between the suite and the target model: every forward of the target goes through here.

* :func:`new_cache` gives an empty KV cache for a model, :func:`clone_cache` a private copy of one (the static
  cache of the fast decode path is :class:`~.static_cache.StaticKVCache`);
* :func:`forward` runs new tokens at given positions on a cache (or none), with an optional mask, the hidden
  states of every layer if asked and the logits of the last ``logits_to_keep`` positions; it passes the cache as
  transformers >= 5.24 wants it (``cache=``, which replaced ``past_key_values=``; the dependency floor), and as
  ``past_key_values=`` to a model whose forward has no ``cache`` argument (an older transformers on a borrowed
  GPU machine): this is the one place that knows both. On a static cache it writes by slot under a full-length
  mask, and on a GPU replays the forward as a CUDA graph of the block's padded width (:mod:`.graphs`, where the
  graphs are captured); the caller sees the same outputs either way;
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
from .graphs import WIDTHS, StaticOutput, captured, width_for
from .static_cache import StaticKVCache, prepare


def new_cache(model) -> DynamicCache:
    """An empty KV cache for ``model`` (a loaded target's ``.model``, or its config); a static one comes from
    :func:`~.static_cache.static_cache_for`."""
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
    positions' logits (0: all). Returns transformers' output (``.logits``, ``.hidden_states``).

    On a :class:`~.static_cache.StaticKVCache` (batch 1) ``mask`` is None (causal) or the block's 4-D mask
    ``[1, 1, n, past + n]``; on a CUDA device the forward is a replay of the graph of the block's padded width."""
    if isinstance(cache, StaticKVCache):
        return _static_forward(model, ids, cache, positions, mask, logits_to_keep, hidden_states)
    return _model_call(model, ids, cache, positions, mask, hidden_states, logits_to_keep)


def _model_call(model, ids, cache, positions, mask, hidden_states, logits_to_keep: int = 0):
    """The model's own forward (on a static cache: with its write slots set; what a graph records)."""
    return model(
        input_ids=ids,
        **{_cache_argument(type(model)): cache},
        use_cache=cache is not None,
        position_ids=positions,
        attention_mask=mask,
        logits_to_keep=logits_to_keep,
        output_hidden_states=hidden_states,
    )


def _static_forward(model, ids, cache: StaticKVCache, positions, mask, logits_to_keep, hidden_states):
    """:func:`forward` on a static cache. A block of at most ``max(WIDTHS)`` tokens after the prefill runs padded to
    its graph's width: on a GPU as a replay of that graph, elsewhere eagerly where ``cache.padded`` asks for it (the
    tests check the padding on a CPU); anything else (the prefill, a CPU by default) runs eagerly at its own width.
    The cache's length then counts the ``n`` new tokens."""
    n = ids.shape[1]
    graphs = cache.device.type == "cuda"
    # not the prefill, and room for the pad rows
    fits = cache.length > 0 and cache.length + width_for(n) <= cache.max_len
    if n <= max(WIDTHS) and fits and (graphs or cache.padded):
        if graphs:
            out = captured(_model_call, model, cache, n, hidden_states)(ids, positions, mask)
        else:
            ids, positions, full_mask, cache.slots = prepare(cache, ids, positions, mask, width_for(n))
            out = _model_call(model, ids, cache, positions, full_mask, hidden_states)
            hidden = tuple(h[:, :n] for h in out.hidden_states) if hidden_states else None
            out = StaticOutput(out.logits[:, :n], hidden)
        if logits_to_keep:
            out.logits = out.logits[:, n - logits_to_keep :]
    else:
        ids, positions, full_mask, cache.slots = prepare(cache, ids, positions, mask, n)
        out = _model_call(model, ids, cache, positions, full_mask, hidden_states, logits_to_keep)
    cache.length += n
    return out


def prepare_graphs(model, cache, widest: int, hidden_states: bool) -> None:
    """Capture now every graph a decode of blocks up to ``widest`` tokens can replay on ``cache`` (a static cache on a
    GPU; nothing elsewhere), so that none is captured in the middle of a timed generation."""
    if isinstance(cache, StaticKVCache) and cache.device.type == "cuda":
        for w in WIDTHS[: WIDTHS.index(width_for(min(widest, max(WIDTHS)))) + 1]:
            captured(_model_call, model, cache, w, hidden_states)


def layer_kv(cache: DynamicCache, layer: int) -> tuple[Tensor, Tensor]:
    """The cached post-RoPE keys and values of ``layer``: each ``[B, kv_heads, T, head_dim]``."""
    entry, n = cache.layers[layer], cache.get_seq_length()
    return entry.keys[:, :, :n], entry.values[:, :, :n]


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
