"""The block drafter: DFlash-style parallel drafting of a whole block from the target's context, in one forward.

After the last committed token (the *root*, at position ``t``, not yet in the target's cache) the drafter reads
a block of ``K + 1`` inputs at positions ``t .. t+K``: the root's embedding, then ``K`` learned *mask*
embeddings, one per block offset. One forward through its 1-5 decoder layers gives, at mask offset ``j``, the
distribution of the token at position ``t + j``: all ``K`` drafts at once (draft step ``k`` = offset ``k + 1``).

Attention, in every layer, is one softmax over segments (``attention.py``):

* inside the block: **bidirectional**, every block row sees the root and every mask (a ``block`` segment);
* the target's context, positions ``0..t-1`` only (**causal** with respect to the root), as ``context`` says:
  - ``kv``: the target's KV cache of the chosen layers, exactly as the KV-only drafter reads it (a
    :class:`~kvshot_lib.drafters.kv.KVInjector` per layer, by ``kv_mode``);
  - ``hidden``: the target's hidden states of the chosen layers fused by ``fc`` and a norm, then projected by
    every layer's own K/V projections (DFlash's context injection; EAGLE-3's fusion);
  - ``both``: the two segments side by side in the same softmax.
* Head layout: with the target's KV (``kv``, ``both``) the KV-only drafter's (``query_group`` queries per
  injected target head, the target's head dim), with hidden states only the target's own.

The drafted tokens are never fed back: the ``K`` outputs of a block depend on the root and the context only,
so decoding runs one forward per cycle and ``expand`` only hands out rows already computed
(:mod:`.block_session`). ``target_kv="zeroed"`` is the control: every target K/V and hidden state it reads is 0.

**Training** (regime ``parallel``, ``training/losses.py``) uses TTT's index convention: branch ``i`` is the block
whose root is ``x_{i+1}`` (context: target positions ``0..i``) and its step ``k`` predicts ``x_{i+2+k}``, so the
per-step losses, held-out accuracy and gradient probes of the other drafters apply unchanged.
``forward(batch, K, branches=anchors)`` runs the blocks of the given anchors (``[M]``, or ``[B, M]`` per
sequence) in one pass. ``tests/test_block_drafter.py`` checks that no output reads a target position after
its root, that decoding sessions compute what training computes, that one forward drafts the whole block,
greedy equality with plain decoding, and that the drafter learns from the context.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..target import Target
from .attention import MLP, Attention, RMSNorm, Segment, segmented_attention
from .config import DrafterConfig
from .kv import KVInjector
from .trainable import TrainableDrafter
from .unroll import Unrolled


def attention_layout(cfg: DrafterConfig) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of the block drafter's attention."""
    if cfg.uses_target_kv:  # its keys share a softmax with the injected target KV
        n_inj = cfg.n_injected_heads
        return n_inj * cfg.query_group, n_inj, cfg.target_head_dim
    return cfg.n_heads, cfg.n_kv_heads, cfg.head_dim


class BlockLayer(nn.Module):
    """A pre-norm decoder layer whose attention reads the target's context and the whole block."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        n_q, n_kv, D = attention_layout(cfg)
        self.input_norm = RMSNorm(H, eps)
        self.self_attn = Attention(H, H, n_q, n_kv, D)
        if cfg.uses_target_kv:
            self.inject = KVInjector(cfg.kv_mode, cfg.n_injected_heads, cfg.target_head_dim)
        self.post_norm = RMSNorm(H, eps)
        self.mlp = MLP(H, cfg.intermediate_size)

    def forward(self, x: Tensor, emb: Tensor, cos: Tensor, sin: Tensor, ctx, li: int) -> Tensor:
        a = self.input_norm(x)  # [B, n, H]
        q = self.self_attn.query(a, cos, sin)  # [B, h, n, D]
        k, v = self.self_attn.key_value(a, cos, sin)  # [B, kvH, n, D]
        o = segmented_attention(q, ctx.block_segments(li, k, v), ctx.recorder)  # context + block, one softmax
        h = x + self.self_attn.out(o)  # [B, n, H]
        return h + self.mlp(self.post_norm(h))


class BlockContext:
    """The attention segments of one training forward: every block row sees the target context before its
    root (``visible [B, 1, 1, n, T]``) and every row of its own block."""

    def __init__(
        self,
        drafter: BlockDrafter,
        injected: dict,
        fused: Tensor | None,
        visible: Tensor,
        L: int,
        recorder=None,
    ):
        self.d, self.injected, self.fused, self.visible, self.L = drafter, injected, fused, visible, L
        self.recorder = recorder
        if fused is not None:
            self.ctx_rope = drafter.rope(torch.arange(fused.shape[1], device=fused.device))  # [1, 1, T, D]

    def block_segments(self, li: int, k: Tensor, v: Tensor) -> list[Segment]:
        segs = []
        if li in self.injected:
            tk, tv = self.injected[li]  # [B, heads, T, D]
            segs.append(Segment(tk, tv, "dense", self.visible, ("target", li)))
        if self.fused is not None:
            ck, cv = self.d.layers[li].self_attn.key_value(self.fused, *self.ctx_rope)  # [B, kvH, T, D]
            segs.append(Segment(ck, cv, "dense", self.visible, ("own", li, 0)))
            if self.recorder is not None:
                self.recorder.own_kv(li, 0, ck, cv)
        if self.recorder is not None:
            self.recorder.own_kv(li, 1, k, v)
        segs.append(Segment(k, v, "block", tag=("own", li, 1), size=self.L))
        return segs


def anchor_rows(branches: Tensor | None, B: int, N: int, device) -> Tensor:
    """The anchors (branch indices) of every sequence as ``[B, M]``: all ``N``, shared ``[M]``, or ``[B, M]``."""
    if branches is None:
        return torch.arange(N, device=device)[None].expand(B, N)
    if branches.dim() == 1:
        return branches.to(device)[None].expand(B, -1)
    return branches.to(device)


class BlockDrafter(TrainableDrafter):
    def __init__(self, cfg: DrafterConfig, target: Target, d2t: Tensor):
        super().__init__(cfg, target, d2t)
        H, K = cfg.hidden_size, cfg.block_size
        self.block_size = K
        self.max_steps = K  # draft steps one forward can give (held-out evaluation stops there)
        std = float(self.target_probe.std())  # the scale of the target's token embeddings
        self.mask_embedding = nn.Parameter(torch.randn(K, H) * std)  # [K, H]: one per block offset
        if cfg.uses_hidden:
            self.fc = nn.Linear(len(cfg.hidden_layers) * H, H, bias=False)
            self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(cfg) for _ in range(cfg.n_layers))

    def fuse(self, hidden: Tensor) -> Tensor:
        """The target's hidden states of the chosen layers ``[B, n, nL*H]`` as the context features ``[B, n, H]``."""
        if self.cfg.target_kv == "zeroed":  # the control reads zeros, here as in the KV path
            hidden = torch.zeros_like(hidden)
        return self.hidden_norm(self.fc(hidden))

    def block_inputs(self, roots: Tensor) -> Tensor:
        """``roots [B, M]`` -> the inputs of ``M`` blocks ``[B, M * (K+1), H]``: each root, then the K masks."""
        B, M = roots.shape
        K, H = self.mask_embedding.shape
        masks = self.mask_embedding.to(self.head.dtype)[None, None].expand(B, M, K, H)
        return torch.cat([self.embed(roots)[:, :, None], masks], dim=2).reshape(B, M * (K + 1), H)

    def rope_rows(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin for per-sequence ``positions [B, n]``: each ``[B, 1, n, D]``."""
        B, n = positions.shape
        cos, sin = self.rope(positions.reshape(-1))  # [1, 1, B*n, D]
        return cos.reshape(B, 1, n, -1), sin.reshape(B, 1, n, -1)

    def forward(
        self,
        batch,
        n_steps: int,
        detach_chain: bool = False,
        recorder=None,
        branches: Tensor | None = None,
    ) -> Unrolled:
        """The blocks of the anchors ``branches`` (all when None), in one pass: ``outs[k] [B, M, H]`` is step ``k``
        (block offset ``k + 1``) of every anchor, for ``k < min(n_steps, K)``. ``detach_chain`` has no
        meaning here (nothing is unrolled)."""
        B, T = batch.ids.shape
        N, K, L = T - 1, self.block_size, self.block_size + 1
        dev = self.head.device
        anchors = anchor_rows(branches, B, N, dev)  # [B, M]
        M = anchors.shape[1]
        offsets = torch.arange(L, device=dev)
        positions = (anchors + 1)[:, :, None] + offsets  # [B, M, L]: the root of branch i sits at i+1
        x = self.block_inputs(batch.ids.to(dev).gather(1, anchors + 1))  # [B, M*L, H]
        cos, sin = self.rope_rows(positions.reshape(B, M * L))  # [B, 1, M*L, D]
        keys = torch.arange(T, device=dev)
        visible = (keys[None, None] <= anchors.repeat_interleave(L, dim=1)[:, :, None])[:, None, None]
        injected = {}
        if self.cfg.uses_target_kv:
            dt = self.compute_dtype()
            injected = self.inject(batch.keys.to(dt), batch.values.to(dt), keys)  # layer -> [B, heads, T, D]
        fused = (
            self.fuse(batch.hidden.to(dev, self.compute_dtype())) if self.cfg.uses_hidden else None
        )  # [B, T, H]
        if recorder is not None and hasattr(recorder, "register_rows"):
            valid = keys[None, :N] < (batch.lengths[:, None].to(dev) - 1)  # [B, N] real branches
            recorder.register_rows(valid.gather(1, anchors).repeat_interleave(L, dim=1))  # [B, M*L]
        ctx = BlockContext(self, injected, fused, visible, L, recorder)
        h = self.run_layers(x, x, cos, sin, ctx).view(B, M, L, -1)  # [B, M, L, H]
        outs = [h[:, :, 1 + k] for k in range(min(n_steps, K))]  # [B, M, H] each
        return Unrolled(outs, ctx, None, injected, [branches] * len(outs))

    def new_session(self):
        from .block_session import BlockDraftSession

        return BlockDraftSession(self)
