"""The hybrid drafter: EAGLE-3's self-attention on fused hidden states, corrected by cross-attention on the
target's KV through a learned gate.

Per layer, from the layer input ``a`` (layer 1: ``[norm(embedding), norm(feature)]`` as in the hidden
drafter):

* ``n`` = self-attention over the drafter's own sequence (exactly the hidden drafter's attention);
* ``o`` = cross-attention over the target's KV of the chosen layers (injected as in the KV drafter, by
  ``kv_mode``), for the whole committed context;
* ``h = n + g * W(o - n)`` with ``g = sigmoid(gate.proj(a))`` per channel and ``W = gate.mix``. ``W`` starts
  at the identity and ``g`` at 0.5, so the layer starts halfway between the two. The last gate values are
  kept in ``gate.last`` for logging.

At deeper draft steps the drafter's own output hidden state replaces the target's fused feature, as in
the hidden drafter; the cross-attention keeps reading the target's KV of the committed context.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .attention import MLP, Attention, RMSNorm, segmented_attention
from .config import DrafterConfig
from .hidden import HiddenDrafter, init_input, layer_input, self_attention
from .kv import KVInjector


class GatedCorrection(nn.Module):
    """``h = n + g * W(o - n)``, ``g = sigmoid(proj(a))``."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.proj = nn.Linear(in_dim, dim)
        self.mix = nn.Linear(dim, dim, bias=False)
        with torch.no_grad():
            self.proj.weight.zero_()
            self.proj.bias.zero_()
            self.mix.weight.copy_(torch.eye(dim))
        self.last: Tensor | None = None

    def forward(self, a: Tensor, n: Tensor, o: Tensor) -> Tensor:
        g = torch.sigmoid(self.proj(a))  # [B, n, H]
        self.last = g.detach()
        return n + g * self.mix(o - n)


class HybridLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, first: bool):
        super().__init__()
        H = cfg.hidden_size
        n_inj, D = cfg.n_injected_heads, cfg.target_head_dim
        in_dim = init_input(self, cfg, first)
        self.self_attn = Attention(in_dim, H, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        self.cross_attn = Attention(in_dim, H, n_inj * cfg.query_group, n_inj, D, own_kv=False)
        self.inject = KVInjector(cfg.kv_mode, n_inj, D)
        self.gate = GatedCorrection(in_dim, H)
        self.post_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(H, cfg.intermediate_size)

    def forward(self, x: Tensor, emb: Tensor, cos: Tensor, sin: Tensor, ctx, li: int) -> Tensor:
        a = layer_input(self, x, emb)  # [B, n, 2H] (layer 1) or [B, n, H]
        n = self_attention(self, a, cos, sin, ctx, li)  # [B, n, H]
        qx = self.cross_attn.query(a, cos, sin)  # [B, hx, n, Dt]
        o = self.cross_attn.out(segmented_attention(qx, ctx.cross_segments(li), ctx.recorder))  # [B, n, H]
        h = x + self.gate(a, n, o)  # [B, n, H]
        return h + self.mlp(self.post_norm(h))


class HybridDrafter(HiddenDrafter):
    layer_class = HybridLayer

    def gate_values(self) -> list[Tensor]:
        """The last gate values of every layer (``[B, n, H]`` each), or empty before any forward."""
        return [layer.gate.last for layer in self.layers if layer.gate.last is not None]
