"""Training-time unrolling: the batch a drafter trains on, EAGLE-3's TTT attention pattern, and the unroll itself.

**Index convention.** A training sequence has tokens ``x_0 .. x_{T-1}``. Index ``i`` (``0 <= i < N = T-1``)
is one draft *branch*: its root is token ``x_{i+1}`` at position ``i+1``, paired (EAGLE style) with the
target's feature of position ``i``; the target's cache holds positions ``0..i``. Unrolled step ``k`` of
branch ``i`` sits at position ``i+1+k``, reads token ``x_{i+1+k}`` (teacher-forced, as in EAGLE-3) and
predicts ``x_{i+2+k}``, whose soft label is the target's distribution at position ``i+1+k``.

**What step k of branch i sees** (:class:`UnrollContext` builds it from segments, see ``attention.py``):

* the target's KV of positions ``0..i`` (KV-only and hybrid drafters) — a causal ``dense`` segment;
* the drafter's own step-0 keys of indices ``0..i`` — a causal ``dense`` segment (hidden, hybrid: they keep
  their own cache over the context, computed from the target's features), or only index ``i`` (KV-only:
  its own keys exist only for the root and the drafted tokens, the context is the target's KV);
* its own keys of steps ``1..k`` at index ``i`` — ``diag`` segments: the branch's own drafted tokens.

:func:`ttt_attention_mask` writes the same pattern as one dense boolean matrix (for tests and figures), and
:func:`unroll` (every trainable drafter's ``forward``, the block drafter's aside) runs the steps.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from .attention import Segment
from .base import SessionFactory


@dataclass
class TrainBatch:
    """A padded batch of feature-store sequences (token axis second)."""

    ids: Tensor  # [B, T] int64
    loss_mask: Tensor  # [B, T] bool, True on assistant tokens
    lengths: Tensor  # [B] int64, valid tokens per row
    final_hidden: Tensor  # [B, T, H] target's post-norm last hidden state (labels come from it)
    hidden: Tensor | None = None  # [B, T, n_hidden_layers * H] target hidden states, layers side by side
    keys: Tensor | None = None  # [B, T, n_kv_layers * kvH, D] target keys (post-RoPE), layers side by side
    values: Tensor | None = None  # [B, T, n_kv_layers * kvH, D]

    @property
    def n_index(self) -> int:
        return self.ids.shape[1] - 1

    def to(self, device) -> TrainBatch:
        def mv(x):
            return None if x is None else x.to(device, non_blocking=True)

        return TrainBatch(**{f.name: mv(getattr(self, f.name)) for f in fields(self)})


def shifted(x: Tensor, k: int, n: int, fill=0) -> Tensor:
    """``x[:, k : k+n]`` along dim 1, padded with ``fill`` past the end: ``[B, n, ...]``."""
    part = x[:, k : k + n]
    if part.shape[1] == n:
        return part
    pad = x.new_full((x.shape[0], n - part.shape[1], *x.shape[2:]), fill)
    return torch.cat([part, pad], dim=1)


def ttt_attention_mask(n: int, n_steps: int, own_context: bool = True) -> Tensor:
    """EAGLE-3's TTT mask over own keys as one dense matrix ``[n_steps * n, n_steps * n]`` (step-major).

    Row ``k*n + i`` is step ``k`` of branch ``i``; column ``s*n + j`` is the own key of step ``s`` at index
    ``j``. Visible: step-0 keys ``j <= i`` (``j == i`` when ``own_context`` is False, the KV-only drafter),
    and keys of steps ``1..k`` at ``j == i``. The target KV part (KV-only, hybrid) is ``j <= i`` at every step.
    """
    eye = torch.eye(n, dtype=torch.bool)
    first = torch.ones(n, n, dtype=torch.bool).tril() if own_context else eye
    mask = torch.zeros(n_steps * n, n_steps * n, dtype=torch.bool)
    for k in range(n_steps):
        rows = slice(k * n, (k + 1) * n)
        mask[rows, :n] = first
        for s in range(1, k + 1):
            mask[rows, s * n : (s + 1) * n] = eye
    return mask


class UnrollContext:
    """The attention segments of one unrolled forward; keeps every step's own keys/values per layer.

    ``own[layer][step] = (k, v)``, each ``[B, kvH, n, D]`` post-RoPE (``n = N`` at step 0, ``M`` at later steps
    when only the branches ``branches [M]`` are unrolled), is what the ttt_dense K/V losses and the
    gradient probes read after the forward. ``step`` is set by the drafter before each step.
    """

    def __init__(
        self,
        n: int,
        device,
        target_kv: dict[int, tuple[Tensor, Tensor]] | None,
        own_context: bool,
        target_in_self: bool,
        recorder=None,
        branches: Tensor | None = None,
    ):
        self.n = n
        self.causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()  # [N, N] j <= i
        self.branches = branches
        self.causal_rows = self.causal if branches is None else self.causal[branches]  # [M, N]
        self.target_kv = target_kv or {}
        self.own_context = own_context
        self.target_in_self = target_in_self
        self.recorder = recorder
        self.step = 0
        self._dist: tuple[int, Tensor] | None = None
        self.own: dict[int, list[tuple[Tensor, Tensor]]] = defaultdict(list)

    def _mask(self) -> Tensor:
        return self.causal if self.step == 0 else self.causal_rows

    def _target_segment(self, layer: int) -> Segment:
        k, v = self.target_kv[layer]  # [B, kvH, T, D]
        seg = Segment(k[:, :, : self.n], v[:, :, : self.n], "dense", self._mask(), ("target", layer))
        seg.dist = self._target_dist()
        return seg

    def _target_dist(self) -> Tensor:
        """``[n, N]``: query position minus target key position (step k of branch i sits at ``i+1+k``)."""
        if self._dist is None or self._dist[0] != self.step:
            idx = torch.arange(self.n, device=self.causal.device)
            rows = idx if self.step == 0 or self.branches is None else self.branches
            self._dist = (self.step, (rows + 1 + self.step)[:, None] - idx[None])
        return self._dist[1]

    def self_segments(self, layer: int, k: Tensor, v: Tensor) -> list[Segment]:
        steps = self.own[layer]
        steps.append((k, v))
        segs = [self._target_segment(layer)] if self.target_in_self else []
        for s, (ks, vs) in enumerate(steps):
            if s == 0 and self.own_context:
                segs.append(Segment(ks, vs, "dense", self._mask(), ("own", layer, 0)))
            elif s == 0 and self.step > 0 and self.branches is not None:  # KV-only: the kept branches' roots
                b = self.branches
                segs.append(Segment(ks[:, :, b], vs[:, :, b], "diag", None, ("own", layer, 0), b))
            else:
                segs.append(Segment(ks, vs, "diag", None, ("own", layer, s)))
        if self.recorder is not None:
            self.recorder.own_kv(layer, len(steps) - 1, k, v)
        return segs

    def cross_segments(self, layer: int) -> list[Segment]:
        return [self._target_segment(layer)]


@dataclass
class Unrolled:
    outs: list[Tensor]  # per step: [B, N, H] output hidden state (before the final norm)
    ctx: UnrollContext
    fused: Tensor | None  # [B, N, H] fc(target features) at step 0 (hidden, hybrid)
    injected: dict[int, tuple[Tensor, Tensor]]  # layer -> injected target (K, V), each [B, kvH, T, D]
    rows: list[Tensor | None]  # per step: the branch indices it ran ([M]), None = all N


def unroll(
    drafter: SessionFactory,
    batch: TrainBatch,
    n_steps: int,
    detach_chain: bool = False,
    recorder=None,
    branches: Tensor | None = None,
) -> Unrolled:
    """Unroll ``n_steps`` draft steps of a trainable drafter over the batch's branches at once (EAGLE-3's TTT layout).

    Step 0 runs every branch (it also builds the hidden/hybrid drafters' own context cache). Steps
    ``>= 1`` run the branches ``branches [M]`` (sorted indices; ``None`` = all, which is EAGLE-3): a
    random subset estimates the full loss for a fraction of the cost (each kept branch is exact; the
    loss averaged over kept positions is a ratio estimator, close to but not exactly unbiased).
    """
    d, cfg = drafter, drafter.cfg
    B, T = batch.ids.shape
    N = T - 1
    dev = d.head.device
    injected = {}
    if cfg.uses_target_kv:
        dt = d.compute_dtype()
        injected = d.inject(batch.keys.to(dt), batch.values.to(dt), torch.arange(T, device=dev))
    ctx = UnrollContext(
        N,
        dev,
        injected,
        own_context=cfg.own_context,
        target_in_self=d.paradigm == "kv",
        recorder=recorder,
        branches=branches,
    )
    pos = torch.arange(1, T, device=dev)  # index i -> position i+1  [N]
    fused = d.fuse(batch.hidden[:, :N].to(d.compute_dtype())) if cfg.uses_hidden else None  # [B, N, H]
    feat, outs, rows = fused, [], []
    for k in range(n_steps):
        sel = None if k == 0 else branches
        ctx.step = k
        ids = shifted(batch.ids, 1 + k, N)  # x_{i+1+k}  [B, N]
        p = pos + k
        if sel is not None:
            ids, p = ids[:, sel], p[sel]  # [B, M], [M]
            if k == 1 and feat is not None:
                feat = feat[:, sel]  # [B, M, H]
        emb = d.embed(ids)  # [B, n, H]
        cos, sin = d.rope(p)
        h = d.run_layers(feat if cfg.uses_hidden else emb, emb, cos, sin, ctx)  # [B, n, H]
        outs.append(h)
        rows.append(sel)
        if cfg.uses_hidden:  # deeper steps reuse the drafter's own output in place of the target's
            feat = d.feedback(h.detach() if detach_chain else h)
    return Unrolled(outs, ctx, fused, injected, rows)
