"""Online training and feature extraction tokens/s (the ``train_<drafter>`` and ``extraction`` stages)."""

from __future__ import annotations

import shutil
from pathlib import Path

from kvshot_lib import corpus
from kvshot_lib.target import Target
from kvshot_lib.target import forward as target_forward
from kvshot_lib.training import TrainConfig, train_drafter

from .scales import Scale


def measure_extraction(target: Target, split, work: Path, precision: str) -> dict:
    layers = target.info.default_hidden_layers()
    target_forward.sequence_features(target.model, split.ids[0][None, :256], layers, layers)  # warm-up
    store = corpus.extract_features(target, split, out_dir=work / "store", precision=precision)
    s = store.summary()
    shutil.rmtree(work / "store", ignore_errors=True)
    keys = ("sequences", "tokens", "extraction_seconds", "tokens_per_s", "bytes_per_token", "dtype")
    return {k: s[k] for k in keys}


def measure_training(
    target: Target, train, heldout, d2t, scale: Scale, paradigm: str, work: Path, **overrides
):
    """Online training of ``<paradigm>-ttt``: tokens/s over the steps after the warm-up ones, and its sizes.
    ``overrides``: TrainConfig fields (the KV drafter's recency bias off, to time what it costs)."""
    cfg = TrainConfig(
        **overrides,
        paradigm=paradigm,
        regime="ttt",
        train_steps=scale.train_steps,
        batch_size=scale.batch_size,
        max_tokens=scale.max_len,
        draft_vocab_size=scale.draft_vocab_size,
        query_group=1,
        lr=1e-4,
        eval_every=0,
        eval_sequences=scale.batch_size,
        probe_every=0,
        save_every=0,
        data_source="online",
        mixed_precision=scale.precision,
        max_seconds=scale.train_seconds,
    )
    result = train_drafter(
        target, train, heldout, cfg, work / cfg.name, d2t=d2t, resume=False, progress=False
    )
    rows = result.logs["history"]
    warm = min(scale.warm_steps, len(rows) - 1)
    start = rows[warm - 1]["seconds"] if warm else 0.0
    tokens = sum(r["tokens"] for r in rows[warm:])
    files = [p for p in (work / cfg.name).rglob("*") if p.is_file()]
    row = dict(
        steps=len(rows),
        timed_steps=len(rows) - warm,
        tokens_per_step=round(tokens / max(1, len(rows) - warm), 1),
        tokens_per_s=round(tokens / max(rows[-1]["seconds"] - start, 1e-9), 1),
        drafter_params=sum(p.numel() for p in result.drafter.parameters() if p.requires_grad),
        checkpoint_bytes=sum(p.stat().st_size for p in files if p.suffix == ".safetensors"),
        batch_size=scale.batch_size,
        max_len=scale.max_len,
        draft_vocab_size=scale.draft_vocab_size,
        ttt_steps=cfg.ttt_steps,
        precision=scale.precision,
    )
    return row
