"""``kvshot bench``: tokens/s of plain, speculative and HF decoding on MT-bench prompts, outside the notebooks.

    kvshot bench --drafters ngram runs/default/drafters/hidden-ttt --n-questions 10 --max-new-tokens 128 \\
        --precisions fp32 bf16 --repeats 3 --threads 1 --out benchmarks/results/bench.json

For every precision (``fp32`` is the exact reference; ``bf16`` runs the target and the drafters in bf16 where the
CPU has it; ``auto`` is bf16 where available) it reports tokens/s, the speedup over plain decoding in the same
precision and run, MAT, the time per phase (draft, verify, commit per cycle), the exact-match rate against plain
decoding, and the MAT that 1.5x would need; with ``--repeats`` the whole table runs that many times, interleaved,
and each figure is the median with its min-max range. Methods: ``ar``, ``chain``/``tree`` (fixed shapes),
``chain_chosen``/``tree_chosen`` (shapes chosen by expected speed under the measured cost model), ``combined``
(a chosen tree with prompt lookup in the same proposal), ``hf_generate``, ``hf_prompt_lookup``. A ``.json``
``--out`` also holds every repetition's rows, the divergences of greedy outputs with their top-2 logit margins,
the cost models and the machine.

It takes the same decoding arguments as ``kvshot generate``, checked before the target is loaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..decoding.cli import check_drafter_spec, decode_args, decode_config, load_cli_drafter, load_cli_target
from ..drafters import checkpoint_label
from ..target import DECODE_PRECISIONS, decode_dtype
from ..user_errors import UsageError
from . import speed_table, speedup

COLUMNS = [
    "method",
    "drafter",
    "precision",
    "tokens_per_s",
    "speedup_vs_ar",
    "speedup_min",
    "speedup_max",
    "mat",
    "exact_match_vs_ar",
    "draft_ms_per_cycle",
    "verify_ms_per_cycle",
    "commit_ms_per_cycle",
    "mat_for_1_5x",
]


def add_cli(sub) -> None:
    b = sub.add_parser(
        "bench", help="measure tokens/s of plain, chain, tree and HF decoding on MT-bench prompts"
    )
    decode_args(b)
    b.add_argument("--drafters", nargs="+", default=["ngram"], help="names or checkpoint folders")
    b.add_argument("--methods", nargs="+", default=list(speedup.METHODS), help=f"of {speedup.METHODS}")
    b.add_argument("--temperatures", nargs="+", type=float, default=[0.0])
    b.add_argument("--n-questions", type=int, default=4, help="MT-bench questions")
    b.add_argument("--turns", type=int, default=2, choices=(1, 2), help="1: first turns only; 2: both")
    b.add_argument(
        "--precisions",
        nargs="+",
        default=["fp32", "auto"],
        choices=DECODE_PRECISIONS,
        help="fp32 (exact reference), bf16, auto (bf16 where the CPU has it); each with its own plain decoding",
    )
    b.add_argument("--repeats", type=int, default=1, help="run the whole table this many times, interleaved")
    b.add_argument(
        "--drafter-methods",
        nargs="+",
        default=[],
        metavar="NAME=M1,M2",
        help="restrict a drafter to some methods, e.g. ngram=chain,chain_chosen",
    )
    b.add_argument(
        "--remeasure-costs", action="store_true", help="measure the cost models afresh (not cached)"
    )
    b.add_argument("--out", default=None, help="write the table here (.csv, or .json with everything)")
    b.set_defaults(func=_cli_bench)


def _cli_bench(args) -> int:
    if not 1 <= args.n_questions <= 80:
        raise UsageError(
            f"--n-questions takes a number of MT-bench questions in 1..80, got {args.n_questions}."
        )
    if args.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {args.repeats}.")
    base = decode_config(args, "chain")
    for t in args.temperatures:
        decode_config(argparse.Namespace(**{**vars(args), "temperature": t}), "chain")
    bad = [m for m in args.methods if m not in speedup.METHODS]
    if bad:
        raise UsageError(f"unknown methods {bad}; choose from {speedup.METHODS}.")
    drafter_methods = {}
    for item in args.drafter_methods:
        name, _, listed = item.partition("=")
        wrong = [m for m in listed.split(",") if m not in speedup.METHODS]
        if not name or not listed or wrong:
            raise UsageError(
                f"--drafter-methods takes NAME=M1,M2 with methods of {speedup.METHODS}: {item!r}"
            )
        drafter_methods[name] = tuple(listed.split(","))
    for spec in args.drafters:
        check_drafter_spec(spec, args.target)
    # bf16 on a CPU without it: refused here, before the target loads
    for precision in set(args.precisions) - {"auto"}:
        decode_dtype(precision, args.device)
    target = load_cli_target(args)
    drafters = {_label(spec): load_cli_drafter(spec, target, args.seed) for spec in args.drafters}
    setups = speedup.precision_setups(target, drafters, args.precisions)
    machine = speedup.machine_info()

    def save(plan, done):  # after every repetition: a cut-off run keeps what it measured
        if args.out:
            _write(Path(args.out), plan, setups, machine, args, done)

    plan = speedup.run_mtbench_benchmark(
        target,
        drafters,
        args.n_questions,
        args.turns,
        methods=args.methods,
        temperatures=args.temperatures,
        base=base,
        setups=setups,
        repeats=args.repeats,
        remeasure_costs=args.remeasure_costs,
        drafter_methods=drafter_methods,
        on_repeat=save,
    )
    table = speedup.speedup_table(plan, speedup.machine_name(machine))
    import pandas as pd

    with pd.option_context("display.width", 250, "display.max_columns", 30):
        print(table[COLUMNS].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    diverged = _write(Path(args.out), plan, setups, machine, args, args.repeats) if args.out else None
    if diverged is None:
        diverged = speed_table.divergences(plan, setups)
    if len(diverged):
        print(f"greedy outputs that differ from plain decoding ({len(diverged)}), top-2 logit margin there:")
        print(diverged.to_string(index=False, float_format=lambda x: f"{x:.4f}"))
    print(f"machine: {machine}")
    return 0


def _write(out: Path, plan, setups, machine: dict, args, done: int):
    """Write the table (.csv) or everything (.json); returns the divergences table."""
    out.parent.mkdir(parents=True, exist_ok=True)
    name = speedup.machine_name(machine)
    table = speedup.speedup_table(plan, name)
    diverged = speed_table.divergences(plan, setups)
    if out.suffix == ".json":
        costs = {m.precision: m.cfg.speed.cost.as_dict() for m in plan if m.cfg.speed is not None}
        bundle = dict(
            machine=machine,
            settings=dict(
                n_questions=args.n_questions,
                turns=args.turns,
                max_new_tokens=args.max_new_tokens,
                repeats=args.repeats,
                repeats_done=done,
                precisions=[s.precision for s in setups],
                drafters=args.drafters,
                threads=args.threads,
                chain_depth=args.chain_depth,
                tree=[args.tree_depth, args.tree_top_k, args.tree_budget],
                chosen_caps=speedup.CHOSEN_CAPS,
            ),
            table=table.to_dict(orient="records"),
            runs=speed_table.runs_table(plan, name).to_dict(orient="records"),
            divergences=diverged.to_dict(orient="records"),
            cost_models=costs,
        )
        text = json.dumps(bundle, indent=1, default=str)
    else:
        text = table.to_csv(index=False)
    tmp = out.with_name(out.name + ".tmp")  # written beside, then renamed: a killed run keeps a whole table
    tmp.write_text(text)
    tmp.replace(out)
    print(f"wrote {out} ({done} of {args.repeats} repetitions)")
    return diverged


def _label(spec: str) -> str:
    """A drafter's row label: its name, or its checkpoint folder's (``<row>@<run>`` for a committed one)."""
    return checkpoint_label(spec) if Path(spec).is_dir() else spec
