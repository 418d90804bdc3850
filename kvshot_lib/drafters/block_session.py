"""Decode-time session of the block drafter (the :class:`~kvshot_lib.drafters.base.DraftSession` contract).

``start_cycle`` runs the drafter **once**: the root and the ``K`` masks at positions ``P .. P+K`` over the
target's context ``0..P-1``, and keeps the ``K`` rows of draft logits. Draft step ``d`` (a node at tree depth
``d``) is block offset ``d + 1`` whatever tokens were chosen before it, so ``expand`` computes nothing: a
node at depth ``d`` gets the row of depth ``d + 1``, and all ``-inf`` (no draft) past the block. A chain thus
drafts ``K`` tokens from one forward, and the engine's dynamic tree combines the top-k tokens of every block
position under its token budget (scores: sums of the positions' log-probabilities).

State kept across cycles, per layer, grown by doubling (:mod:`.kv_buffer`): the target's KV of the chosen
layers as the layer reads it (context ``kv``, ``both``: a :class:`~.kv_buffer.TargetKV`) and the layer's own
K/V of the fused target hidden states (``hidden``, ``both``). Only positions new since the last cycle are read. ``tests/test_block_drafter.py`` checks that a
session computes what the training forward computes at the same anchor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .attention import Segment
from .base import SessionFactory, TargetView
from .kv_buffer import LayerKV, TargetKV
from .static_steps import BlockSteps, DraftBuffers, borrow


class BlockDraftSession:
    recorder = None  # the layers' attention recorder hook: never used at decode time

    def __init__(self, drafter: SessionFactory, capacity: int = 512):
        d = self.d = drafter
        cfg = d.cfg
        self.d2t: Tensor | None = d.d2t
        self.hidden_layers: tuple[int, ...] = tuple(d.hidden_layers)
        self.K, L = cfg.block_size, cfg.n_layers
        dev, dt = d.head.device, d.head.dtype
        if dev.type == "cuda":  # room for a long generation without growing (kept for the next session)
            capacity = max(capacity, 4096)
        kvh, D = d.layers[0].self_attn.n_kv_heads, d.layers[0].self_attn.head_dim
        self.buffers = borrow(
            d,
            self,
            lambda: DraftBuffers(
                LayerKV(L, kvh, D, capacity, dev, dt)
                if cfg.uses_hidden
                else None,  # the fused hidden states' K/V
                TargetKV(d, capacity) if cfg.uses_target_kv else None,
            ),
        )
        self.tgt, self.own = self.buffers.tgt, self.buffers.own
        self.n_own = 0
        self.P = -1
        self.rows: Tensor | None = None  # [K, V_draft] this cycle's draft logits by block offset 1..K
        self.depths: list[int] = []  # tree depth of every node added this cycle

    # ------------------------------------------------------------------ the attention context the layers use

    def block_segments(self, li: int, k: Tensor, v: Tensor) -> list[Segment]:
        P = self.P
        context = [
            buf for buf in (self.tgt, self.own) if buf is not None
        ]  # the target's KV and/or the hidden
        segs = [Segment(b.k[li][:, :, :P], b.v[li][:, :, :P], "dense") for b in context]  # all of 0..P-1
        segs.append(Segment(k, v, "dense"))  # one block: every row sees every row
        return segs

    # ------------------------------------------------------------------------------------- the contract

    @torch.inference_mode()
    def start_cycle(self, committed: Tensor, view: TargetView) -> Tensor:
        d = self.d
        committed = committed.to(d.head.device)
        P = self.P = committed.shape[1] - 1
        if self.tgt is not None:
            self.tgt.ingest(view.cache, P, getattr(view, "rewritten_from", None))
        if self.own is not None:
            self._ingest_hidden(view.hidden, P)
        positions = torch.arange(P, P + self.K + 1, device=d.head.device)  # [K+1]
        x = d.block_inputs(committed[:, P : P + 1])  # [1, K+1, H]
        cos, sin = d.rope(positions, bound=P + self.K + 1)  # positions P..P+K: no read back
        h = d.run_layers(x, x, cos, sin, self)  # [1, K+1, H]
        self.rows = d.logits(h[0, 1:])  # [K, V_draft]
        self.depths = []
        return self.rows[0]

    @torch.inference_mode()
    def expand(self, tokens: Tensor, parents: Tensor) -> Tensor:
        first = len(self.depths)
        for p in parents.tolist():  # parents come before their children, in this call or an earlier one
            self.depths.append(0 if p < 0 else self.depths[p] + 1)
        depth = self.depths[first:]
        out = self.rows.new_full((len(depth), self.rows.shape[1]), float("-inf"))  # [n, V_draft]
        for i, dd in enumerate(depth):
            if dd + 1 < self.K:
                out[i] = self.rows[dd + 1]
        return out

    def end_cycle(self) -> None:
        self.depths = []

    def static_steps(self, width: int, levels: int) -> BlockSteps:
        """The block's draft rows as fixed-shape steps (:mod:`.static_steps`); ``levels`` is capped at the block."""
        steps = self.buffers.steps
        if width not in steps:
            steps[width] = BlockSteps(self.rows, width)
        return steps[width]

    # ----------------------------------------------------------------------------------------- internals

    def _ingest_hidden(self, hidden: dict, P: int) -> None:
        d = self.d
        feats = torch.cat([hidden[layer][0] for layer in self.hidden_layers], dim=-1)  # [n_new, nL*H]
        a = P - feats.shape[0]  # the first new position
        if a > self.n_own:
            raise ValueError(
                f"block drafter session: hidden states for positions {self.n_own}..{a - 1} were never given "
                f"(view.hidden covers {a}..{P - 1}); pass every newly committed position."
            )
        if a == P:
            return
        fused = d.fuse(feats.to(d.head.dtype))[None]  # [1, n_new, H]
        cos, sin = d.rope(torch.arange(a, P, device=fused.device), bound=P)
        for li, layer in enumerate(d.layers):
            k, v = layer.self_attn.key_value(fused, cos, sin)  # [1, kvH, n_new, D]
            self.own.write(li, a, P, k, v)
        self.n_own = P
