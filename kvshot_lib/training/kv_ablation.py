"""Does a drafter read the *content* of the target's KV? Held-out accuracy with the KV real, zeroed, shuffled.

Every KV-reading drafter (KV-only, hybrid) is evaluated on the same held-out positions three ways:

* ``real``: the target's own K/V of the conversation (what it was trained on);
* ``zeroed``: every target K and V set to zero (the drafter sees that a cache is there, not what it holds);
* ``shuffled``: the K/V of *another* held-out conversation, cut or zero-padded to this one's length
  (a real cache with the wrong content).

A drafter that gains from what the cache holds loses accuracy under both ablations; one that only leans on
a cache being present loses under ``zeroed`` alone. The fair control for "the drafter uses the KV" is the
same drafter *trained* with the KV zeroed (``target_kv="zeroed"`` in its config), reported beside it.
``tests/test_kv_ablation.py`` checks the three conditions on hand-made batches.
"""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import torch

from ..drafters.trainable import TrainableDrafter
from ..drafters.unroll import TrainBatch
from ..target import Target
from .data import is_tokenized_split
from .heldout import EvalSet, evaluate_per_step
from .online import online_eval_set

KV_CONDITIONS = ("real", "zeroed", "shuffled")


def _fit(x: torch.Tensor, length: int) -> torch.Tensor:
    """``x [B, T', ...]`` cut or zero-padded along dim 1 to ``length``."""
    if x.shape[1] >= length:
        return x[:, :length]
    pad = x.new_zeros((x.shape[0], length - x.shape[1], *x.shape[2:]))
    return torch.cat([x, pad], dim=1)


def with_target_kv(evals: EvalSet, condition: str) -> EvalSet:
    """The same held-out batches with the target's K/V kept (``real``), ``zeroed`` or ``shuffled``.

    ``shuffled`` gives batch ``b`` the K/V of batch ``b+1`` (cyclically), so every sequence reads a cache
    of another conversation, fit to its own length; with one batch the rows are rolled instead."""
    if condition not in KV_CONDITIONS:
        raise ValueError(f"target-KV condition must be one of {KV_CONDITIONS}, got {condition!r}.")
    if condition == "real":
        return evals
    batches = []
    for b, batch in enumerate(evals.batches):
        if batch.keys is None:
            raise ValueError("these held-out batches carry no target K/V: the drafter does not read the KV.")
        if condition == "zeroed":
            keys, values = torch.zeros_like(batch.keys), torch.zeros_like(batch.values)
        else:
            if len(evals.batches) > 1:
                other = evals.batches[(b + 1) % len(evals.batches)]
                keys, values = other.keys, other.values  # [B', T', heads, D]
            else:
                keys, values = batch.keys.roll(1, 0), batch.values.roll(1, 0)
            T, B = batch.ids.shape[1], batch.ids.shape[0]
            keys, values = _fit(keys, T), _fit(values, T)
            if keys.shape[0] != B:  # the other batch may be the short last one: repeat its rows
                idx = torch.arange(B) % keys.shape[0]
                keys, values = keys[idx], values[idx]
        batches.append(replace(batch, keys=keys, values=values))
    return EvalSet(batches, evals.target_argmax)


def zero_target_kv(batch: TrainBatch) -> TrainBatch:
    """``batch`` with the target's K/V zeroed (the training side of the ``zeroed`` control)."""
    if batch.keys is None:
        return batch
    return replace(batch, keys=torch.zeros_like(batch.keys), values=torch.zeros_like(batch.values))


def reads_target_kv(drafter: TrainableDrafter) -> bool:
    return bool(getattr(drafter.cfg, "uses_target_kv", False))


@torch.no_grad()
def kv_ablation_table(
    results,
    eval_store,
    target: Target,
    n_steps: int,
    n_sequences: int,
    batch_size: int,
    max_tokens=None,
    branch_fraction: float = 1.0,
) -> pd.DataFrame:
    """One row per (KV-reading drafter, condition, draft step): held-out accuracy and its count ``n``.
    ``eval_store`` is a feature store, or a tokenized split whose features the target computes (online training)."""
    build = online_eval_set if is_tokenized_split(eval_store) else EvalSet.build
    rows = []
    for r in results:
        d = r.drafter
        if not reads_target_kv(d):
            continue
        d.eval()
        evals = build(eval_store, d.cfg, target, n_sequences, batch_size, max_tokens)
        for condition in KV_CONDITIONS:
            ev = evaluate_per_step(d, with_target_kv(evals, condition), n_steps, None, branch_fraction)
            for k in range(n_steps):
                rows.append(
                    dict(
                        drafter=r.config.name,
                        paradigm=r.config.paradigm,
                        regime=r.config.regime,
                        trained_with=d.cfg.target_kv,
                        condition=condition,
                        draft_step=k,
                        accuracy=ev[f"acc_{k}"],
                        n=ev[f"n_{k}"],
                    )
                )
    return pd.DataFrame(rows)
