"""FLOPs per training token of the reference run's rows (online: target forward + drafter forward and backward).

Counted with ``torch.utils.flop_counter.FlopCounterMode`` (matrix products; elementwise work is not counted) on
SmolLM2 at two sequence lengths, then extrapolated to the reference length with ``flops(T) = a*T + b*T^2`` (the
attention's dense context segments grow with T^2). With an assumed effective GPU rate this gives tokens/s and
tokens per row-minute: an estimate for planning the GPU jobs, to be replaced by the first job's calibration.
Prints and saves ``benchmarks/results/reference_flops.json``. Usage:
    python benchmarks/reference_flops.py [--lengths 256 512] [--target-length 2048] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from kvshot_lib.drafters import build_drafter, drafter_config_for
from kvshot_lib.reference import load_plan
from kvshot_lib.target import load_target
from kvshot_lib.training import Objective, batch_from_target

ROWS = [
    "none-ttt",
    "hidden-ttt",
    "kv2-ttt",
    "hybrid-ttt",
    "kv1-concat-ttt",
    "kv4-ttt",
    "cross-ttt",
    "hidden-tf",
]
RATES_TFLOPS = (
    25.0,
    50.0,
    100.0,
)  # assumed effective rates of the whole step on an H100 (dense bf16 peak ~990)


def count(fn) -> float:
    with FlopCounterMode(display=False) as fc:
        fn()
    return float(fc.get_total_flops())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs=2, default=[256, 512])
    ap.add_argument("--target-length", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    plan = load_plan("reference-gpu")
    tgt = load_target(plan.target, device="cpu", dtype="float32")
    g = torch.Generator().manual_seed(0)
    per_len = {}
    for T in args.lengths:
        ids = torch.randint(0, 40000, (T,), generator=g)
        mask = torch.rand(T, generator=g) < 0.6  # about the assistant share of ShareGPT tokens
        with torch.no_grad():
            target_flops = count(lambda ids=ids: tgt.model(input_ids=ids[None], logits_to_keep=1))
        rows = {}
        for name in ROWS:
            cfg = plan.row(name).train_config(max_tokens=None)
            dcfg = drafter_config_for(
                tgt,
                cfg.paradigm,
                cfg.n_layers,
                cfg.kv_mode,
                draft_vocab_size=cfg.draft_vocab_size,
                query_group=cfg.query_group,
            )
            d = build_drafter(dcfg, tgt, torch.arange(cfg.draft_vocab_size) * 5, seed=0)
            batch = batch_from_target(tgt, ids, mask, dcfg)
            obj = Objective(d, cfg)

            def step(obj=obj, batch=batch):
                loss, _ = obj(batch)
                loss.backward()

            rows[name] = count(step)
        per_len[T] = dict(target=target_flops, rows=rows)
        print(
            f"T={T}: target {target_flops / T / 1e6:.0f} MFLOP/token; "
            + ", ".join(f"{k} {v / T / 1e6:.0f}" for k, v in rows.items())
        )
    (t1, t2), T = args.lengths, args.target_length

    def extrapolate(f1: float, f2: float) -> float:  # f = a T + b T^2 through both points, per token at T
        b = (f2 / t2 - f1 / t1) / (t2 - t1)
        a = f1 / t1 - b * t1
        return a + b * T

    table = []
    target = extrapolate(per_len[t1]["target"], per_len[t2]["target"])
    for name in ROWS:
        drafter = extrapolate(per_len[t1]["rows"][name], per_len[t2]["rows"][name])
        total = drafter + target
        row = dict(
            row=name,
            drafter_gflop_per_token=drafter / 1e9,
            target_gflop_per_token=target / 1e9,
            total=total / 1e9,
        )
        for r in RATES_TFLOPS:
            row[f"tokens_per_s_at_{int(r)}tflops"] = r * 1e12 / total
            row[f"mtokens_per_4min_at_{int(r)}tflops"] = r * 1e12 / total * 240 / 1e6
        table.append(row)
        print(
            f"{name:16s} {total / 1e9:5.2f} GFLOP/token at T={T}: "
            + ", ".join(
                f"{row[f'tokens_per_s_at_{int(r)}tflops'] / 1e3:.0f}k tok/s @ {r:.0f} TFLOP/s"
                for r in RATES_TFLOPS
            )
        )
    out = Path(__file__).parent / "results" / "reference_flops.json"
    out.write_text(
        json.dumps(
            dict(
                lengths=args.lengths,
                target_length=T,
                assumed_rates_tflops=RATES_TFLOPS,
                rows=table,
                counted=per_len,
            ),
            indent=1,
        )
    )
    print("saved", out)


if __name__ == "__main__":
    main()
