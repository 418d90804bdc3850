"""SpecPV at long context on the default target: plain, lossless speculative and partial-verification decoding.

Reports, on this machine, in one run (``kvshot_lib.evaluation.specpv_speed``): decode tokens/s at each
context length (4k and 8k tokens by default, capped to the target's context) for plain decoding, lossless
speculative decoding with the drafter, and SpecPV (its ``specpv`` and ``strict`` variants) over budget × P; the
ratios between them; per-phase milliseconds per token (draft, partial verification, full verification with
the re-feed, block scoring); MAT over partial and over full verification cycles (bonus counted); strict
mode's rollbacks. Then the cost model (``kvshot_lib.evaluation.specpv_cost``): a forward's cost fitted on
this machine from forwards timed on the real 8k cache, and the crossover context length beyond which SpecPV
beats lossless decoding here and, by the model, on an H100 with a Qwen3-8B-sized target.

Prints and saves ``benchmarks/results/specpv_<machine>.json``. Usage:
    python benchmarks/specpv.py [--contexts 4096 8192] [--drafters ngram] [--max-new-tokens 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
import torch

from kvshot_lib.corpus import context_lengths, long_context, long_prompts
from kvshot_lib.decoding import DecodeConfig, SpecPVConfig
from kvshot_lib.drafters import drafters_for_run
from kvshot_lib.evaluation import machine_info, machine_name, specpv_cost, specpv_speed
from kvshot_lib.target import load_target

RESULTS = Path(__file__).resolve().parent / "results"
SHOW = [
    "drafter",
    "context",
    "method",
    "budget",
    "full_every",
    "tokens_per_s",
    "speedup_vs_ar",
    "speedup_vs_lossless",
    "exact_match_vs_ar",
    "mat_partial",
    "mat_full",
    "draft_ms_per_token",
    "partial_ms_per_token",
    "full_ms_per_token",
    "refresh_ms_per_token",
    "n_rollbacks",
    "rollback_tokens",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--run-dir", default="runs/default", help="where notebook 02 left trained drafters")
    ap.add_argument("--drafters", nargs="+", default=["ngram"], help="baseline drafters")
    ap.add_argument(
        "--max-trained", type=int, default=1, help="trained drafters (under --run-dir) to time too"
    )
    ap.add_argument("--contexts", nargs="+", type=int, default=[4096, 8192])
    ap.add_argument("--n-prompts", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--chain-depth", type=int, default=4)
    ap.add_argument("--budgets", nargs="+", type=int, default=[512, 1024])
    ap.add_argument("--full-every", nargs="+", type=int, default=[16, 32])
    ap.add_argument("--variants", nargs="+", default=["specpv", "strict"], choices=["specpv", "strict"])
    ap.add_argument("--sink", type=int, default=32)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--cost-lengths", nargs="+", type=int, default=[256, 512, 1024, 2048, 4096, 8000])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument(
        "--out", default=None, help="JSON path (default: benchmarks/results/specpv_<machine>.json)"
    )
    args = ap.parse_args()
    base = SpecPVConfig(sink=args.sink, window=args.window, budget=max(args.budgets)).validate()
    for b in args.budgets:
        SpecPVConfig(sink=args.sink, window=args.window, budget=b).validate()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, device=args.device, dtype=args.dtype)
    cfg = DecodeConfig(
        mode="chain", max_new_tokens=args.max_new_tokens, chain_depth=args.chain_depth, stop_token_ids=()
    ).validate()
    lengths = context_lengths(
        args.contexts, target.info.max_context, args.max_new_tokens + args.chain_depth + 2
    )
    prompts = {
        n: [
            p.ids
            for p in long_prompts(target.tokenizer, n, args.n_prompts, max_context=target.info.max_context)
        ]
        for n in lengths
    }
    drafters, note = drafters_for_run(args.run_dir, target, args.drafters)
    timed = [*args.drafters, *[n for n in drafters if n not in args.drafters][: args.max_trained]]
    print(note, "| timed:", timed, "| contexts:", lengths)
    probe = specpv_cost.ForwardCostProbe(target, args.cost_lengths, max(lengths), base)
    rows = pd.concat(
        [
            specpv_speed.run_speed(
                target,
                drafters[name],
                prompts,
                cfg,
                args.budgets,
                args.full_every,
                args.variants,
                base,
                on_prefill=probe,
            )
            for name in timed
        ]
    )
    info = machine_info()
    table = specpv_speed.speed_table(rows, machine_name(info))
    fit = specpv_cost.fit_costs(probe.table)
    crossover, _ = specpv_cost.cost_model_table(table, fit, [])
    with pd.option_context("display.width", 250, "display.max_columns", 40):
        print(table[SHOW].round(3).to_string(index=False))
        print("\nforward cost fit (seconds):", {k: f"{v:.3g}" for k, v in fit.items()})
        print(crossover.round(3).to_string(index=False))
    out = Path(args.out) if args.out else RESULTS / f"specpv_{machine_name(info)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    blob = dict(
        machine=info,
        target=target.info.name,
        max_context=target.info.max_context,
        contexts=lengths,
        source=long_context.SOURCE,
        licence=long_context.LICENCE,
        args=vars(args),
        note=note,
        speed=table.to_dict(orient="records"),
        rows=rows.to_dict(orient="records"),
        forward_costs=probe.table.to_dict(orient="records"),
        cost_fit=fit,
        crossover=crossover.to_dict(orient="records"),
    )
    out.write_text(json.dumps(blob, indent=1, default=float))
    print("saved", out)


if __name__ == "__main__":
    main()
