"""The KV-only drafter: its attention reads the target's KV cache directly.

* Each layer's queries come from the drafter's own state (layer 1: the embedding of the current token).
* Its keys/values are the target's cached K/V of the chosen layers for the whole context, side by side
  (``n_kv_layers * kvH`` heads of the target's head dim), plus its own K/V for the root and the tokens it
  has drafted in the current branch, in the same head layout and in one softmax.
* How the target's KV enters (``kv_mode``), per drafter layer:
  - ``concat``: the heads as they are (post-RoPE, exactly what the cache holds);
  - ``linear``: a learned linear map of all heads together, on the stored post-RoPE K/V;
  - ``linear_rope``: RoPE is undone, the keys are mapped linearly, and RoPE is re-applied at the same
    positions (so relative positions survive the map). Values are mapped as in ``linear``.
  Both maps start at the identity, i.e. as ``concat``.
* There are no hidden states: at deeper steps the drafter sees its own earlier K/V through attention.
* Depth is 1..4 layers; every layer reads the target's KV through its own injector.
* Queries: ``query_group`` per injected KV head (default: the target's GQA group), so each query head
  corresponds to one (target layer, target query head) pair.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..target import Target
from .attention import MLP, Attention, BandBias, RMSNorm, apply_rope, segmented_attention, undo_rope
from .config import DrafterConfig
from .trainable import TrainableDrafter


class KVInjector(nn.Module):
    """Maps the target's stored K/V ``[B, n, heads, D]`` into the drafter's attention: ``[B, heads, n, D]``."""

    def __init__(self, mode: str, n_heads: int, head_dim: int):
        super().__init__()
        self.mode = mode
        if mode != "concat":
            dim = n_heads * head_dim
            self.k_map = nn.Linear(dim, dim, bias=False)
            self.v_map = nn.Linear(dim, dim, bias=False)
            with torch.no_grad():
                self.k_map.weight.copy_(torch.eye(dim))
                self.v_map.weight.copy_(torch.eye(dim))

    def forward(self, keys: Tensor, values: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        k, v = keys.transpose(1, 2), values.transpose(1, 2)  # [B, heads, n, D]
        if self.mode == "concat":
            return k, v
        if self.mode == "linear_rope":
            k = undo_rope(k, cos, sin)  # [B, heads, n, D] pre-RoPE keys
        k, v = self._map(self.k_map, k), self._map(self.v_map, v)
        if self.mode == "linear_rope":
            k = apply_rope(k, cos, sin)
        return k, v

    @staticmethod
    def _map(lin: nn.Linear, x: Tensor) -> Tensor:
        B, h, n, D = x.shape
        y = lin(x.transpose(1, 2).reshape(B, n, h * D))  # [B, n, heads*D]
        return y.view(B, n, h, D).transpose(1, 2)  # [B, heads, n, D]


class BucketGather(torch.autograd.Function):
    """``table[:, bucket]``: ``[h, B]`` by ``[n, S]`` long -> ``[h, n, S]``, whose backward adds each position's
    gradient into its bucket (``scatter_add_``: atomics on a GPU, no sort, no host sync). Indexing's own backward
    (``index_put_`` with accumulate) sorts all ``h * n * S`` indices on a GPU first: ~10^8 per layer and TTT step at
    Qwen3-8B's shape, the suspect of kv-ttt training 3.5x slower than hidden-ttt on an H100. On a CPU
    the two cost the same. Same values and gradient (``tests/test_drafters.py``)."""

    @staticmethod
    def forward(ctx, table: Tensor, bucket: Tensor) -> Tensor:
        ctx.save_for_backward(bucket)
        ctx.n_buckets = table.shape[1]
        return table[:, bucket]

    @staticmethod
    def backward(ctx, grad: Tensor):
        (bucket,) = ctx.saved_tensors
        h = grad.shape[0]
        out = grad.new_zeros(h, ctx.n_buckets, dtype=torch.float32)  # [h, B]
        index = bucket.reshape(1, -1).expand(h, -1)  # [h, n*S], a view
        return out.scatter_add_(1, index, grad.reshape(h, -1).float()).to(grad.dtype), None


class RecencyBias(nn.Module):
    """A learned additive score bias per query head and distance to a target key: ``b[h, min(d, W+1) - 1]``.

    Distance ``d >= 1`` is the query's position minus the key's; the last bucket holds every ``d > W``. It
    starts as ALiBi's linear penalty ``-m_h (d - 1)`` with slopes ``m_h`` spread geometrically over the heads
    from 1 (a head that reads the last few positions) down to 1/256 (nearly global), and is learned from
    there: a query computed from one token embedding cannot find the most recent target positions through
    RoPE alone, and Adam's small steps would take thousands of updates to grow such a bias from zero."""

    def __init__(self, n_heads: int, window: int):
        super().__init__()
        self.window = window
        slopes = 2.0 ** (-8.0 * torch.arange(n_heads) / max(n_heads - 1, 1))  # [h] from 1 to 1/256
        dist = torch.arange(window + 1, dtype=torch.float32)  # d - 1 for buckets 0..W
        self.table = nn.Parameter(-slopes[:, None] * dist[None])  # [h, W+1]

    def forward(self, dist: Tensor) -> Tensor:  # [n, S] long -> [h, n, S]
        """The dense bias ``[h, n, S]`` of the distances ``dist`` (the reference :meth:`band` is held to)."""
        return BucketGather.apply(self.table, (dist - 1).clamp(0, self.window))

    def band(self, dist: Tensor) -> BandBias:
        """The same bias as :meth:`forward` for every segment's ``dist`` (query position minus key index, so column
        0 holds the queries' positions), kept as its table: what the layers add to their scores."""
        q_pos = (
            dist[:, 0] if dist.shape[1] else dist.new_zeros(dist.shape[0])
        )  # [n] (no keys: nothing to bias)
        return BandBias(self.table, q_pos)


class KVLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        n_inj, D = cfg.n_injected_heads, cfg.target_head_dim
        self.input_norm = RMSNorm(H, eps)
        self.self_attn = Attention(H, H, n_inj * cfg.query_group, n_inj, D)
        self.inject = KVInjector(cfg.kv_mode, n_inj, D)
        self.recency = RecencyBias(n_inj * cfg.query_group, cfg.kv_recency) if cfg.kv_recency else None
        self.separate = cfg.kv_softmax == "separate"
        self.post_norm = RMSNorm(H, eps)
        self.mlp = MLP(H, cfg.intermediate_size)

    def forward(self, x: Tensor, emb: Tensor, cos: Tensor, sin: Tensor, ctx, li: int) -> Tensor:
        a = self.input_norm(x)  # [B, n, H]
        q = self.self_attn.query(a, cos, sin)  # [B, h, n, D]
        k, v = self.self_attn.key_value(a, cos, sin)  # [B, n_inj, n, D]
        segments = ctx.self_segments(li, k, v)  # the target's KV first, then the drafter's own
        if self.recency is not None:
            segments[0].bias = self.recency.band(
                segments[0].dist
            )  # a constant and a band: attention.BandBias
        if self.separate and segments[0].k.shape[2]:  # a softmax over the target's KV, another over its own
            o = segmented_attention(q, segments[:1], ctx.recorder) + segmented_attention(
                q, segments[1:], ctx.recorder
            )
        else:  # target KV + own KV, one softmax
            o = segmented_attention(q, segments, ctx.recorder)
        h = x + self.self_attn.out(o)  # [B, n, H]
        return h + self.mlp(self.post_norm(h))


class KVDrafter(TrainableDrafter):
    def __init__(self, cfg: DrafterConfig, target: Target, d2t: Tensor):
        super().__init__(cfg, target, d2t)
        self.layers = nn.ModuleList(KVLayer(cfg) for _ in range(cfg.n_layers))
