"""The partial KV cache of SpecPV: sinks, retrieved blocks and a recent window, in one compact cache.

Verifying a draft against the whole cache costs a read of every cached key per step; SpecPV (Tan et al.
2025) verifies against a compact cache instead, rebuilt from the exact (full) cache at every full pass:

* **sinks**: the first ``sink`` tokens (default 32);
* **retrieved blocks**: the top ``R = (budget - sink - window) / block_size`` blocks of ``block_size``
  (16) tokens, chosen per layer and per KV head by a score of the block's keys against the queries of
  the full pass's draft tokens, averaged over the queries and over each GQA group;
* **the window**: the last ``window`` tokens, extended back to a block boundary so that it also covers
  the incomplete tail block: every position after the sinks is either in a candidate block or in the
  window, with no gap (SpecPV's public code leaves up to 15 tokens uncovered there);
* **the buffer**: the K/V of the tokens verified (partially) since the last full pass, appended by each
  partial verification.

Block scores use per-block summaries, the per-channel max and min of the block's keys, kept per layer and
updated incrementally as blocks complete (:class:`BlockSummaries`). ``score="quest"`` is Quest's bound on
``q · k`` over the block, ``Σ_d max(q_d kmax_d, q_d kmin_d)``; ``score="vector"`` is SpecPV's cheaper
whole-vector score ``max(q · kmax, q · kmin)``.

Keys stay post-RoPE at their true positions: nothing is re-rotated. The compact cache is a plain
``DynamicCache`` whose rows are no longer positions, so a verification on it passes the true position ids
and an explicit mask, and runs :func:`compact_attention`, which refuses to run without one (never a causal
mask built from cache indices). ``tests/test_specpv.py`` checks that compact attention over a complete
selection equals sdpa over the full K/V (tree masks, GQA) and that a forward on a complete compact cache
gives the full forward's logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache

from ..target.forward import new_cache

SCORES = ("quest", "vector")
_IMPL = "kvshot_compact"


@dataclass
class PartialKVConfig:
    """The geometry of the partial cache, in tokens. ``budget`` counts sinks + retrieved blocks + window;
    the tail block (< ``block_size`` tokens) and the buffer of partially verified tokens come on top."""

    budget: int = 1024
    sink: int = 32
    window: int = 64
    block_size: int = 16
    score: str = "quest"

    def validate(self) -> PartialKVConfig:
        for name in ("budget", "sink", "window", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer (tokens), got {value!r}.")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}.")
        bad = {
            k: getattr(self, k) for k in ("sink", "window", "budget") if getattr(self, k) % self.block_size
        }
        if bad:
            raise ValueError(
                f"block_size={self.block_size} must divide sink, window and budget; it does not divide "
                f"{bad}. Use multiples of {self.block_size} (e.g. budget={self.budget // self.block_size * self.block_size or self.block_size})."
            )
        if self.budget < self.sink + self.window:
            raise ValueError(
                f"budget={self.budget} is below sink + window = {self.sink + self.window}: the budget counts "
                "the sinks, the retrieved blocks and the window; raise it or shrink sink/window."
            )
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {self.score!r}.")
        return self

    @property
    def n_retrieved(self) -> int:
        """R: the retrieved blocks per layer and KV head."""
        return (self.budget - self.sink - self.window) // self.block_size


@dataclass(frozen=True)
class Layout:
    """Where the parts of a context of ``length`` tokens fall: sinks ``[0, sink_end)``, candidate blocks
    ``sink_end + b * block_size`` for ``b < n_candidates``, the window ``[window_start, length)``."""

    length: int
    sink_end: int
    n_candidates: int
    window_start: int


def layout(length: int, cfg: PartialKVConfig) -> Layout:
    """Split ``length`` cached tokens into sinks, complete candidate blocks and a window with no gap: the
    window holds the last ``window // block_size`` complete blocks plus the incomplete tail block."""
    bs = cfg.block_size
    sink_end = min(cfg.sink, length)
    n_blocks = (length - sink_end) // bs  # complete blocks after the sinks
    n_candidates = max(0, n_blocks - cfg.window // bs)
    return Layout(length, sink_end, n_candidates, sink_end + n_candidates * bs)


class BlockSummaries:
    """Per layer: the per-channel max and min of each complete block's keys, ``[kvH, n_blocks, D]``, grown
    incrementally (a block is summarized once, when it first lies complete in the full cache)."""

    def __init__(self, sink: int, block_size: int):
        self.sink, self.block_size = sink, block_size
        self.kmax: dict[int, Tensor] = {}
        self.kmin: dict[int, Tensor] = {}

    def n_blocks(self, layer: int) -> int:
        return self.kmax[layer].shape[1] if layer in self.kmax else 0

    def update(self, layer: int, keys: Tensor, n_blocks: int) -> tuple[Tensor, Tensor]:
        """Summaries of the first ``n_blocks`` blocks of ``keys [1, kvH, T, D]`` (computing only new ones)."""
        have = self.n_blocks(layer)
        if have > n_blocks:  # the full cache was cut back below a summarized block
            self.kmax[layer], self.kmin[layer] = (
                self.kmax[layer][:, :n_blocks],
                self.kmin[layer][:, :n_blocks],
            )
        elif have < n_blocks:
            bs, start = self.block_size, self.sink + have * self.block_size
            new = keys[0, :, start : self.sink + n_blocks * bs]  # [kvH, n_new * bs, D]
            new = new.reshape(new.shape[0], n_blocks - have, bs, new.shape[-1])  # [kvH, n_new, bs, D]
            mx, mn = new.amax(2), new.amin(2)  # [kvH, n_new, D]
            if have:
                mx, mn = torch.cat([self.kmax[layer], mx], 1), torch.cat([self.kmin[layer], mn], 1)
            self.kmax[layer], self.kmin[layer] = mx, mn
        return self.kmax[layer], self.kmin[layer]


def block_scores(queries: Tensor, kmax: Tensor, kmin: Tensor, score: str = "quest") -> Tensor:
    """``[kvH, n_blocks]``: each block's score against ``queries [H, n_q, D]``, averaged over the queries
    and the ``H / kvH`` heads of each GQA group. ``kmax``/``kmin``: ``[kvH, n_blocks, D]``."""
    H, n_q, D = queries.shape
    kvh = kmax.shape[0]
    q = queries.reshape(kvh, (H // kvh) * n_q, D).to(kmax.dtype)  # [kvH, g * n_q, D]: a group's queries
    if score == "quest":  # Σ_d max(q_d kmax_d, q_d kmin_d): positive channels meet kmax, negative kmin
        s = q.clamp(min=0) @ kmax.transpose(1, 2) + q.clamp(max=0) @ kmin.transpose(1, 2)  # [kvH, gq, n]
    elif score == "vector":  # SpecPV's whole-vector score
        s = torch.maximum(q @ kmax.transpose(1, 2), q @ kmin.transpose(1, 2))  # [kvH, gq, n]
    else:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}.")
    return s.mean(1)  # [kvH, n_blocks]


def selected_positions(lay: Layout, blocks: Tensor, block_size: int) -> Tensor:
    """``[kvH, n_sel]`` sorted positions kept per KV head: sinks, the chosen ``blocks [kvH, R]``, window."""
    kvh, device = blocks.shape[0], blocks.device
    blocks = blocks.sort(-1).values
    inside = torch.arange(block_size, device=device)  # [bs]
    retrieved = (lay.sink_end + blocks[..., None] * block_size + inside).reshape(kvh, -1)  # [kvH, R * bs]
    sinks = torch.arange(lay.sink_end, device=device).expand(kvh, -1)  # [kvH, S]
    window = torch.arange(lay.window_start, lay.length, device=device).expand(kvh, -1)  # [kvH, W']
    return torch.cat([sinks, retrieved, window], 1)  # [kvH, n_sel]


class PartialKVCache:
    """The compact cache: ``cache`` (a DynamicCache) holds ``n_static`` selected tokens per layer and KV
    head, then the buffer of tokens verified partially since :meth:`refresh` (``n_buffer``)."""

    def __init__(self, cfg: PartialKVConfig):
        self.cfg = cfg.validate()
        self.summaries = BlockSummaries(cfg.sink, cfg.block_size)
        self.cache: DynamicCache | None = None
        self.n_static = 0
        self.covers = 0  # the full-cache length at the last refresh
        self.positions: dict[int, Tensor] = {}  # layer -> [kvH, n_static] positions kept (for probes)

    @property
    def n_buffer(self) -> int:
        return 0 if self.cache is None else self.cache.get_seq_length() - self.n_static

    @torch.inference_mode()
    def refresh(self, full_cache, queries: dict[int, Tensor] | None, config) -> None:
        """Rebuild the static part from the exact ``full_cache`` and empty the buffer. ``queries[l]`` is
        ``[1, H, n_q, D]``: the post-RoPE queries of the full pass's draft tokens at layer ``l``."""
        cfg = self.cfg
        length = full_cache.get_seq_length()
        lay = layout(length, cfg)
        self.cache, self.positions = new_cache(config), {}
        for li, layer in enumerate(full_cache.layers):
            keys, values = layer.keys, layer.values  # [1, kvH, T, D]
            kvh, device = keys.shape[1], keys.device
            if lay.n_candidates <= cfg.n_retrieved:  # every candidate block is kept
                blocks = torch.arange(lay.n_candidates, device=device).expand(kvh, -1)  # [kvH, n]
            else:
                if queries is None or li not in queries:
                    raise ValueError(f"refresh needs the draft queries of layer {li} to score blocks.")
                kmax, kmin = self.summaries.update(li, keys, lay.n_candidates)
                scores = block_scores(queries[li][0], kmax, kmin, cfg.score)  # [kvH, n_candidates]
                blocks = scores.topk(cfg.n_retrieved, -1).indices  # [kvH, R]
            pos = selected_positions(lay, blocks, cfg.block_size)  # [kvH, n_sel]
            index = pos[None, :, :, None].expand(1, kvh, pos.shape[1], keys.shape[-1])  # [1, kvH, n_sel, D]
            self.cache.update(keys.gather(2, index), values.gather(2, index), li)
            self.positions[li] = pos
        self.n_static = self.cache.get_seq_length()
        self.covers = length

    def mask(self, anc: Tensor, dtype: torch.dtype, device) -> Tensor:
        """The explicit additive mask ``[1, 1, q, n_cached + q]`` of a block whose tree is ``anc [q, q]``:
        every compact entry is visible (all precede the block), the block sees its own ancestors."""
        from ..drafters.tree_mask import tree_attention_mask

        return tree_attention_mask(anc, self.cache.get_seq_length(), dtype, device)


def compact_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """sdpa over a compacted cache: ``query [B, H, q, D]``, ``key``/``value [B, kvH, n, D]`` (GQA repeated
    here), and an explicit additive ``attention_mask [B, 1, q, >= n]``. Returns ``([B, q, H, D], None)``
    as transformers' attention functions do."""
    if attention_mask is None:
        raise RuntimeError(
            "compact attention needs an explicit mask: rows of a compacted cache are not positions, so a "
            "causal mask built from cache indices would be wrong. Pass PartialKVCache.mask(...)."
        )
    n_rep = query.shape[1] // key.shape[1]
    if n_rep > 1:
        key = key.repeat_interleave(n_rep, 1)  # [B, H, n, D]
        value = value.repeat_interleave(n_rep, 1)
    mask = attention_mask[:, :, :, : key.shape[-2]]  # [B, 1, q, n]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, is_causal=False)
    return out.transpose(1, 2).contiguous(), None  # [B, q, H, D]


def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(_IMPL, compact_attention)
    AttentionMaskInterface.register(_IMPL, sdpa_mask)


@contextmanager
def compact_attention_mode(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, ``model``'s attention layers run :func:`compact_attention` (restored in finally)."""
    _register()
    config = model.config
    old = config._attn_implementation
    try:
        config._attn_implementation = _IMPL
        yield
    finally:
        config._attn_implementation = old
