"""Online training data: the target runs inside the training loop, so no feature is ever stored.

A feature store costs ``~6 KB`` per token for SmolLM2 and ``~44 KB`` for Qwen3-8B (tens of GB for ShareGPT);
online, each optimizer step runs the frozen target (in its own dtype: bf16 or fp32, on its own device, under the
run's autocast as the extraction runs: bf16 where the CPU has it; in float32 the target's forward was 73% of an
online step on a 2-core AVX512-BF16 EPYC, by py-spy) over the step's tokenized conversations and hands the
drafter the same :class:`TrainBatch` a store extracted in that precision would have:

* :class:`OnlineBatches` visits the sequences of a :class:`~kvshot_lib.corpus.TokenizedSplit` in exactly the
  order :class:`~kvshot_lib.training.batches.StoreBatches` visits a store of that split (same
  :class:`BatchOrder`), crops them to ``max_tokens`` *before* the target runs (causal attention makes the kept
  positions' features the same), and pads the batch on the right with zeros, as :func:`collate` does;
* :func:`target_batch` is one batched forward with the capture hooks; right padding needs no attention mask,
  because a causal model's valid positions never see the padding after them;
* :func:`online_eval_set` builds the held-out :class:`~kvshot_lib.training.heldout.EvalSet` the same way, in the
  target's own dtype (the labels of every evaluation of a run, computed once).

``tests/test_reference.py`` checks that a drafter trained online has the loss of one trained from a float32
feature store of the same split, step by step, to float tolerance.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..drafters.unroll import TrainBatch
from ..target import Target
from ..target.forward import sequence_features
from ..target.precision import autocast
from .batches import BatchOrder
from .heldout import EvalSet


@torch.no_grad()
def target_batch(target: Target, seqs: list[tuple[Tensor, Tensor]], cfg) -> TrainBatch:
    """A padded :class:`TrainBatch` of ``[(ids [T], loss_mask [T]), ...]`` computed by ``target`` in one forward.

    Features are float32 on the target's device; positions past a sequence's length are zero."""
    dev = next(target.model.parameters()).device
    lengths = torch.tensor([len(ids) for ids, _ in seqs], dtype=torch.int64)
    B, T = len(seqs), int(lengths.max())
    ids = torch.zeros(B, T, dtype=torch.int64)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, (x, m) in enumerate(seqs):
        ids[b, : len(x)], mask[b, : len(x)] = x, m.bool()
    f = sequence_features(target.model, ids, cfg.hidden_layers, cfg.kv_layers)
    inside = (torch.arange(T)[None] < lengths[:, None]).to(dev)  # [B, T]

    def clean(x: Tensor) -> Tensor:  # float32, zero past each sequence's end (as collate pads)
        return x.float() * inside.view(B, T, *([1] * (x.dim() - 2)))

    hidden = keys = values = None
    if cfg.hidden_layers:
        hidden = clean(torch.cat([f.hidden[layer] for layer in cfg.hidden_layers], dim=-1))  # [B, T, nL*H]
    if cfg.kv_layers:
        keys = clean(torch.cat([f.keys[layer].transpose(1, 2) for layer in cfg.kv_layers], dim=2))
        values = clean(torch.cat([f.values[layer].transpose(1, 2) for layer in cfg.kv_layers], dim=2))
    return TrainBatch(
        ids=ids.to(dev),  # [B, T]
        loss_mask=mask.to(dev),  # [B, T]
        lengths=lengths.to(dev),
        final_hidden=clean(f.final),  # [B, T, H]
        hidden=hidden,
        keys=keys,  # [B, T, nKV*kvH, D]
        values=values,
    )


def split_sequence(split, i: int, max_tokens: int | None) -> tuple[Tensor, Tensor]:
    ids, mask = split.ids[i], split.loss_mask[i]
    return (ids[:max_tokens], mask[:max_tokens]) if max_tokens else (ids, mask)


class OnlineBatches(BatchOrder):
    """Deterministic, resumable batches of a tokenized split, computed by the target at each step."""

    def __init__(
        self,
        target: Target,
        split,
        cfg,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
        max_tokens: int | None = None,
        precision: str = "no",
    ):
        if len(split) == 0:
            raise ValueError("the tokenized split for online training holds no conversations.")
        super().__init__(len(split), batch_size, seed, rank, world)
        self.target, self.split, self.cfg, self.max_tokens = target, split, cfg, max_tokens
        self.precision = precision  # resolved ("no", "bf16", "fp16"): the autocast the target runs under

    def batch(self, step: int) -> TrainBatch:
        seqs = [split_sequence(self.split, i, self.max_tokens) for i in self.items(step)]
        with autocast(self.precision, self.target.info.device):
            return target_batch(self.target, seqs, self.cfg)


@torch.no_grad()
def online_eval_set(
    split, cfg, target: Target, n_sequences: int, batch_size: int, max_tokens: int | None = None
) -> EvalSet:
    """The held-out :class:`EvalSet` of the first ``n_sequences`` of ``split``, computed by the target (on CPU)."""
    head = target.model.lm_head.weight.detach()
    batches, tops = [], []
    n = min(n_sequences, len(split))
    for a in range(0, n, batch_size):
        seqs = [split_sequence(split, i, max_tokens) for i in range(a, min(a + batch_size, n))]
        batch = target_batch(target, seqs, cfg)
        fh = batch.final_hidden.to(head.dtype)  # [B, T, H]
        top = torch.cat(
            [(c @ head.T).argmax(-1) for c in fh.split(256, dim=1)], dim=1
        )  # [B, T] full-vocab greedy
        batches.append(batch.to("cpu"))
        tops.append(top.cpu())
    return EvalSet(batches, tops)
