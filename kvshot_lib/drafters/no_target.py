"""The no-target control: the drafter's architecture given no target information at all.

It is a tiny causal language model over the prefix, the floor every context-reusing drafter must beat
(the KVShot paper's "no target information" row: flat at alpha ~ 0.24 over every draft step).

* Input: the embedding of the current token only (the target's frozen embedding, as every drafter).
* Layers: plain pre-norm decoder layers (self-attention + SwiGLU MLP): the hidden drafter's deeper layers.
  Their self-attention runs over the drafter's *own* K/V of every context position, computed from the
  context tokens' embeddings (like the hidden drafter's own context cache, but from tokens, not features),
  plus the tokens drafted in the current branch. It never reads the target's hidden states or KV cache.
* Output: the frozen target LM head over the draft vocabulary, after its own final norm.
* At deeper draft steps the input is the drafted token's embedding; the branch's earlier drafts are seen
  through attention to their own K/V (nothing is carried in the residual stream).

Its config lists no target layers (``hidden_layers = kv_layers = ()``), so no feature is ever collated
for it, and ``tests/test_no_target.py`` checks that its outputs, in training and in a decode session, do
not change when the target's hidden states and K/V are replaced by noise, and that greedy decoding with it
reproduces plain greedy decoding.
"""

from __future__ import annotations

from torch import Tensor, nn

from ..target import Target
from .config import DrafterConfig
from .hidden import HiddenLayer
from .trainable import TrainableDrafter


class NoTargetDrafter(TrainableDrafter):
    def __init__(self, cfg: DrafterConfig, target: Target, d2t: Tensor):
        super().__init__(cfg, target, d2t)
        self.layers = nn.ModuleList(HiddenLayer(cfg, first=False) for _ in range(cfg.n_layers))
