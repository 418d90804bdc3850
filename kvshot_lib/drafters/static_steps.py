"""A draft session's steps at fixed shapes over preallocated buffers: what a CUDA graph of the draft loop records.

The host loop (:mod:`kvshot_lib.decoding.tree`) calls ``session.expand`` with Python lists and reads every level
back to build its tree. A graph-ready loop (:mod:`kvshot_lib.decoding.device_draft`) instead calls
:meth:`StaticDraftSteps.step` once per level with tensors that never leave the device, at shapes fixed by the
loop's width ``w`` (1 for a chain, the beam's ``k`` for a tree) and its number of levels:

* level ``l``'s ``w`` nodes sit at depth ``l`` (position ``P + 1 + l``) and write their K/V, output hidden state
  and ancestor row at the node slots ``l * w .. l * w + w - 1`` of the steps' own buffers (``node``, ``out``,
  ``anc``: ``[w * levels]`` rows, allocated once);
* attention reads the session's context buffers whole (the drafter's own context K/V, the target's KV) under a
  mask ``column < length`` built on the device from lengths copied in by :meth:`StaticDraftSteps.begin`, and the
  node buffer under the nodes' ancestor rows: shapes and addresses stay fixed from cycle to cycle;
* nothing reads a value back to the host (the RoPE table is sized from a host-known bound), so the whole loop can
  be captured once and replayed; :meth:`StaticDraftSteps.signature` changes when a buffer was reallocated (the
  context grew past its capacity), and a captured loop is then recorded anew.

The same code runs eagerly on a CPU. :class:`BlockSteps` is the block drafter's: its drafts were all computed by
``start_cycle``, so a step only hands out the row of its depth. ``tests/test_device_draft.py`` holds both to the
host path's logits and to plain greedy decoding.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .attention import Segment
from .kv_buffer import LayerKV, TargetKV


@dataclass
class DraftBuffers:
    """A session's buffers that outlive it: the drafter's own context K/V, the target's KV as it reads them, and
    its fixed-shape steps. A CUDA graph of a draft loop reads their addresses, so the next session of the same
    drafter takes them over (:func:`borrow`) and replays the graphs recorded before."""

    own: LayerKV | None
    tgt: TargetKV | None
    steps: dict = field(default_factory=dict)  # (width, levels) -> StaticDraftSteps or BlockSteps
    holder: Callable[[], object] | None = None  # a weak reference to the session that holds them


def borrow(drafter, session, make: Callable[[], DraftBuffers]) -> DraftBuffers:
    """``drafter``'s buffers for ``session``: those of its last session once that one is gone (the target's KV
    read from the start again), else new ones from ``make()`` (two live sessions never share). They are kept on
    the drafter (``drafter.draft_buffers``), so they go when it goes."""
    held = getattr(drafter, "draft_buffers", None)
    if held is None or (held.holder is not None and held.holder() is not None):
        held = make()
        drafter.draft_buffers = held
    if held.tgt is not None:
        held.tgt.n = 0
    held.holder = weakref.ref(session)
    return held


class StaticDraftSteps:
    """Fixed-shape draft steps of a :class:`~.session.TrainedDraftSession` (every paradigm but block): ``width``
    nodes per level, ``levels`` levels. It is the attention context the drafter's layers ask for segments while
    :meth:`step` runs."""

    recorder = None  # the layers' attention recorder hook: never used at decode time

    def __init__(self, drafter, buffers: DraftBuffers, width: int, levels: int):
        self.d, self.own, self.tgt = drafter, buffers.own, buffers.tgt
        d, cfg = drafter, drafter.cfg
        self.kv_only = cfg.paradigm == "kv"
        dev, dt = d.head.device, d.head.dtype
        self.width, self.levels = width, levels
        n = width * levels
        kvh, D = self.own.k[0].shape[1], self.own.k[0].shape[3]
        self.node = LayerKV(cfg.n_layers, kvh, D, n, dev, dt)  # the nodes' own K/V, slot by slot
        self.out = torch.zeros(n, cfg.hidden_size, device=dev, dtype=dt)  # [n, H] each node's output
        self.anc = torch.zeros(n, n, dtype=torch.bool, device=dev)  # [n, n] slot row sees slot column
        self.eye = torch.eye(n, dtype=torch.bool, device=dev)  # [n, n]
        self.slots = [torch.arange(i * width, (i + 1) * width, device=dev) for i in range(levels)]  # [w] each
        self.root_logits = torch.zeros(d.head.shape[0], device=dev, dtype=dt)  # [V_draft]
        self.root_out = torch.zeros(cfg.hidden_size, device=dev, dtype=dt)  # [H]
        self.root_pos = torch.zeros((), dtype=torch.long, device=dev)  # P
        self.n_own = torch.zeros((), dtype=torch.long, device=dev)  # committed rows of the own context
        self.n_tgt = torch.zeros((), dtype=torch.long, device=dev)  # positions of the target's KV held
        self.bound = 0  # host-known bound on this cycle's positions
        self._slots = self.slots[0]
        self._q_pos = torch.zeros(width, dtype=torch.long, device=dev)  # [w]
        self._rows: Tensor = self.anc[:width]  # [w, n] the running level's ancestor rows

    @property
    def max_levels(self) -> int:
        return self.levels

    def begin(self, session, root_logits: Tensor) -> None:
        """Copy ``session``'s root logits, root output and lengths in, after its ``start_cycle`` (host side, before
        the loop; nothing is read back)."""
        self.root_logits.copy_(root_logits)
        self.root_out.copy_(session.root_out)
        self.root_pos.fill_(session.P)
        self.n_own.fill_(session.n_own)
        self.n_tgt.fill_(self.tgt.n if self.tgt is not None else 0)
        self.bound = session.P + self.levels + 1
        self.d.rope_ready(self.bound)

    def signature(self) -> tuple:
        """The addresses of every buffer a captured loop reads: a loop captured under another is stale."""
        kv = [self.own] + ([self.tgt] if self.tgt is not None else [])
        bufs = [t for b in kv for t in (*b.k, *b.v)]
        return (*(b.data_ptr() for b in bufs), self.d.rope_ready(self.bound))

    def step(self, tokens: Tensor, rows: Tensor | None, level: int) -> Tensor:
        """Run level ``level``'s ``w`` nodes: ``tokens [w]`` target ids, ``rows [w]`` which of the level above's
        ``w`` nodes is each one's parent (level 0: the root, ``None``). Returns their draft logits ``[w, V_draft]``."""
        d = self.d
        slots = self._slots = self.slots[level]
        parents = None if rows is None else self.slots[level - 1][rows]  # [w] the parents' slots
        rows = self.eye[slots] if parents is None else self.anc[parents] | self.eye[slots]  # [w, n]
        self.anc.index_copy_(0, slots, rows)
        self._rows = rows
        self._q_pos = (self.root_pos + 1 + level).expand(self.width)  # [w]
        cos, sin = d.rope(self._q_pos, bound=self.bound)
        emb = d.embed(tokens)[None]  # [1, w, H]
        if d.cfg.uses_hidden:
            prev = (
                self.root_out[None].expand(self.width, -1) if parents is None else self.out[parents]
            )  # [w, H]
            x = d.feedback(prev)[None]  # [1, w, H]
        else:
            x = emb
        h = d.run_layers(x, emb, cos, sin, self)[0]  # [w, H]
        self.out.index_copy_(0, slots, h)
        return d.logits(h)  # [w, V_draft]

    # ------------------------------------------------------------------ the attention context the layers use

    def _length_mask(self, buf: Tensor, n: Tensor) -> Tensor:
        cols = torch.arange(buf.shape[2], device=buf.device)  # [S]
        return (cols[None] < n).expand(self.width, -1)  # [w, S]

    def _target_segment(self, li: int) -> Segment:
        tk, tv = self.tgt.k[li], self.tgt.v[li]
        seg = Segment(tk, tv, "dense", self._length_mask(tk, self.n_tgt))
        seg.dist = self._q_pos[:, None] - torch.arange(tk.shape[2], device=tk.device)[None]  # [w, S]
        return seg

    def self_segments(self, li: int, k: Tensor, v: Tensor) -> list[Segment]:
        self.node.k[li].index_copy_(2, self._slots, k)
        self.node.v[li].index_copy_(2, self._slots, v)
        ok, ov = self.own.k[li], self.own.v[li]
        segs = [self._target_segment(li)] if self.kv_only else []
        segs.append(Segment(ok, ov, "dense", self._length_mask(ok, self.n_own)))
        segs.append(Segment(self.node.k[li], self.node.v[li], "dense", self._rows))
        return segs

    def cross_segments(self, li: int) -> list[Segment]:
        return [self._target_segment(li)]


class BlockSteps:
    """The block drafter's steps: every draft row came from ``start_cycle``'s one forward, so level ``l``'s nodes
    get the row of depth ``l + 1`` whatever their tokens (``levels``: the block's size, the deepest a tree goes)."""

    def __init__(self, rows: Tensor, width: int):
        self.width, self.levels = width, rows.shape[0]
        self.rows = torch.zeros_like(rows)  # [K, V_draft]
        self.root_logits = self.rows[0]  # [V_draft], a view

    @property
    def max_levels(self) -> int:
        return self.levels

    def begin(self, session, root_logits: Tensor) -> None:
        self.rows.copy_(session.rows)

    def signature(self) -> tuple:
        return ()

    def step(self, tokens: Tensor, rows: Tensor | None, level: int) -> Tensor:
        return self.rows[level + 1].expand(self.width, -1)  # [w, V_draft]
