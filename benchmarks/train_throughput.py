"""Drafter training throughput per paradigm and regime on the default target (tokens per second).

A step is one optimizer step on ``batch_size`` real ShareGPT sequences (features computed by the target
up front, outside the timing): forward, loss, backward, clipping and AdamW. Throughput counts input
tokens. Prints and saves ``benchmarks/results/train_throughput_<machine>.json``. Usage:
    python benchmarks/train_throughput.py [--target smollm2-135m] [--max-len 512] [--steps 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from kvshot_lib import corpus
from kvshot_lib.drafters import build_drafter, drafter_config_for
from kvshot_lib.target import load_target
from kvshot_lib.training import (
    Objective,
    TrainConfig,
    build_optimizer,
    collate,
    sample_branches,
    target_sequence,
)

COMBOS = [(p, r) for p in ("hidden", "kv", "hybrid") for r in ("tf", "ttt", "ttt_dense")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument(
        "--steps", type=int, default=3, help="timed optimizer steps per combination (after 1 warm-up)"
    )
    ap.add_argument("--draft-vocab-size", type=int, default=4096)
    ap.add_argument("--branch-fraction", type=float, default=0.25)
    ap.add_argument("--query-group", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    tgt = load_target(args.target, device="cpu", dtype="float32")
    split = corpus.tokenize_sharegpt(
        tgt.tokenizer, "train", args.batch_size * (args.steps + 1), args.max_len, seed=0
    )
    rows = []
    for paradigm, regime in COMBOS:
        cfg = TrainConfig(
            paradigm=paradigm,
            regime=regime,
            draft_vocab_size=args.draft_vocab_size,
            branch_fraction=args.branch_fraction,
            query_group=args.query_group,
        )
        dcfg = drafter_config_for(
            tgt, paradigm, draft_vocab_size=args.draft_vocab_size, query_group=args.query_group
        )
        drafter = build_drafter(dcfg, tgt, torch.arange(args.draft_vocab_size), seed=0)
        objective, optimizer = Objective(drafter, cfg), build_optimizer(drafter, cfg)
        seqs = [target_sequence(tgt, ids, mask, dcfg) for ids, mask in zip(split.ids, split.loss_mask)]
        batches = [collate(seqs[i : i + args.batch_size], dcfg) for i in range(0, len(seqs), args.batch_size)]
        seconds, tokens = 0.0, 0
        for step, batch in enumerate(batches):
            t0 = time.perf_counter()
            branches = sample_branches(batch.ids.shape[1] - 1, cfg.branch_fraction, seed=step)
            loss, _ = objective(batch, branches=branches)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step:  # the first step is a warm-up
                seconds += time.perf_counter() - t0
                tokens += int(batch.lengths.sum())
        rows.append(
            dict(
                paradigm=paradigm,
                regime=regime,
                unrolled_steps=cfg.n_train_steps,
                trainable_params=drafter.n_trainable(),
                tokens_per_s=round(tokens / seconds, 1),
                seconds_per_step=round(seconds / (len(batches) - 1), 2),
            )
        )
        print(rows[-1], flush=True)
    result = {
        "machine": f"{platform.node()} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "target": args.target,
        "max_len": args.max_len,
        "batch_size": args.batch_size,
        "draft_vocab_size": args.draft_vocab_size,
        "branch_fraction": args.branch_fraction,
        "query_group": args.query_group,
        "ttt_steps": 7,
        "results": rows,
    }
    dest = Path(__file__).parent / "results" / f"train_throughput_{platform.node()}.json"
    dest.parent.mkdir(exist_ok=True)
    dest.write_text(json.dumps(result, indent=1))
    print(f"saved {dest}")


if __name__ == "__main__":
    main()
