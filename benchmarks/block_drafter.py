"""Block drafters on the default target, on this machine: held-out per-step accuracy and MT-bench acceptance,
each beside its zeroed-context control, at the default profile's training budget (notebook 02's settings).

    python benchmarks/block_drafter.py --rows block-kv block-kv-zeroed --threads 1
    python benchmarks/block_drafter.py --rows block-kv block-kv-zeroed kv-ttt --n-questions 8

Every row is trained with ``train_drafter`` into ``<run-dir>/drafters/<row>`` (resumable; a finished row is read
back from disk), then evaluated: held-out accuracy at draft steps 0..6 (with the target KV real, zeroed and
shuffled for the KV-reading rows), and greedy MT-bench acceptance (chain and tree, replayed exactly as the
engine decodes: ``kvshot_lib.evaluation.acceptance``). Prints the tables and saves them, with the machine and
the settings, to ``benchmarks/results/block_drafter_<machine>.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

ROWS = {
    "block-kv": dict(paradigm="block", regime="parallel", context="kv", n_layers=2),
    "block-hidden": dict(paradigm="block", regime="parallel", context="hidden", n_layers=2),
    "block-both": dict(paradigm="block", regime="parallel", context="both", n_layers=2),
    "kv-ttt": dict(paradigm="kv", regime="ttt"),  # the KV-only TTT drafter of the default profile
}
ROWS.update({f"{name}-zeroed": dict(spec, target_kv="zeroed") for name, spec in list(ROWS.items())})
# notebook 02's parameters under the default profile
SHARED = dict(
    train_steps=400,
    batch_size=2,
    max_tokens=512,
    lr=3e-3,
    ttt_steps=7,
    branch_fraction=0.25,
    query_group=1,
    eval_every=100,
    eval_sequences=24,
    eval_branch_fraction=0.5,
    probe_every=10,
    draft_vocab_size=4096,
    seed=0,
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", default=["block-kv", "block-kv-zeroed"], choices=sorted(ROWS))
    p.add_argument("--run-dir", default="runs/block-cpu")
    p.add_argument("--train-steps", type=int, default=SHARED["train_steps"])
    p.add_argument("--n-questions", type=int, default=8, help="MT-bench questions (both turns)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--baselines", nargs="*", default=["ngram"], help="untrained drafters measured alongside")
    p.add_argument(
        "--extra", nargs="*", default=[], help="other trained checkpoint folders measured alongside"
    )
    p.add_argument(
        "--train-only", action="store_true", help="train the rows, evaluate nothing (parallel runs)"
    )
    p.add_argument(
        "--out", default=None, help="JSON file (default benchmarks/results/block_drafter_<cpu>.json)"
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from kvshot_lib import corpus
    from kvshot_lib.decoding import DecodeConfig
    from kvshot_lib.drafters import resolve_drafter
    from kvshot_lib.evaluation import (
        acceptance_summary,
        acceptance_table,
        greedy_references,
        machine_info,
        machine_name,
        mode_configs,
        run_greedy_replay,
    )
    from kvshot_lib.target import load_target
    from kvshot_lib.training import (
        build_draft_vocab,
        kv_ablation_table,
        parse_drafter_specs,
        per_step_table,
        train_drafter,
        training_times,
    )

    configs = parse_drafter_specs(
        [{**ROWS[r], "name": r} for r in args.rows], {**SHARED, "train_steps": args.train_steps}
    )
    target = load_target("smollm2-135m", device="cpu", dtype="float32")
    train_store = corpus.extract_features(
        target, corpus.tokenize_sharegpt(target.tokenizer, "train", 300, 1024, seed=0)
    )
    eval_store = corpus.extract_features(
        target, corpus.tokenize_sharegpt(target.tokenizer, "eval", 40, 1024, seed=0)
    )
    d2t = build_draft_vocab(train_store, target, SHARED["draft_vocab_size"])
    results = []
    for cfg in configs:
        t0 = time.perf_counter()
        results.append(
            train_drafter(
                target, train_store, eval_store, cfg, Path(args.run_dir) / "drafters" / cfg.name, d2t=d2t
            )
        )
        print(f"{cfg.name}: ready in {time.perf_counter() - t0:.0f} s", flush=True)
    if args.train_only:
        return 0
    per_step = per_step_table(results)
    times = training_times(results)
    ablation = kv_ablation_table(
        results,
        eval_store,
        target,
        7,
        SHARED["eval_sequences"],
        SHARED["batch_size"],
        SHARED["max_tokens"],
        0.5,
    )
    refs = greedy_references(target, args.n_questions, args.max_new_tokens)
    base = DecodeConfig(
        max_new_tokens=args.max_new_tokens, chain_depth=7, tree_depth=7, tree_top_k=4, tree_budget=24
    )
    drafters = {name: resolve_drafter(name, target) for name in [*args.baselines, *args.extra]}
    drafters.update({r.config.name: r.drafter for r in results})
    runs = run_greedy_replay(target, drafters, refs, mode_configs(base, ("chain", "tree")))
    summary, by_step = acceptance_summary(runs), acceptance_table(runs, max_steps=7)
    print(per_step.pivot(index="drafter", columns="draft_step", values="accuracy").round(3).to_string())
    if len(ablation):
        print(
            ablation.pivot_table(
                index=["drafter", "condition"], columns="draft_step", values="accuracy"
            ).round(3)
        )
    print(
        summary[["drafter", "mode", "mat", "alpha_0", "alpha_6", "retention", "n_cycles"]]
        .round(3)
        .to_string()
    )
    print(times.to_string())
    out = Path(args.out or f"benchmarks/results/block_drafter_{machine_name()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            dict(
                machine=machine_info(),
                target="smollm2-135m",
                data="ShareGPT V3: 300 training / 40 held-out conversations (default profile); MT-bench "
                f"{args.n_questions} questions x 2 turns, {args.max_new_tokens} new tokens, greedy",
                settings={**SHARED, "train_steps": args.train_steps},
                rows={r: ROWS[r] for r in args.rows},
                per_step_accuracy=per_step.to_dict("records"),
                kv_ablation=ablation.to_dict("records"),
                acceptance_summary=summary.to_dict("records"),
                acceptance_by_step=by_step.to_dict("records"),
                training_times=times.to_dict("records"),
            ),
            indent=1,
            default=float,
        )
    )
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
