"""Notebook 04's query-estimation error of a target-initialized row *before* training, beside the trained rows.

Row 7 of the reference run (``kv-ttt-tinit``) starts its attention from the target layers whose KV it reads,
meant to start its queries in the target's key space. Whether they start there, and where training takes them,
is what this measures: the row's drafter at step 0 (rebuilt with the seed its checkpoint trained with, then
:func:`~kvshot_lib.drafters.init_attention_from_target`, as the training loop builds it) on the same MT-bench
turns as notebook 04, and paired differences, on the same turns, between it, the trained row and another
trained row (``--against``), read from notebook 04's ``runs/<run>/results/query_error_by_step.csv``::

    python scripts/reference/query_error_at_init.py --row kv-ttt-tinit --against kv-ttt \\
        --out figures/reference/data/partial/kv-ttt-tinit_query_error.csv

Prints the summary (all draft steps, sink removed, per head and per KV-head group) and writes every step,
variant and level.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import pandas as pd

from kvshot_lib.diagnostics import measure_drafters, stale_verdict
from kvshot_lib.drafters import build_drafter, init_attention_from_target, load_drafter
from kvshot_lib.evaluation import acceptance
from kvshot_lib.reference import load_plan, run
from kvshot_lib.target import REPO_ROOT


def paired(by_step: pd.DataFrame, a: str, b: str, metric: str) -> pd.DataFrame:
    """``a`` minus ``b`` on the same turns (:func:`stale_verdict` with ``b``'s drafter rows as the baseline)."""
    rows = by_step[(by_step["estimator"] == "drafter") & by_step["drafter"].isin([a, b])]
    rows = rows.assign(estimator=rows["drafter"].map({a: "drafter", b: "stale"}), drafter=f"{a} - {b}")
    return stale_verdict(rows, metric).assign(metric=metric)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="reference")
    ap.add_argument("--row", default="kv-ttt-tinit")
    ap.add_argument("--against", default="kv-ttt")
    ap.add_argument("--n-steps", type=int, default=7, help="draft steps, as notebook 04 ran (its n_steps)")
    ap.add_argument("--out", default=None, help="write the paired differences here (CSV)")
    args = ap.parse_args()
    plan = load_plan(args.run)
    results = REPO_ROOT / "runs" / plan.run_name / "results"
    trained_tables = results / "query_error_by_step.csv"
    if not trained_tables.is_file():
        raise SystemExit(f"{trained_tables} is missing: run notebook 04 first (--steps notebooks).")
    trained = pd.read_csv(trained_tables)
    missing = {args.row, args.against} - set(trained["drafter"])
    if missing:
        raise SystemExit(f"notebook 04's tables have no {sorted(missing)}: run it with those rows.")

    target = run.load_reference_target(plan, "cpu")
    row = load_drafter(run.checkpoint_path(plan, args.row), target)
    start = build_drafter(
        copy.deepcopy(row.cfg), target, row.d2t.cpu(), seed=row.cfg.extra["train_config"]["seed"]
    )
    init_attention_from_target(start, target)
    e = plan.eval
    refs = acceptance.greedy_references(
        target, e["n_questions"], e["max_new_tokens"], cache=results / "mtbench_greedy.json", batch_size=80
    )
    at_init = f"{args.row}@init"
    tables, _ = measure_drafters(target, {at_init: start}, refs, args.n_steps)
    by_step = pd.concat([tables["by_step"], trained], ignore_index=True)
    out = pd.concat(
        [stale_verdict(tables["by_step"], m).assign(metric=m) for m in ("out_err", "kl_bits")]
        + [
            paired(by_step, a, b, m)
            for a, b in ((at_init, args.row), (args.row, args.against))
            for m in ("out_err", "kl_bits", "cosine")
        ],
        ignore_index=True,
    )
    summary = out[(out["step"] == -1) & (out["variant"] == "without_sink")]
    cols = ["drafter", "level", "metric", "drafter_mean", "stale_mean", "diff", "ci_lo", "ci_hi"]
    print(summary[cols].to_string(index=False, float_format="%.3f"))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        out.to_csv(args.out, index=False, float_format="%.5g")


if __name__ == "__main__":
    main()
