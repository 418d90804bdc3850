"""The hidden-only drafter (EAGLE-3 style).

* ``fc`` fuses the target's hidden states of three layers (by default 1, L/2-1, L-4): ``[3H] -> [H]``.
* The first decoder layer reads ``[norm(embedding of token t+1), norm(feature of position t)]`` (``2H``)
  through its Q/K/V projections; its residual stream starts from the feature, as in EAGLE-3. Further
  layers (``n_layers > 1``) are plain pre-norm decoder layers.
* Its self-attention runs over the drafter's own sequence: its own keys/values of every context position
  (computed from the target's features) and of the drafted tokens of the current branch.
* At deeper draft steps the drafter's own output hidden state replaces the target's fused feature.

EAGLE 3.1 (arXiv 2605.09992) adds two switches, both off by default (an EAGLE-3 drafter is unchanged bit for
bit, ``tests/test_eagle31.py``):

* ``fc_norm``: one RMSNorm per captured target layer, applied to each layer's feature before the
  concatenation and ``fc``, so that every layer enters at the same scale;
* ``norm_output``: a deeper draft step is fed the previous step's output *after* the final norm
  (:meth:`~kvshot_lib.drafters.trainable.TrainableDrafter.feedback`), not the pre-norm residual stream.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..target import Target
from .attention import MLP, Attention, RMSNorm, segmented_attention
from .config import DrafterConfig
from .trainable import TrainableDrafter


def init_input(layer: nn.Module, cfg: DrafterConfig, first: bool) -> int:
    """Give ``layer`` its input norms; returns its input width. Layer 1 reads
    ``[norm(embedding), norm(feature)]`` (``2H``), later layers ``norm(x)`` (``H``)."""
    H, eps = cfg.hidden_size, cfg.rms_norm_eps
    layer.first = first
    if first:
        layer.emb_norm = RMSNorm(H, eps)
        layer.feat_norm = RMSNorm(H, eps)
    else:
        layer.input_norm = RMSNorm(H, eps)
    return 2 * H if first else H


def layer_input(layer: nn.Module, x: Tensor, emb: Tensor) -> Tensor:
    if layer.first:
        return torch.cat([layer.emb_norm(emb), layer.feat_norm(x)], dim=-1)  # [B, n, 2H]
    return layer.input_norm(x)  # [B, n, H]


def self_attention(layer: nn.Module, a: Tensor, cos: Tensor, sin: Tensor, ctx, li: int) -> Tensor:
    """Attention of ``a`` over the drafter's own sequence (context and current branch): ``[B, n, H]``."""
    q = layer.self_attn.query(a, cos, sin)  # [B, h, n, D]
    k, v = layer.self_attn.key_value(a, cos, sin)  # [B, kvH, n, D]
    return layer.self_attn.out(segmented_attention(q, ctx.self_segments(li, k, v), ctx.recorder))


class HiddenLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, first: bool):
        super().__init__()
        H = cfg.hidden_size
        in_dim = init_input(self, cfg, first)
        self.self_attn = Attention(in_dim, H, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        self.post_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(H, cfg.intermediate_size)

    def forward(self, x: Tensor, emb: Tensor, cos: Tensor, sin: Tensor, ctx, li: int) -> Tensor:
        h = x + self_attention(self, layer_input(self, x, emb), cos, sin, ctx, li)  # [B, n, H]
        return h + self.mlp(self.post_norm(h))


class HiddenDrafter(TrainableDrafter):
    layer_class = HiddenLayer

    def __init__(self, cfg: DrafterConfig, target: Target, d2t: Tensor):
        super().__init__(cfg, target, d2t)
        H = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.hidden_layers) * H, H, bias=False)
        if cfg.fc_norm:
            self.fc_norms = nn.ModuleList(RMSNorm(H, cfg.rms_norm_eps) for _ in cfg.hidden_layers)
        self.layers = nn.ModuleList(self.layer_class(cfg, first=i == 0) for i in range(cfg.n_layers))

    def fuse(self, hidden: Tensor) -> Tensor:
        if self.cfg.fc_norm:  # each captured layer normed on its own: [B, n, H] x 3
            parts = hidden.split(self.cfg.hidden_size, dim=-1)
            hidden = torch.cat([norm(x) for norm, x in zip(self.fc_norms, parts)], dim=-1)
        return self.fc(hidden)  # [B, n, 3H] -> [B, n, H]
