"""The K/V a decode-time session keeps across cycles, per drafter layer, grown by doubling.

* :class:`LayerKV`: ``k[layer], v[layer] [1, heads, capacity, D]``; :meth:`LayerKV.write` fills rows ``a..b-1``,
  growing the buffer first when it is too short;
* :class:`TargetKV`: the target's KV of the drafter's chosen layers as each drafter layer reads it (after its
  :class:`~.kv.KVInjector`, through ``drafter.inject``), rows ``0..n-1`` = positions ``0..n-1``. Each cycle
  :meth:`TargetKV.ingest` reads only the positions new since the last one; a shorter context than before is
  a new one, read from the start; positions SpecPV rewrote (``TargetView.rewritten_from``) are read again.

Both sessions use them: :class:`~.session.TrainedDraftSession` (KV-only and hybrid drafters) and
:class:`~.block_session.BlockDraftSession` (the block drafter, ``context: kv`` or ``both``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import SessionFactory


def grow(buf: Tensor, need: int, dim: int) -> Tensor:
    """``buf`` with at least ``need`` rows along ``dim`` (twice as many when it must grow), the old rows kept."""
    if buf.shape[dim] >= need:
        return buf
    shape = list(buf.shape)
    shape[dim] = max(need, 2 * shape[dim])
    new = buf.new_zeros(shape)
    new.narrow(dim, 0, buf.shape[dim]).copy_(buf)
    return new


class LayerKV:
    """Per-layer K and V rows, ``[1, heads, capacity, head_dim]`` each."""

    def __init__(self, n_layers: int, heads: int, head_dim: int, capacity: int, device, dtype):
        shape = (1, heads, capacity, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]

    def write(self, li: int, a: int, b: int, k: Tensor, v: Tensor) -> None:
        """Rows ``a..b-1`` of layer ``li`` become ``k, v [1, heads, b - a, D]``."""
        if self.k[li].shape[2] < b:
            self.k[li], self.v[li] = grow(self.k[li], b, 2), grow(self.v[li], b, 2)
        self.k[li][:, :, a:b] = k
        self.v[li][:, :, a:b] = v


class TargetKV(LayerKV):
    """The target's KV as the drafter's layers read it, positions ``0..n-1``."""

    def __init__(self, drafter: SessionFactory, capacity: int):
        cfg = drafter.cfg
        heads, dim = cfg.n_injected_heads, cfg.target_head_dim
        super().__init__(cfg.n_layers, heads, dim, capacity, drafter.head.device, drafter.head.dtype)
        self.drafter, self.n = drafter, 0

    def ingest(self, cache, P: int, rewritten_from: int | None = None) -> None:
        """Hold positions ``0..P-1`` of the target's ``cache`` (a DynamicCache holding at least those).
        ``rewritten_from``: the cache's positions from there on were rewritten since the last cycle (SpecPV
        re-fed them in a full pass), so the partial-pass K/V held for them is dropped and read again."""
        d = self.drafter
        layers = d.cfg.kv_layers
        have = cache.layers[layers[0]].keys.shape[2]
        if have < P:
            raise ValueError(
                f"drafter session: the target cache holds {have} positions, the contract says {P}."
            )
        if rewritten_from is not None:
            self.n = min(self.n, rewritten_from)
        if self.n > P:
            self.n = 0  # a new context: re-read everything
        if self.n == P:
            return
        a = self.n
        keys = torch.cat([cache.layers[layer].keys[:, :, a:P] for layer in layers], dim=1)  # [1, nI, n, D]
        values = torch.cat([cache.layers[layer].values[:, :, a:P] for layer in layers], dim=1)
        keys = keys.transpose(1, 2).to(d.head.dtype)  # [1, n, nI, D], the feature-store layout
        values = values.transpose(1, 2).to(d.head.dtype)
        for li, (k, v) in d.inject(keys, values, torch.arange(a, P, device=keys.device), bound=P).items():
            self.write(li, a, P, k, v)
        self.n = P
