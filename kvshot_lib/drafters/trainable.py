"""The base class of every trainable drafter (``config.PARADIGMS``): the frozen target embedding and LM head, RoPE.

A :class:`TrainableDrafter` is an ``nn.Module`` *and* a :class:`~kvshot_lib.drafters.base.SessionFactory`.

* The target's input embedding and LM head are reused, frozen, and never stored in a checkpoint. The
  embedding is looked up in the target's own dtype (no copy of a 150k x 4096 table); the LM head is cut
  down to the draft vocabulary's rows (``head [V_draft, H]``). The drafter's own final norm comes before it.
* RoPE cos/sin come from the target's rotary embedding, so the drafter's positions are the target's.
* ``state_dict()`` holds exactly the trainable parameters plus two buffers: ``d2t`` (the draft vocabulary)
  and ``target_probe`` (a 64 x 16 sample of the target's embedding, to catch a same-architecture target
  with other weights). Loading is strict.
* ``forward(batch, n_steps)`` is :func:`~.unroll.unroll`: ``n_steps`` draft steps over a
  :class:`~.unroll.TrainBatch` (the index convention is ``unroll.py``'s), every step's output hidden state.

Subclasses (``hidden.py``, ``kv.py``, ``hybrid.py``, ``cross.py``, ``no_target.py``, ``block.py``) define ``layers``
and, as needed, ``fuse`` (the fc of the target's hidden states) and injectors (how the target's KV enters).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..target import Target
from .attention import RMSNorm
from .base import DraftSession
from .config import DrafterConfig
from .unroll import unroll

N_PROBE_ROWS, N_PROBE_DIMS = 64, 16


def target_probe(target: Target) -> Tensor:
    """A small fixed sample of the target's input embedding, in float32: ``[64, 16]``."""
    w = target.model.model.embed_tokens.weight
    rows = torch.linspace(0, w.shape[0] - 1, N_PROBE_ROWS).long().to(w.device)
    return w[rows, :N_PROBE_DIMS].detach().float().cpu().clone()


class _Frozen:
    """Holds the target modules the drafter borrows, out of sight of ``nn.Module`` (no params, no state)."""

    def __init__(self, embed_weight: Tensor, rotary: nn.Module):
        self.embed_weight = embed_weight
        self.rotary = rotary


class TrainableDrafter(nn.Module):
    layers: nn.ModuleList

    def __init__(self, cfg: DrafterConfig, target: Target, d2t: Tensor):
        super().__init__()
        cfg.check_target(target.info, where=f"the {cfg.paradigm} drafter config")
        if d2t.numel() != cfg.draft_vocab_size:
            raise ValueError(f"d2t has {d2t.numel()} ids but draft_vocab_size is {cfg.draft_vocab_size}.")
        self.cfg = cfg
        self.paradigm, self.regime = cfg.paradigm, cfg.regime
        self.name = cfg.name or f"{cfg.paradigm}-{cfg.regime or 'untrained'}"
        model = target.model
        self._frozen = _Frozen(model.model.embed_tokens.weight, model.model.rotary_emb)
        device = model.model.embed_tokens.weight.device
        self.register_buffer("d2t", d2t.long().to(device).clone(), persistent=True)
        self.register_buffer("target_probe", target_probe(target).to(device), persistent=True)
        head = model.lm_head.weight.detach()[self.d2t].float().clone()  # [V_draft, H]
        self.register_buffer("head", head, persistent=False)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("_cos", torch.empty(0, device=device), persistent=False)
        self.register_buffer("_sin", torch.empty(0, device=device), persistent=False)

    # ------------------------------------------------------------------------------------------ shared parts

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return self.cfg.hidden_layers if self.cfg.uses_hidden else ()

    def compute_dtype(self) -> torch.dtype:
        """The dtype activations run in: autocast's while it is on for the drafter's device (bf16 on a CPU
        that has it, see :mod:`kvshot_lib.target.precision`), else the head's (float32). Every input the
        drafter reads (embeddings, target K/V and features, RoPE tables) enters in it, so no elementwise op
        silently promotes a bf16 step back to float32."""
        dev = self.head.device.type
        return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else self.head.dtype

    def embed(self, ids: Tensor) -> Tensor:
        w = self._frozen.embed_weight
        return nn.functional.embedding(ids.to(w.device), w).to(self.compute_dtype())  # [..., H]

    def rope(self, positions: Tensor, bound: int | None = None) -> tuple[Tensor, Tensor]:
        """cos, sin for ``positions [n]``: each ``[1, 1, n, D]`` (broadcast over batch and heads). ``bound``: a
        host-known bound on the positions (the table then holds it without reading ``positions`` back: no host
        sync, as a captured draft step needs)."""
        if bound is None:
            bound = int(positions.max().item()) + 1 if positions.numel() else 1
        self.rope_ready(bound)
        dt = self.compute_dtype()
        return self._cos[positions][None, None].to(dt), self._sin[positions][None, None].to(dt)

    def rope_ready(self, n: int) -> int:
        """Make the RoPE table hold positions ``0..n-1``; returns its address (a CUDA graph that reads the table
        is stale once it changes: :mod:`kvshot_lib.drafters.static_steps`)."""
        if self._cos.shape[0] < n:
            self._rope_table(max(n, 2 * self._cos.shape[0], 4096))
        return self._cos.data_ptr()

    def _rope_table(self, n: int) -> None:
        pos = torch.arange(n, device=self.head.device)[None]  # [1, n]
        x = torch.zeros(1, dtype=torch.float32, device=self.head.device)
        with torch.no_grad():
            cos, sin = self._frozen.rotary(x, pos)  # [1, n, D]
        self._cos, self._sin = cos[0].float().contiguous(), sin[0].float().contiguous()

    def logits(self, h: Tensor) -> Tensor:
        return self.final_norm(h) @ self.head.T  # [..., V_draft]

    def feedback(self, h: Tensor) -> Tensor:
        """What a deeper draft step reads of the step before: its output ``h``, after the final norm with
        EAGLE 3.1's ``norm_output``, else as it is (EAGLE-3)."""
        return self.final_norm(h) if self.cfg.norm_output else h  # [..., H]

    def fuse(self, hidden: Tensor) -> Tensor:  # [B, n, n_layers * H] -> [B, n, H]
        raise NotImplementedError

    def inject(
        self, keys: Tensor, values: Tensor, positions: Tensor, bound: int | None = None
    ) -> dict[int, tuple[Tensor, Tensor]]:
        """Per drafter layer, the target KV as that layer reads it: ``{layer: (K, V)}``, ``[B, kvH, n, D]``.

        ``keys``/``values`` are ``[B, n, heads, D]`` at ``positions [n]`` (``bound``: a host-known bound on them, as
        :meth:`rope` takes). Training and decoding both come through here, so the ``target_kv="zeroed"`` control
        sees zeros everywhere."""
        if not self.cfg.uses_target_kv:
            return {}
        if self.cfg.target_kv == "zeroed":
            keys, values = torch.zeros_like(keys), torch.zeros_like(values)
        cos, sin = self.rope(positions, bound)
        return {li: layer.inject(keys, values, cos, sin) for li, layer in enumerate(self.layers)}

    def run_layers(self, x: Tensor, emb: Tensor, cos: Tensor, sin: Tensor, ctx) -> Tensor:
        for li, layer in enumerate(self.layers):
            x = layer(x, emb, cos, sin, ctx, li)
        return x

    forward = unroll  # training: ``drafter(batch, n_steps, ...)`` unrolls it (unroll.py)

    # ---------------------------------------------------------------------------------------------- decode

    def new_session(self) -> DraftSession:
        from .session import TrainedDraftSession

        return TrainedDraftSession(self)

    def n_trainable(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
