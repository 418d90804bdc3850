"""The hidden-only drafter (EAGLE-3 style).

* ``fc`` fuses the target's hidden states of three layers (by default 1, L/2-1, L-4): ``[3H] -> [H]``.
* The first decoder layer reads ``[norm(embedding of token t+1), norm(feature of position t)]`` (``2H``)
  through its Q/K/V projections; its residual stream starts from the feature, as in EAGLE-3. Further
  layers (``n_layers > 1``) are plain pre-norm decoder layers.
* Its self-attention runs over the drafter's own sequence: its own keys/values of every context position
  (computed from the target's features) and of the drafted tokens of the current branch.
* At deeper draft steps the drafter's own output hidden state replaces the target's fused feature.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .attention import MLP, Attention, RMSNorm, segmented_attention
from .common import TrainableDrafter
from .config import DrafterConfig


class HiddenLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, first: bool):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.first = first
        if first:
            self.emb_norm = RMSNorm(H, eps)
            self.feat_norm = RMSNorm(H, eps)
        else:
            self.input_norm = RMSNorm(H, eps)
        in_dim = 2 * H if first else H
        self.self_attn = Attention(in_dim, H, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        self.post_norm = RMSNorm(H, eps)
        self.mlp = MLP(H, cfg.intermediate_size)

    def forward(self, x: Tensor, emb: Tensor, cos: Tensor, sin: Tensor, ctx, li: int) -> Tensor:
        if self.first:
            a = torch.cat([self.emb_norm(emb), self.feat_norm(x)], dim=-1)  # [B, n, 2H]
        else:
            a = self.input_norm(x)  # [B, n, H]
        q = self.self_attn.query(a, cos, sin)  # [B, h, n, D]
        k, v = self.self_attn.key_value(a, cos, sin)  # [B, kvH, n, D]
        o = segmented_attention(q, ctx.self_segments(li, k, v), ctx.recorder)  # [B, h, n, D]
        h = x + self.self_attn.out(o)  # [B, n, H]
        return h + self.mlp(self.post_norm(h))


class HiddenDrafter(TrainableDrafter):
    def __init__(self, cfg: DrafterConfig, target, d2t: Tensor):
        super().__init__(cfg, target, d2t)
        H = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.hidden_layers) * H, H, bias=False)
        self.layers = nn.ModuleList(HiddenLayer(cfg, first=i == 0) for i in range(cfg.n_layers))

    def fuse(self, hidden: Tensor) -> Tensor:
        return self.fc(hidden)  # [B, n, 3H] -> [B, n, H]
