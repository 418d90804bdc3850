"""Hidden-vs-KV information probes: what can be read about the target's token at ``t+1+k`` from what it holds at ``t``.

Every probe kind is a *bank* of ``K`` independent probes, one per draft step ``k`` (their parameters are
stacked, never shared, and their losses are summed, so training the bank trains each probe on its own). A
probe turns its input into a vector of the target's hidden width through a two-layer MLP, then reads out
through the target's **frozen** final norm and LM head (restricted to the readout vocabulary):

====================  ==============================================================================
``emb``               the token embedding at ``t`` (the control every information gain is measured from)
``h``                 the hidden states at ``t`` of the probe layers, side by side
``kv_static``         learned queries (one per target query head, placed at ``t+k`` by RoPE) attending over
                      the layers' K/V of ``0..t``
``kv_h``              queries computed from the hidden states at ``t`` (low rank), attending over K/V ``0..t``
``h_kv``              both: the hidden states and what the ``kv_h`` queries read
``kv_oracle``         the target's own post-RoPE queries at ``t+k`` attending over K/V ``0..t``: an upper bound
====================  ==============================================================================

The oracle uses the query at ``t+k``, the one whose attention the target used to choose the token at
``t+1+k``; its query at ``t+1+k`` would carry that token's own embedding, i.e. the label.

**Matched capacity.** :func:`probe_widths` picks each kind's MLP width so that its trainable parameters
(queries + MLP) equal a common budget within ±5% (the frozen norm, head and embedding are not counted);
``tests/test_diagnostics.py`` checks the counts. Inputs are standardized by parameter-free layer norms
(per layer block, per attention head), so no kind gains parameters there. Every probe starts from the same
point: its output bias is the mean direction of the target's own final hidden state (so its first guess is
the target's average prediction) and its last layer is small.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..drafters.attention import apply_rope

KINDS = ("emb", "h", "kv_static", "kv_h", "h_kv", "kv_oracle")


@dataclass(frozen=True)
class ProbeDims:
    n_layers: int  # probe layers
    hidden: int  # target hidden width H
    n_heads: int  # query heads per layer
    n_kv_heads: int  # KV heads per layer
    head_dim: int

    @property
    def heads(self) -> int:  # query heads of all probe layers
        return self.n_layers * self.n_heads

    @property
    def read(self) -> int:  # width of what the attention reads: one head_dim vector per query head
        return self.heads * self.head_dim

    def input_width(self, kind: str) -> int:
        H = self.hidden
        return {
            "emb": H,
            "h": self.n_layers * H,
            "kv_static": self.read,
            "kv_h": self.read,
            "h_kv": self.n_layers * H + self.read,
            "kv_oracle": self.read,
        }[kind]

    def query_params(self, kind: str, rank: int) -> int:
        if kind == "kv_static":
            return self.read
        if kind in ("kv_h", "h_kv"):
            return self.n_layers * self.hidden * rank + rank * self.read
        return 0


def mlp_params(d_in: int, width: int, d_out: int) -> int:
    """The MLP's weights and biases, plus the probe's one temperature."""
    return d_in * width + width + width * d_out + d_out + 1


def probe_widths(dims: ProbeDims, budget: int, rank: int) -> dict[str, int]:
    """Per kind, the MLP width whose probe has ``budget`` trainable parameters (rounded to the nearest)."""
    widths = {}
    for kind in KINDS:
        d_in, fixed = dims.input_width(kind), dims.query_params(kind, rank) + dims.hidden + 1
        width = round((budget - fixed) / (d_in + 1 + dims.hidden))
        if width < 8:
            raise ValueError(
                f"a parameter budget of {budget:,} leaves the {kind} probe an MLP width of {width}; "
                f"raise probe_budget (its queries alone take {dims.query_params(kind, rank):,}) or lower query_rank."
            )
        widths[kind] = width
    return widths


class ProbeBank(nn.Module):
    """``K`` probes of one kind. ``forward`` returns logits ``[K, n, V]`` over the readout vocabulary."""

    def __init__(
        self, kind: str, n_steps: int, dims: ProbeDims, width: int, rank: int, readout, init_bias=None
    ):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"unknown probe kind {kind!r}; choose from {KINDS}.")
        self.kind, self.K, self.dims, self.readout = kind, n_steps, dims, readout
        K, d_in, H = n_steps, dims.input_width(kind), dims.hidden

        def init(*shape, fan_in):
            return nn.Parameter(torch.randn(*shape) / math.sqrt(fan_in))

        if kind == "kv_static":
            self.q_static = init(K, dims.heads, dims.head_dim, fan_in=1)
        if kind in ("kv_h", "h_kv"):
            self.q_down = init(K, dims.n_layers * H, rank, fan_in=dims.n_layers * H)
            self.q_up = init(K, rank, dims.read, fan_in=rank)
        self.w1 = init(K, d_in, width, fan_in=d_in)
        self.b1 = nn.Parameter(torch.zeros(K, 1, width))
        self.w2 = nn.Parameter(0.1 * torch.randn(K, width, H) / math.sqrt(width))
        bias = torch.zeros(H) if init_bias is None else init_bias.float()
        self.b2 = nn.Parameter(bias.expand(K, 1, H).clone())  # starts near the target's average prediction
        self.log_scale = nn.Parameter(
            torch.zeros(K, 1, 1)
        )  # a temperature: the frozen head's logits are sharp

    def n_trainable_per_probe(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad) // self.K

    def forward(self, batch) -> Tensor:
        x = self.features(batch)  # [K, n, d_in]
        z = F.gelu(torch.baddbmm(self.b1, x, self.w1))  # [K, n, width]
        return self.readout(torch.baddbmm(self.b2, z, self.w2)) * self.log_scale.exp()  # [K, n, V]

    def features(self, batch) -> Tensor:
        K, kind = self.K, self.kind
        h = batch.hidden_normed()  # [n, nL*H]
        if kind == "emb":
            return F.layer_norm(batch.embedding, batch.embedding.shape[-1:]).expand(K, -1, -1)
        if kind == "h":
            return h.expand(K, -1, -1)
        if kind == "kv_oracle":
            return batch.oracle_read()  # [K, n, heads*D]
        if kind == "kv_static":
            q = apply_rope(
                self.q_static[:, None].expand(-1, h.shape[0], -1, -1), *batch.rope
            )  # [K, n, heads, D]
        else:
            q = torch.bmm(torch.bmm(h.expand(K, -1, -1), self.q_down), self.q_up)  # [K, n, heads*D]
            q = apply_rope(q.view(K, h.shape[0], self.dims.heads, self.dims.head_dim), *batch.rope)
        read = batch.attend(q)  # [K, n, heads*D]
        return torch.cat([h.expand(K, -1, -1), read], dim=-1) if kind == "h_kv" else read


class Readout(nn.Module):
    """The target's final norm and LM head rows of the readout vocabulary, frozen (buffers, not parameters)."""

    def __init__(self, target, vocab: Tensor):
        super().__init__()
        model = target.model
        norm = model.model.norm
        self.eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
        self.register_buffer("norm_weight", norm.weight.detach().float().clone())  # on the target's device
        self.register_buffer(
            "head", model.lm_head.weight.detach()[vocab.to(model.lm_head.weight.device)].float()
        )
        self.register_buffer("vocab", vocab.clone())

    def forward(self, z: Tensor) -> Tensor:  # [..., H] -> [..., V]
        z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        return z @ self.head.T
