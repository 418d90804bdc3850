"""A preallocated KV cache written by slot: the target's cache on the fast decode path (gpt-fast's ``KVCache``).

Every layer holds keys and values of a fixed length, ``[1, kv_heads, max_len, head_dim]``, allocated once. A forward
of ``n`` new tokens writes them at the slots ``length .. length + n - 1`` (``index_copy_`` by a slot tensor, no
concatenation, so tensor addresses never change) and attends over the whole buffer under a 4-D mask that opens the
committed prefix and the block's own pattern (causal for a chain, the tree's ancestors for a tree) and closes every
other slot. Rolling back a rejected draft is ``crop``: the length goes down and the stale slots are overwritten by
the next forward, never cleared.

Because shapes and addresses stay fixed, a forward of a fixed width can be captured once as a CUDA graph and
replayed (:mod:`.graphs`): the launch overhead that dominates a batch-1 decode step on a GPU goes away. A block
narrower than a captured width is padded: the pad rows attend to the prefix and themselves (never to nothing, which
would make NaN that the next masked read could still pick up through ``0 * NaN``), write into slots past the block,
which the mask keeps closed until a later forward overwrites them.

Everything else in the suite reads this cache as it reads a ``DynamicCache``: ``get_seq_length()``, ``crop(-n)``,
``layers[i].keys[:, :, a:b]`` (the full buffer; readers slice the committed prefix). Batch size 1 only, as decoding.
``tests/test_static_cache.py`` holds the token equality with plain greedy decoding on a ``DynamicCache``.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor
from transformers.cache_utils import Cache

# the tests set it: a CPU runs the GPU's padded widths eagerly, so the padding is checked there
PAD_ON_CPU = False


class StaticSlots:
    """One layer's preallocated keys and values ``[1, kv_heads, max_len, head_dim]`` (the cache does the writing)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: Tensor, values: Tensor):
        self.keys, self.values = keys, values
        self.is_initialized = True


class StaticKVCache(Cache):
    """A preallocated KV cache of ``max_len`` slots for a model of ``config`` (module docstring).

    ``length`` is the number of committed positions (a host integer: no device read to learn it); ``slots [n]``
    is where the running forward writes, set by :func:`prepare` before every forward."""

    def __init__(self, config, max_len: int, device, dtype: torch.dtype, compiled: bool = False):
        n_layers = config.num_hidden_layers
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (1, kv_heads, max_len, head_dim)
        layers = [
            StaticSlots(
                torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype)
            )
            for _ in range(n_layers)
        ]
        super().__init__(layers=layers)
        self.max_len, self.device, self.dtype = max_len, torch.device(device), dtype
        self.length = 0
        self.slots: Tensor | None = None  # [n] the slots the running forward writes
        self.padded = self.device.type == "cuda" or PAD_ON_CPU  # blocks run at a graph's padded width
        self.graphs: dict = {}  # (width, hidden) -> a captured forward (.graphs), kept with the buffers it reads
        self.graph_pool = None
        self.compiled = compiled  # its graphs record the decoder layers' norms and MLPs compiled (.graphs)

    # --- what transformers' attention calls
    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """Write ``key_states [1, kvH, n, D]`` at :attr:`slots` of layer ``layer_idx``; return the whole buffers."""
        layer = self.layers[layer_idx]
        layer.keys.index_copy_(2, self.slots, key_states.to(layer.keys.dtype))
        layer.values.index_copy_(2, self.slots, value_states.to(layer.values.dtype))
        return layer.keys, layer.values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_len

    # --- what the suite calls, as on a DynamicCache
    def crop(self, max_length: int) -> None:
        """``crop(-n)`` forgets the last ``n`` positions; ``crop(m)`` keeps the first ``m`` (DynamicCache's rule).
        The slots are not cleared: the next forward overwrites them."""
        self.length = max(0, self.length + max_length) if max_length < 0 else min(self.length, max_length)

    def reset(self) -> None:
        self.length = 0

    def load(self, cache) -> None:
        """Hold a copy of ``cache``'s positions (a DynamicCache, e.g. a shared prefill), replacing what was here."""
        n = cache.get_seq_length()
        if n > self.max_len:
            raise ValueError(
                f"the static cache has {self.max_len} slots; the cache to load holds {n} positions."
            )
        for mine, theirs in zip(self.layers, cache.layers):
            mine.keys[:, :, :n] = theirs.keys
            mine.values[:, :, :n] = theirs.values
        self.length = n


def block_mask(cache: StaticKVCache, n: int, width: int, mask: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The additive mask ``[1, 1, width, max_len]`` of a forward of ``n`` new tokens (padded to ``width``) at slots
    ``length ..``: every row sees the committed prefix; the block's rows see each other causally, or as ``mask``
    allows (a 4-D additive mask ``[1, 1, n, length + n]``, the engine's tree mask); a pad row sees only itself."""
    L, dev = cache.length, cache.device
    lo = torch.finfo(dtype).min
    out = torch.full((1, 1, width, cache.max_len), lo, dtype=dtype, device=dev)  # [1, 1, W, S]
    out[..., :L] = 0
    if mask is not None:
        if mask.dim() != 4 or mask.shape[-2] != n or mask.shape[-1] != L + n:
            raise ValueError(
                f"a static-cache forward takes a 4-D mask [1, 1, {n}, {L + n}], got {tuple(mask.shape)}."
            )
        out[0, 0, :n, L : L + n] = mask[0, 0, :, L:].to(dtype)
    else:
        causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()  # [n, n]
        out[0, 0, :n, L : L + n].masked_fill_(causal, 0)
    rows = torch.arange(n, width, device=dev)
    out[0, 0, rows, L + rows] = 0  # a pad row sees itself
    return out


def prepare(cache: StaticKVCache, ids: Tensor, positions: Tensor | None, mask: Tensor | None, width: int):
    """The padded inputs of a forward of ``ids [1, n]`` on ``cache``: ``(ids [1, W], positions [1, W], mask
    [1, 1, W, max_len], slots [W])``, pad rows repeating the last position. Refused when the slots run out."""
    if ids.shape[0] != 1:
        raise ValueError(f"the static cache decodes one sequence at a time; got a batch of {ids.shape[0]}.")
    n, L, dev = ids.shape[1], cache.length, cache.device
    if L + width > cache.max_len:
        raise ValueError(
            f"the static cache has {cache.max_len} slots; {L} are committed and a block of {width} does not fit."
        )
    if positions is None:
        positions = torch.arange(L, L + n, device=dev)[None]  # [1, n]
    pad = width - n
    ids = torch.cat([ids, ids.new_zeros(1, pad)], 1) if pad else ids  # [1, W]
    positions = positions.reshape(1, n).to(dev)
    if pad:
        positions = torch.cat([positions, positions[:, -1:].expand(1, pad)], 1)  # [1, W]
    slots = torch.arange(L, L + width, device=dev)  # [W]
    return ids, positions, block_mask(cache, n, width, mask, cache.dtype), slots


_POOL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(slots, dtype): StaticKVCache}


def static_cache_for(model, need: int, compiled: bool = False) -> StaticKVCache:
    """An empty static cache of at least ``need`` slots for ``model``. On a GPU one cache per power-of-two size (at
    least 2,048 slots: every MT-bench turn fits one, so a benchmark's warm-up captures every graph it will replay) is
    kept with the model, so a later generation replays the graphs an earlier one captured; on a CPU a fresh cache
    of exactly ``need`` slots (attention reads every slot: no more than needed). ``compiled``: on a GPU, graphs
    that record the decoder layers' norms and MLPs compiled by ``torch.compile`` (:mod:`.graphs`; a CPU ignores it)."""
    p = next(model.parameters())
    if p.device.type != "cuda":
        return StaticKVCache(model.config, need, p.device, p.dtype)
    # one per size, dtype and compilation: a model cast in place gets caches of its new dtype
    key = (max(2048, 1 << (need - 1).bit_length()), p.dtype, compiled)
    caches = _POOL.setdefault(model, {})
    if key not in caches:
        caches[key] = StaticKVCache(model.config, key[0], p.device, p.dtype, compiled)
    caches[key].reset()
    return caches[key]
