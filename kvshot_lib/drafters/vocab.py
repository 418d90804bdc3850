"""The reduced draft vocabulary: the most frequent target tokens of the training data, and the map back.

A drafter predicts over ``V_draft`` ids (EAGLE-3's t2d/d2t): ``d2t[j]`` is the target id of draft id ``j``.
The draft vocabulary is the ``size`` most frequent target tokens among the training data's assistant
tokens (the ones a drafter will be asked to draft), ties broken by the smaller id, then sorted by target
id. If the data holds fewer distinct tokens than ``size``, the rest is filled with the smallest unused
ids so that the size is always what was asked. The mapping's hash goes into the checkpoint config.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor


def count_tokens(store, vocab_size: int, assistant_only: bool = True) -> Tensor:
    """Occurrences of every target id among a feature store's (assistant) tokens: ``[vocab_size]`` int64."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for seq in store.sequences(("input_ids", "loss_mask")):
        ids = seq["input_ids"].long()  # [T]
        if assistant_only:
            ids = ids[seq["loss_mask"].bool()]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def draft_vocab_from_counts(counts: Tensor, size: int, always: tuple[int, ...] = ()) -> Tensor:
    """``d2t [size]``: the ``size`` most frequent ids (plus ``always``), sorted ascending."""
    vocab_size = counts.numel()
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in 1..{vocab_size}, got {size}.")
    ids = torch.arange(vocab_size)
    # sort by count descending, then id ascending (stable sort on -count of id-ordered ids)
    score = counts.clone()
    for t in always:
        score[t] = torch.iinfo(torch.int64).max
    order = torch.sort(-score, stable=True).indices
    return torch.sort(ids[order[:size]]).values


def vocab_hash(d2t: Tensor) -> str:
    """A short hash of the draft-to-target mapping (what a checkpoint must agree with)."""
    return hashlib.sha256(d2t.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:16]


def target_to_draft(d2t: Tensor, vocab_size: int) -> Tensor:
    """``t2d [vocab_size]``: draft id of every target id, ``-1`` where the target id is not drafted."""
    t2d = torch.full((vocab_size,), -1, dtype=torch.int64)
    t2d[d2t.long()] = torch.arange(d2t.numel())
    return t2d


def coverage(d2t: Tensor, counts: Tensor) -> float:
    """Share of counted tokens that the draft vocabulary contains."""
    total = counts.sum().item()
    return float(counts[d2t.long()].sum().item() / total) if total else 0.0
