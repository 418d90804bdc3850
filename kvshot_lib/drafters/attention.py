"""Building blocks shared by every trainable drafter: RMSNorm, SwiGLU MLP, RoPE, and segmented attention.

**Segmented attention.** A drafter query attends, in one softmax, over several *segments* of keys:

* ``dense`` segments: a key tensor ``[B, kvH, S, D]`` with an optional visibility mask ``[n, S]`` (True =
  visible), e.g. the target's KV cache, the drafter's own context cache, or the nodes of a draft tree;
* ``diag`` segments: keys ``[B, kvH, n, D]`` aligned one-to-one with the ``n`` queries, each query seeing
  only its own row. This is how EAGLE-3's training-time test (TTT) lets step ``k`` at index ``i`` see the
  own keys of steps ``1..k`` *of its own branch* without building a ``[K*T, K*T]`` mask;
* ``block`` segments: keys ``[B, kvH, n, D]`` aligned with the ``n`` queries in consecutive blocks of
  ``size`` rows, each query seeing every key of its own block (the block drafter's bidirectional block,
  ``drafters/block.py``) without building an ``[n, n]`` mask.

The result equals plain softmax attention over the concatenated keys with the equivalent dense mask
(``tests/test_training_ttt.py`` checks both the mask and this equivalence). Every segment may carry a
``tag``; a recorder (see :mod:`kvshot_lib.training.grad_probes`) then receives the attention each key position
receives, which notebook 05 correlates with the per-position K/V gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:  # normalized in float32, returned in x's dtype
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


class MLP(nn.Module):
    """SwiGLU, as in Llama/Qwen3."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [B, h, n, D]`` by the angles of its positions (``cos``, ``sin`` broadcast to it)."""
    return x * cos + rotate_half(x) * sin


def undo_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Inverse of :func:`apply_rope` (rotation by the negative angle)."""
    return x * cos - rotate_half(x) * sin


@dataclass
class BandBias:
    """A recency bias kept as its table, not as ``[h, n, S]`` scores: ``table[h, min(d, W+1) - 1]`` for a query at
    position ``q_pos`` and a key at index ``j``, ``d = q_pos - j``. Every key farther than ``W`` gets the last bucket,
    a constant per head, so the bias is that constant everywhere plus a band of ``W`` diagonals: added to the scores
    as one broadcast add and one ``scatter_add`` of ``[n, W]`` per head. Its backward is a sum over the scores'
    gradient and a gather of the band, where the dense bias's was a scatter of every score's gradient into ``W + 1``
    buckets (atomics on a few hundred addresses on a GPU: kv-ttt trained 2.6x slower than hidden-ttt).
    Keys at ``d <= 0`` get bucket 0 in the dense bias and the constant here: every caller masks them.
    ``tests/test_drafters.py`` holds it equal to the dense bias in value and gradient."""

    table: Tensor  # [h, W+1]
    q_pos: Tensor  # [n] the queries' positions; key j sits at position j

    def add_to(self, sc: Tensor) -> Tensor:
        """``sc [B, h, n, S]`` plus the bias (out of place)."""
        h, W1 = self.table.shape
        W, S = W1 - 1, sc.shape[-1]
        table = self.table.to(sc.dtype)
        const = table[:, W]  # [h] every key farther than W
        sc = sc + const[None, :, None, None]  # [B, h, n, S]
        if W == 0:
            return sc
        b = torch.arange(W, device=sc.device)  # [W] bucket b: d = b + 1
        key = self.q_pos[:, None] - 1 - b[None]  # [n, W] the key at distance b + 1
        valid = (key >= 0) & (key < S)  # [n, W]
        band = (table[:, :W] - const[:, None])[:, None, :] * valid[None]  # [h, n, W]
        index = key.clamp(0, max(S - 1, 0))[None, None].expand(sc.shape[0], h, -1, -1)  # [B, h, n, W]
        return sc.scatter_add(-1, index, band[None].expand(sc.shape[0], -1, -1, -1))


@dataclass
class Segment:
    k: Tensor  # [B, kvH, S, D] (dense) or [B, kvH, n, D] (diag)
    v: Tensor  # same shape as k
    kind: str = "dense"  # "dense" | "diag" | "block"
    mask: Tensor | None = None  # [n, S] or [B, 1, 1, n, S] bool, True = visible (dense only)
    tag: tuple | None = None  # e.g. ("own", layer, step) or ("target", layer); for the attention recorder
    rows: Tensor | None = None  # diag keys gathered from these positions of the tagged tensor (recorder)
    dist: Tensor | None = None  # [n, S] long: query position - key position (dense target segments)
    bias: Tensor | BandBias | None = None  # [h, n, S] additive score bias per query head, or a BandBias
    size: int = 0  # rows per block ("block" segments only)


def segmented_attention(q: Tensor, segments: list[Segment], recorder=None) -> Tensor:
    """Softmax attention of ``q [B, h, n, D]`` over all segments at once; returns ``[B, h, n, D]``.

    The softmax is written out (running max, exponentials, one normalizer) instead of concatenating the
    segments' scores: on a CPU that halves the backward pass for TTT's many diagonal segments.
    """
    segments = [s for s in segments if s.kind == "diag" or s.k.shape[2] > 0]  # e.g. an empty target cache
    if _fused(q, segments, recorder):
        s = segments[0]
        mask = (
            s.mask if s.mask is None or s.mask.dim() == 2 else s.mask.flatten(1, 2)
        )  # [n, S] or [B, 1, n, S]
        return F.scaled_dot_product_attention(q, s.k, s.v, attn_mask=mask, enable_gqa=True)
    B, h, n, D = q.shape
    kvh = segments[0].k.shape[1]
    g = h // kvh
    qg = q.reshape(B, kvh, g * n, D) * D**-0.5  # [B, kvH, g*n, D]: a query group's rows side by side
    scores = []
    for s in segments:
        if s.kind == "dense":
            sc = qg @ s.k.transpose(-1, -2)  # [B, kvH, g*n, S]
            if isinstance(s.bias, BandBias):  # the table's constant and band, added to the scores
                sc = s.bias.add_to(sc.view(B, kvh * g, n, -1)).view(B, kvh, g * n, -1)
            elif s.bias is not None:  # the mask goes into the (batch-free) bias: one pass over the scores
                bias = s.bias.to(sc.dtype)  # [h, n, S]
                if s.mask is not None and s.mask.dim() == 2:
                    bias = bias.masked_fill(~s.mask, float("-inf"))
                sc = sc + bias.reshape(1, kvh, g * n, -1)  # [1, kvH, g*n, S]
            if s.mask is not None and (not isinstance(s.bias, Tensor) or s.mask.dim() != 2):
                sc = sc.view(B, kvh, g, n, -1).masked_fill_(~s.mask, float("-inf")).view(B, kvh, g * n, -1)
        elif s.kind == "block":
            L = s.size
            kb = s.k.view(B, kvh, 1, n // L, L, D)  # [B, kvH, 1, n/L, L, D]
            sc = (qg.view(B, kvh, g, n // L, L, D) @ kb.transpose(-1, -2)).view(B, kvh, g * n, L)  # [.., L]
        else:
            sc = (qg.view(B, kvh, g, n, D) * s.k.unsqueeze(2)).sum(-1).view(B, kvh, g * n, 1)  # [.., 1]
        scores.append(sc)
    with torch.no_grad():
        m = torch.stack([sc.amax(-1) for sc in scores]).amax(0).unsqueeze(-1)  # [B, kvH, g*n, 1]
    exps = [torch.exp(sc - m) for sc in scores]
    z = sum(e.sum(-1, keepdim=True) for e in exps)  # [B, kvH, g*n, 1]
    out = None
    for s, e in zip(segments, exps):
        if s.kind == "dense":
            o = e @ s.v  # [B, kvH, g*n, D]
        elif s.kind == "block":
            L = s.size
            vb = s.v.view(B, kvh, 1, n // L, L, D)  # [B, kvH, 1, n/L, L, D]
            o = (e.view(B, kvh, g, n // L, L, L) @ vb).view(B, kvh, g * n, D)
        else:
            o = (e.view(B, kvh, g, n, 1) * s.v.unsqueeze(2)).view(B, kvh, g * n, D)
        out = o if out is None else out + o
    out = out / z  # [B, kvH, g*n, D]
    if recorder is not None:  # the shares in float32, so that a bf16 softmax's still sum to one
        z32 = sum(e.detach().float().sum(-1, keepdim=True) for e in exps)
        recorder.attention(segments, [(e.detach().float() / z32).view(B, kvh, g, n, -1) for e in exps])
    return out.view(B, h, n, D)


def _fused(q: Tensor, segments: list[Segment], recorder) -> bool:
    """One dense segment with no learned bias and no recorder, in float32: torch's fused CPU kernel (SDPA) is
    ~3x faster there than the softmax written out. Under bf16 the written-out softmax is as fast, and it is
    what the recorder and the learned recency bias need. ``tests/test_training_ttt.py`` holds both to the
    same dense reference."""
    return (
        recorder is None
        and q.dtype == torch.float32
        and len(segments) == 1
        and segments[0].kind == "dense"
        and segments[0].bias is None
    )


class Attention(nn.Module):
    """Q/K/V/O projections of one drafter attention. ``own_kv=False`` makes a query-only (cross) attention."""

    def __init__(
        self, in_dim: int, out_dim: int, n_heads: int, n_kv_heads: int, head_dim: int, own_kv: bool = True
    ):
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}.")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.q_proj = nn.Linear(in_dim, n_heads * head_dim, bias=False)
        if own_kv:
            self.k_proj = nn.Linear(in_dim, n_kv_heads * head_dim, bias=False)
            self.v_proj = nn.Linear(in_dim, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, out_dim, bias=False)

    def _heads(self, x: Tensor, n_heads: int) -> Tensor:
        B, n, _ = x.shape
        return x.view(B, n, n_heads, self.head_dim).transpose(1, 2)  # [B, heads, n, D]

    def query(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return apply_rope(self._heads(self.q_proj(x), self.n_heads), cos, sin)  # [B, h, n, D]

    def key_value(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        k = apply_rope(self._heads(self.k_proj(x), self.n_kv_heads), cos, sin)  # [B, kvH, n, D]
        v = self._heads(self.v_proj(x), self.n_kv_heads)  # [B, kvH, n, D]
        return k, v

    def out(self, o: Tensor) -> Tensor:
        B, h, n, D = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, n, h * D))  # [B, n, out_dim]
