"""Decode-time sessions of the trained drafters (the :class:`~kvshot_lib.drafters.base.DraftSession` contract).

One class serves every trainable paradigm: it is the attention context the drafter's layers ask for segments,
exactly as :class:`~kvshot_lib.drafters.unroll.UnrollContext` is during training, so decoding computes what
training computed (``tests/test_drafters_session.py`` checks that step by step).

State, all preallocated and grown by doubling:

* ``own_k/own_v[layer] [1, kvH, cap, D]``: the drafter's own K/V. Hidden/hybrid: rows ``0..P-1`` hold
  positions ``1..P`` (feature of ``t`` paired with token ``t+1``), computed once as features arrive (the
  no-target control: from token ``t+1`` alone, as the tokens are committed); KV-only:
  row 0 holds the root. Rows after that hold the current cycle's draft-tree nodes.
* ``tgt`` (KV-only, hybrid): a :class:`~.kv_buffer.TargetKV`, the target's KV of the chosen layers as the
  layer reads it (after its injector); only positions new since the last cycle are read from the cache.
* the tree: each node's ancestor row (it sees its ancestors and itself), depth and output hidden state.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .attention import Segment
from .base import SessionFactory, TargetView
from .kv_buffer import LayerKV, TargetKV, grow
from .static_steps import DraftBuffers, StaticDraftSteps, borrow


class TrainedDraftSession:
    recorder = None  # the layers' attention recorder hook: never used at decode time

    def __init__(self, drafter: SessionFactory, capacity: int = 512, node_capacity: int = 64):
        d = self.d = drafter
        cfg = d.cfg
        self.d2t: Tensor | None = d.d2t
        self.hidden_layers: tuple[int, ...] = tuple(d.hidden_layers)
        self.kv_only = cfg.paradigm == "kv"
        dev, dt = d.head.device, d.head.dtype
        # on a GPU, room for a long generation: a grown buffer moves, and the graphs over it are stale
        if dev.type == "cuda":
            capacity = max(capacity, 4096)
        kvh, D = (
            (cfg.n_injected_heads, cfg.target_head_dim) if self.kv_only else (cfg.n_kv_heads, cfg.head_dim)
        )
        self.buffers = borrow(
            d,
            self,
            lambda: DraftBuffers(
                LayerKV(cfg.n_layers, kvh, D, capacity, dev, dt),
                TargetKV(d, capacity) if cfg.uses_target_kv else None,
            ),
        )
        self.own, self.tgt = self.buffers.own, self.buffers.tgt
        self.n_own = 0
        self.anc = torch.zeros(node_capacity, node_capacity, dtype=torch.bool, device=dev)
        self.depth = torch.zeros(node_capacity, dtype=torch.long, device=dev)
        self.node_out = torch.zeros(node_capacity, cfg.hidden_size, device=dev, dtype=dt)
        self.n_nodes = 0
        self.P = -1
        self.root_out: Tensor | None = None
        self._mode = "context"
        self._rows = (0, 0)
        self._own_mask: Tensor | None = None
        self._tgt_mask: Tensor | None = None
        self._q_pos = torch.zeros(0, dtype=torch.long, device=dev)  # positions of the queries being run

    # ------------------------------------------------------------------ the attention context the layers use

    def _target_segment(self, li: int, mask: Tensor | None) -> Segment:
        n = self.tgt.n
        seg = Segment(self.tgt.k[li][:, :, :n], self.tgt.v[li][:, :, :n], "dense", mask)
        keys = torch.arange(n, device=self._q_pos.device)
        seg.dist = self._q_pos[:, None] - keys[None]  # [n_q, n] query position - key position
        return seg

    def self_segments(self, li: int, k: Tensor, v: Tensor) -> list[Segment]:
        self.own.write(li, *self._rows, k, v)
        ok, ov = self.own.k[li], self.own.v[li]
        segs = [self._target_segment(li, None)] if self.kv_only else []
        if self._mode == "context":
            r1 = self._rows[1]
            segs.append(Segment(ok[:, :, :r1], ov[:, :, :r1], "dense", self._own_mask))
        else:
            n0, (r0, r1) = self.n_own, self._rows
            m0, m1 = r0 - n0, r1 - n0
            segs.append(Segment(ok[:, :, :n0], ov[:, :, :n0], "dense", None))
            segs.append(Segment(ok[:, :, n0:r1], ov[:, :, n0:r1], "dense", self.anc[m0:m1, :m1]))
        return segs

    def cross_segments(self, li: int) -> list[Segment]:
        return [self._target_segment(li, self._tgt_mask if self._mode == "context" else None)]

    # ------------------------------------------------------------------------------------- the contract

    @torch.inference_mode()
    def start_cycle(self, committed: Tensor, view: TargetView) -> Tensor:
        d = self.d
        committed = committed.to(self.anc.device)
        P = committed.shape[1] - 1
        self.P, self.n_nodes, self._mode = P, 0, "context"
        if self.tgt is not None:
            self.tgt.ingest(view.cache, P, getattr(view, "rewritten_from", None))
        if d.cfg.uses_hidden or d.cfg.own_context:
            if d.cfg.uses_hidden:
                feats = torch.cat(
                    [view.hidden[layer][0] for layer in self.hidden_layers], dim=-1
                )  # [n_new, 3H]
                n_new = feats.shape[0]
            else:  # the no-target control: its context rows come from the committed tokens alone
                n_new = P - self.n_own
            r0 = P - n_new  # own row of the first new position (row = position - 1)
            if n_new < 1 or r0 > self.n_own:
                raise ValueError(
                    f"drafter session: context rows {self.n_own}..{r0 - 1} were never ingested (this cycle "
                    f"brings {r0}..{P - 1}); pass the hidden states of every newly committed position, and "
                    "only a growing context."
                )
            positions = torch.arange(r0 + 1, P + 1, device=self.anc.device)  # [n_new]
            emb = d.embed(committed[:, r0 + 1 : P + 1])  # [1, n_new, H]
            x = d.fuse(feats.to(d.head.dtype))[None] if d.cfg.uses_hidden else emb  # [1, n_new, H]
            self._rows = (r0, P)
            rows = torch.arange(n_new, device=positions.device)[:, None]
            self._own_mask = (
                (torch.arange(P, device=positions.device)[None] <= r0 + rows) if n_new > 1 else None
            )
            self._tgt_mask = (
                torch.arange(self.tgt.n, device=positions.device)[None] < positions[:, None]
                if n_new > 1 and self.tgt is not None
                else None
            )
            cos, sin = d.rope(positions, bound=P + 1)  # positions r0+1..P: no read back
            self._q_pos = positions
            h = d.run_layers(x, emb, cos, sin, self)  # [1, n_new, H]
            self.n_own = P
        else:  # KV-only: the context is the target's KV; own K/V start at the root
            self._rows, self._own_mask, self.n_own = (0, 1), None, 0
            emb = d.embed(committed[:, P : P + 1])  # [1, 1, H]
            self._q_pos = torch.tensor([P], device=self.anc.device)
            cos, sin = d.rope(self._q_pos, bound=P + 1)
            h = d.run_layers(emb, emb, cos, sin, self)
            self.n_own = 1
        self.root_out = h[0, -1]  # [H]
        return d.logits(self.root_out)  # [V_draft]

    @torch.inference_mode()
    def expand(self, tokens: Tensor, parents: Tensor) -> Tensor:
        tokens, parents = tokens.to(self.anc.device).long(), parents.to(self.anc.device).long()
        n = tokens.shape[0]
        if n and int(parents.max()) >= self.n_nodes:  # a parent added in this same call: go level by level
            ready = parents < self.n_nodes
            cut = int(torch.nonzero(~ready)[0]) if not bool(ready.all()) else n
            first = self.expand(tokens[:cut], parents[:cut]) if cut else tokens.new_zeros(0, self.d2t.numel())
            return torch.cat([first, self.expand(tokens[cut:], parents[cut:])])
        return self._expand(tokens, parents)

    def _expand(self, tokens: Tensor, parents: Tensor) -> Tensor:
        d = self.d
        n, m0 = tokens.shape[0], self.n_nodes
        m1 = m0 + n
        if self.anc.shape[0] < m1:
            self.anc = grow(grow(self.anc, m1, 0), m1, 1)
            self.depth, self.node_out = grow(self.depth, m1, 0), grow(self.node_out, m1, 0)
        has_parent = parents >= 0
        par = parents.clamp(min=0)
        depth = torch.where(has_parent, self.depth[par] + 1, torch.zeros_like(par))  # [n]
        rows = self.anc[par, :m1] & has_parent[:, None]  # [n, m1] the parents' ancestors
        rows[torch.arange(n, device=rows.device), m0 + torch.arange(n, device=rows.device)] = True
        self.anc[m0:m1, :m1] = rows
        self.depth[m0:m1] = depth
        positions = self.P + 1 + depth  # [n]
        emb = d.embed(tokens)[None]  # [1, n, H]
        if d.cfg.uses_hidden:
            out = torch.where(has_parent[:, None], self.node_out[par], self.root_out[None])  # [n, H]
            x = d.feedback(out)[None]  # [1, n, H]
        else:
            x = emb
        self._mode, self._rows = "tree", (self.n_own + m0, self.n_own + m1)
        self._q_pos = positions
        cos, sin = d.rope(positions)
        h = d.run_layers(x, emb, cos, sin, self)[0]  # [n, H]
        self.node_out[m0:m1] = h
        self.n_nodes = m1
        return d.logits(h)  # [n, V_draft]

    def end_cycle(self) -> None:
        self.n_nodes = 0
        self._mode = "context"

    def static_steps(self, width: int, levels: int) -> StaticDraftSteps:
        """This session's draft steps at fixed shapes (``width`` nodes per level, ``levels`` levels), over buffers
        allocated once (:mod:`.static_steps`): what a graph-ready draft loop calls after :meth:`start_cycle`."""
        key, steps = (width, levels), self.buffers.steps
        if key not in steps:
            steps[key] = StaticDraftSteps(self.d, self.buffers, width, levels)
        return steps[key]
