"""Drafter training throughput per paradigm and regime: float32 beside the default precision, in one run.

A step is one optimizer step on ``batch_size`` real ShareGPT sequences of the default target (features
computed by the target up front, outside the timing): forward, loss, backward, clipping and AdamW.
Throughput counts input tokens. For each paradigm x regime the float32 drafter and the default-precision
one (``mixed_precision: auto``: bf16 on a CPU with AMX-BF16 / AVX512-BF16) take their steps **interleaved**,
so load from other processes falls on both alike; the median step time of each gives tokens/s and their
ratio. One extra profiled step per precision gives the share of step time spent in matmuls.

Prints and saves ``benchmarks/results/train_throughput_<machine>.json``. Usage:
    python benchmarks/train_throughput.py [--combos hidden:ttt kv:ttt] [--steps 6] [--max-len 512] [--threads 0]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

from kvshot_lib import corpus
from kvshot_lib.drafters import build_drafter, drafter_config_for
from kvshot_lib.evaluation import machine_name
from kvshot_lib.target import autocast, load_target, machine_record, resolve_precision
from kvshot_lib.training import (
    Objective,
    TrainConfig,
    build_optimizer,
    collate,
    sample_anchors,
    sample_branches,
    step_mask,
    target_sequence,
)

COMBOS = [(p, r) for p in ("hidden", "kv", "hybrid") for r in ("tf", "ttt")] + [
    ("none", "ttt"),
    ("block", "parallel"),
]
MATMUL_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::_scaled_dot_product")


def _step(drafter, objective, optimizer, batch, cfg, precision: str, step: int) -> None:
    branches = sample_branches(batch.ids.shape[1] - 1, cfg.branch_fraction, seed=step)
    if cfg.regime == "parallel":
        branches = sample_anchors(step_mask(batch, 0), cfg.branch_fraction, step, cfg.ttt_steps + 1)
    with autocast(precision, "cpu"):
        loss, _ = objective(batch, branches=branches)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _matmul_share(*step_args) -> float:
    """The share of one step's CPU time spent in matmul kernels (torch profiler, self time)."""
    with torch.profiler.profile() as prof:
        _step(*step_args)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    mm = sum(e.self_cpu_time_total for e in events if e.key.startswith(MATMUL_OPS))
    return mm / max(total, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--combos", nargs="*", default=[f"{p}:{r}" for p, r in COMBOS])
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per precision (after 1 warm-up)")
    ap.add_argument("--draft-vocab-size", type=int, default=4096)
    ap.add_argument("--branch-fraction", type=float, default=0.25)
    ap.add_argument("--query-group", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    default = resolve_precision("auto", "cpu")
    precisions = ["no", default] if default != "no" else ["no"]

    tgt = load_target(args.target, device="cpu", dtype="float32")
    n_batches = args.steps + 2  # a warm-up and a profiled step
    split = corpus.tokenize_sharegpt(
        tgt.tokenizer, "train", args.batch_size * n_batches, args.max_len, seed=0
    )
    rows = []
    for combo in args.combos:
        paradigm, regime = combo.split(":")
        extra = dict(context="kv", n_layers=2) if paradigm == "block" else {}
        cfg = TrainConfig(
            paradigm=paradigm,
            regime=regime,
            draft_vocab_size=args.draft_vocab_size,
            branch_fraction=args.branch_fraction,
            query_group=args.query_group,
            **extra,
        )
        dcfg = drafter_config_for(
            tgt,
            paradigm,
            n_layers=cfg.n_layers,
            draft_vocab_size=args.draft_vocab_size,
            query_group=args.query_group,
            regime=regime,
            context=cfg.context,
            block_size=cfg.ttt_steps if paradigm == "block" else 0,
            kv_recency=cfg.kv_recency,
        )
        seqs = [target_sequence(tgt, ids, mask, dcfg) for ids, mask in zip(split.ids, split.loss_mask)]
        batches = [collate(seqs[i : i + args.batch_size], dcfg) for i in range(0, len(seqs), args.batch_size)]
        runs = {}
        for p in precisions:
            d = build_drafter(dcfg, tgt, torch.arange(args.draft_vocab_size), seed=0)
            runs[p] = (d, Objective(d, cfg), build_optimizer(d, cfg), [])
        for step, batch in enumerate(batches[:-1]):  # interleaved: fp32, default, fp32, default, ...
            for p, (d, obj, opt, times) in runs.items():
                t0 = time.perf_counter()
                _step(d, obj, opt, batch, cfg, p, step)
                if step:  # the first step is a warm-up
                    times.append(time.perf_counter() - t0)
        tokens = [int(b.lengths.sum()) for b in batches[1:-1]]
        row = dict(paradigm=paradigm, regime=regime, unrolled_steps=cfg.n_train_steps)
        for p, (d, obj, opt, times) in runs.items():
            label = "fp32" if p == "no" else p
            row[f"{label}_tokens_per_s"] = round(statistics.mean(tokens) / statistics.median(times), 1)
            row[f"{label}_matmul_share"] = round(
                _matmul_share(d, obj, opt, batches[-1], cfg, p, len(batches)), 3
            )
        if len(runs) > 1:
            row["gain"] = round(row[f"{precisions[1]}_tokens_per_s"] / row["fp32_tokens_per_s"], 2)
        rows.append(row)
        print(row, flush=True)
    result = {
        "machine": machine_name(),
        **machine_record(default, "cpu"),
        "target": args.target,
        "max_len": args.max_len,
        "batch_size": args.batch_size,
        "draft_vocab_size": args.draft_vocab_size,
        "branch_fraction": args.branch_fraction,
        "query_group": args.query_group,
        "ttt_steps": 7,
        "timed_steps": args.steps,
        "load_average_after": list(_loadavg()),
        "results": rows,
    }
    dest = Path(__file__).parent / "results" / f"train_throughput_{machine_name()}.json"
    dest.parent.mkdir(exist_ok=True)
    dest.write_text(json.dumps(result, indent=1))
    print(f"saved {dest}")


def _loadavg() -> tuple[float, ...]:
    with contextlib.suppress(OSError):
        return tuple(float(x) for x in Path("/proc/loadavg").read_text().split()[:3])
    return ()


if __name__ == "__main__":
    main()
