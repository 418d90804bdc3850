"""``kvshot bench``: tokens/s of plain, chain, tree and HF decoding on MT-bench prompts, outside the notebooks.

    kvshot bench --drafters ngram self --n-questions 4 --max-new-tokens 64 --out benchmarks/results/cli.csv

It takes the same decoding arguments as ``kvshot generate``, checked before the target is loaded.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..decoding.cli import check_drafter_spec, decode_args, decode_config, load_cli_drafter, load_cli_target
from . import speedup


def add_cli(sub) -> None:
    b = sub.add_parser(
        "bench", help="measure tokens/s of plain, chain, tree and HF decoding on MT-bench prompts"
    )
    decode_args(b)
    b.add_argument("--drafters", nargs="+", default=["ngram"], help="names or checkpoint folders")
    b.add_argument("--methods", nargs="+", default=["ar", "chain", "tree", "hf_generate", "hf_prompt_lookup"])
    b.add_argument("--temperatures", nargs="+", type=float, default=[0.0])
    b.add_argument("--n-questions", type=int, default=4, help="MT-bench questions")
    b.add_argument("--turns", type=int, default=2, choices=(1, 2), help="1: first turns only; 2: both")
    b.add_argument("--out", default=None, help="write the table here (.csv or .json)")
    b.set_defaults(func=_cli_bench)


def _cli_bench(args) -> int:
    if not 1 <= args.n_questions <= 80:
        raise SystemExit(
            f"kvshot: --n-questions takes a number of MT-bench questions in 1..80, got {args.n_questions}."
        )
    base = decode_config(args, "chain")
    for t in args.temperatures:
        decode_config(argparse.Namespace(**{**vars(args), "temperature": t}), "chain")
    bad = [m for m in args.methods if m not in speedup.METHODS]
    if bad:
        raise SystemExit(f"kvshot: unknown methods {bad}; choose from {speedup.METHODS}.")
    for spec in args.drafters:
        check_drafter_spec(spec, args.target)
    target = load_cli_target(args)
    drafters = {spec: load_cli_drafter(spec, target, args.seed) for spec in args.drafters}
    plan = speedup.run_mtbench_benchmark(
        target,
        drafters,
        args.n_questions,
        args.turns,
        methods=args.methods,
        temperatures=args.temperatures,
        base=base,
    )
    table = speedup.speedup_table(plan)
    import pandas as pd

    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(
            table[
                [
                    "method",
                    "drafter",
                    "temperature",
                    "tokens_per_s",
                    "speedup_vs_ar",
                    "mat",
                    "exact_match_vs_ar",
                ]
            ].to_string(index=False, float_format=lambda x: f"{x:.3f}")
        )
    print(f"machine: {speedup.machine_info()}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        table.to_json(out, orient="records", indent=1) if out.suffix == ".json" else table.to_csv(
            out, index=False
        )
        print(f"wrote {out}")
    return 0
