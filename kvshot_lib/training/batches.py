"""Batches for drafter training, from the feature store (or straight from a target; see ``online.py``).

:class:`StoreBatches` turns a :class:`~kvshot_lib.corpus.features.FeatureStore` into padded
:class:`~kvshot_lib.drafters.unroll.TrainBatch` es in a deterministic order: an endless stream of seeded
per-epoch permutations, where optimizer step ``s`` takes stream items ``s*B .. (s+1)*B - 1``. The data
position is therefore a function of the step alone, which is what makes resuming exact; with several
processes (``accelerate launch``) process ``r`` takes every ``world``-th item of the global batch.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..drafters.unroll import TrainBatch
from ..target import Target
from ..target.forward import sequence_features


def store_fields(cfg) -> list[str]:
    """The feature-store fields a drafter of config ``cfg`` trains on."""
    fields = ["input_ids", "loss_mask", "final_hidden"]
    fields += [f"hidden.{layer}" for layer in cfg.hidden_layers]
    for layer in cfg.kv_layers:
        fields += [f"keys.{layer}", f"values.{layer}"]
    return fields


def collate(seqs: list[dict[str, Tensor]], cfg, max_tokens: int | None = None) -> TrainBatch:
    """Pad feature-store sequences (token axis first) into a :class:`TrainBatch`."""
    if max_tokens:
        seqs = [{k: v[:max_tokens] for k, v in s.items()} for s in seqs]
    lengths = torch.tensor([len(s["input_ids"]) for s in seqs], dtype=torch.int64)
    T = int(lengths.max())

    def pad(name: str, dtype=None) -> Tensor:
        first = seqs[0][name]
        out = first.new_zeros((len(seqs), T, *first.shape[1:]))
        for b, s in enumerate(seqs):
            out[b, : len(s[name])] = s[name]
        return out if dtype is None else out.to(dtype)

    def side_by_side(prefix: str, layers) -> Tensor | None:
        if not layers:
            return None
        return torch.cat([pad(f"{prefix}.{layer}", torch.float32) for layer in layers], dim=2)

    hidden = None
    if cfg.hidden_layers:
        hidden = torch.cat([pad(f"hidden.{layer}", torch.float32) for layer in cfg.hidden_layers], dim=-1)
    return TrainBatch(
        ids=pad("input_ids", torch.int64),  # [B, T]
        loss_mask=pad("loss_mask", torch.bool),  # [B, T]
        lengths=lengths,
        final_hidden=pad("final_hidden", torch.float32),  # [B, T, H]
        hidden=hidden,  # [B, T, nL*H]
        keys=side_by_side("keys", cfg.kv_layers),  # [B, T, nKV*kvH, D]
        values=side_by_side("values", cfg.kv_layers),
    )


class BatchOrder:
    """The data position as a function of the optimizer step: seeded per-epoch permutations of ``n`` sequences,
    split among ``world`` processes. Shared by the feature-store and the online batch sources, so both visit the
    same sequences in the same order."""

    def __init__(self, n: int, batch_size: int, seed: int, rank: int = 0, world: int = 1, indices=None):
        self.batch_size, self.seed, self.rank, self.world = batch_size, seed, rank, world
        self.indices = np.arange(n) if indices is None else np.asarray(indices)
        self._epochs: dict[int, np.ndarray] = {}

    def _item(self, j: int) -> int:
        n = len(self.indices)
        epoch, pos = divmod(j, n)
        if epoch not in self._epochs:
            self._epochs = {epoch: np.random.default_rng([self.seed, epoch]).permutation(n)}
        return int(self.indices[self._epochs[epoch][pos]])

    def items(self, step: int) -> list[int]:
        """Sequence indices of this process's share of optimizer step ``step``."""
        g = self.batch_size * self.world
        return [self._item(step * g + j) for j in range(self.rank, g, self.world)]

    def epoch_of(self, step: int) -> float:
        return step * self.batch_size * self.world / len(self.indices)


class StoreBatches(BatchOrder):
    """Deterministic, resumable batches of a feature store for one process of ``world``."""

    def __init__(
        self,
        store,
        cfg,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
        max_tokens: int | None = None,
        indices: list[int] | None = None,
    ):
        if len(store) == 0:
            raise ValueError(f"the feature store at {store.path} holds no sequences.")
        super().__init__(len(store), batch_size, seed, rank, world, indices)
        self.store, self.cfg, self.max_tokens = store, cfg, max_tokens
        self.fields = store_fields(cfg)

    def batch(self, step: int) -> TrainBatch:
        return collate(
            [self.store.sequence(i, self.fields) for i in self.items(step)], self.cfg, self.max_tokens
        )


@torch.no_grad()
def target_sequence(target: Target, ids: Tensor, loss_mask: Tensor, cfg) -> dict[str, Tensor]:
    """One sequence's feature-store fields computed directly from ``target``, in float32 (tests, benchmarks)."""
    f = sequence_features(target.model, ids[None], cfg.hidden_layers, cfg.kv_layers)
    seq = {"input_ids": ids, "loss_mask": loss_mask, "final_hidden": f.final[0].float().cpu()}
    for layer in cfg.hidden_layers:
        seq[f"hidden.{layer}"] = f.hidden[layer][0].float().cpu()  # [T, H]
    for layer in cfg.kv_layers:
        seq[f"keys.{layer}"] = f.keys[layer][0].transpose(0, 1).float().cpu()  # [T, kvH, D]
        seq[f"values.{layer}"] = f.values[layer][0].transpose(0, 1).float().cpu()
    return seq


def batch_from_target(target: Target, ids: Tensor, loss_mask: Tensor, cfg) -> TrainBatch:
    """A one-sequence batch (``ids``, ``loss_mask``: ``[T]``) with what the feature store would hold, in float32."""
    return collate([target_sequence(target, ids, loss_mask, cfg)], cfg)
