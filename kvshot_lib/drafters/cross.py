"""The cross-only drafter: the hybrid drafter's cross-attention path on the target's KV, without its
self-attention path (the KVShot paper's "cross-only" row).

Per layer, from the layer input ``a`` (layer 1: ``[norm(embedding), norm(feature)]``, exactly as in the
hidden and hybrid drafters): ``h = x + CrossAttn(a)`` over the target's KV of the chosen layers (injected by
``kv_mode`` as in the KV drafter) for the committed context, then the MLP. There is no attention over the
drafter's own positions, so at deeper draft steps the branch is carried only by the residual stream: the
drafter's own output hidden state replaces the target's fused feature, as in the hidden drafter.

Its parameter names are the hybrid's (``fc``, ``layers.i.cross_attn``, ``layers.i.inject``, norms, MLP), so
``init_from`` a hidden-only or hybrid checkpoint copies every tensor the two share.
"""

from __future__ import annotations

from torch import Tensor, nn

from .attention import MLP, Attention, RMSNorm, segmented_attention
from .config import DrafterConfig
from .hidden import HiddenDrafter, init_input, layer_input
from .kv import KVInjector


class CrossLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, first: bool):
        super().__init__()
        H = cfg.hidden_size
        n_inj, D = cfg.n_injected_heads, cfg.target_head_dim
        in_dim = init_input(self, cfg, first)
        self.cross_attn = Attention(in_dim, H, n_inj * cfg.query_group, n_inj, D, own_kv=False)
        self.inject = KVInjector(cfg.kv_mode, n_inj, D)
        self.post_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(H, cfg.intermediate_size)

    def forward(self, x: Tensor, emb: Tensor, cos: Tensor, sin: Tensor, ctx, li: int) -> Tensor:
        a = layer_input(self, x, emb)  # [B, n, 2H] (layer 1) or [B, n, H]
        q = self.cross_attn.query(a, cos, sin)  # [B, hx, n, Dt]
        h = x + self.cross_attn.out(segmented_attention(q, ctx.cross_segments(li), ctx.recorder))  # [B, n, H]
        return h + self.mlp(self.post_norm(h))


class CrossDrafter(HiddenDrafter):
    layer_class = CrossLayer
