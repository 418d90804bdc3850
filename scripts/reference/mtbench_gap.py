"""The on-policy run's MT-bench acceptance gap, decomposed (:mod:`kvshot_lib.diagnostics.mtbench_gap`).

For the committed headline drafters (``hidden31-ttt-s4`` and ``hidden31-ttt@reference``; the committed tables hold
``hidden31-ttt-s3``'s and ``hybrid31-ttt-s3``'s as well, measured while they were committed), on the default target
in float32:
teacher-forced acc_0..acc_6 on the 160 MT-bench greedy references (80 questions x 2 turns, 64 tokens, cut at the
stop token) and on the on-policy held-out set with loops cut (whole answers, and each answer's first 64 tokens),
the chain replay's alpha_0 on the same references, and the gap between them split into answer position, prompt
distribution and cycle weighting. Writes, under ``figures/onpolicy/data/``: ``mtbench_gap.csv`` (the
decomposition with 95% bootstrap intervals), ``mtbench_gap_bins.csv`` (accuracy by answer position, turn and the
target's top-1 probability, steps 0-6, both sets) and ``ce_spread.json`` (the per-token cross-entropy spread the
convergence rule falls back on); then draws ``figures/onpolicy/04_mtbench_gap``. ``--drafter NAME=FOLDER`` (repeated)
measures other checkpoints instead, e.g. a row's under ``runs/``; their rows replace their own in the tables and the
other drafters' rows stay.

    .venv/bin/python scripts/reference/mtbench_gap.py        # about 20 minutes on 2 CPU cores
    .venv/bin/python scripts/reference/mtbench_gap.py --drafter hidden31-ttt-noloop-ft=runs/onpolicy/drafters/hidden31-ttt-noloop-ft
    # hybrid31-ttt-s3 again: into runs/ from git history first (the onpolicy profile's comment says how)
    .venv/bin/python scripts/reference/mtbench_gap.py --drafter hybrid31-ttt-s3=runs/onpolicy/drafters/hybrid31-ttt-s3
"""

from __future__ import annotations

import argparse
import json
import sys

import pandas as pd
import torch

from kvshot_lib import plots
from kvshot_lib.corpus import cut_looping, extract_features, regenerate, tokenize_sharegpt
from kvshot_lib.decoding import DecodeConfig
from kvshot_lib.diagnostics import (
    binned_accuracy,
    cycle_start_positions,
    gap_table,
    outcome_rows,
    reference_split,
)
from kvshot_lib.drafters import load_drafter
from kvshot_lib.evaluation import acceptance
from kvshot_lib.reference import checkpoint_folders, merged_table
from kvshot_lib.reference import data as ref_data
from kvshot_lib.reference import plan as ref_plan
from kvshot_lib.target import assets, load_target
from kvshot_lib.training import EvalSet

DRAFTERS = {
    "hidden31-ttt-s4": "checkpoints/onpolicy/hidden31-ttt-s4",
    "hidden31-ttt@reference": "checkpoints/reference/hidden31-ttt",
}
FIRST = 64
CAPTION = (
    "SmolLM2-135M-Instruct, float32 · held-out: 64 target-answered ShareGPT conversations, loops cut · "
    "MT-bench: 80 questions x 2 turns, 64 greedy tokens"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", action="append", metavar="NAME=FOLDER", help="a checkpoint to measure")
    try:
        folders = checkpoint_folders(ap.parse_args().drafter, DRAFTERS, assets.REPO_ROOT)
    except ValueError as e:
        sys.exit(str(e))
    torch.manual_seed(0)
    plan = ref_plan.load_plan("onpolicy")
    d, e, steps = plan.data, plan.eval, 7
    target = load_target(plan.target, device="cpu", dtype="float32")
    held_orig = tokenize_sharegpt(
        target.tokenizer,
        "eval",
        d["n_eval_conversations"],
        d["max_len"],
        seed=plan.seed,
        min_len=int(d["min_len"]),
    )
    r = d["regenerate"]
    held = regenerate.cached_regeneration(
        target, held_orig, r["max_new_tokens"], r["max_turns"], ref_data.regeneration_root(plan)
    )
    if held is None:
        sys.exit(
            "the on-policy held-out answers are missing: data/regenerated/ should hold them (git checkout)."
        )
    held = cut_looping(held, target.info.eos_token_ids)
    cache = assets.cache_dir() / "mtbench_gap" / "references.json"
    refs = acceptance.greedy_references(
        target, e["n_questions"], e["max_new_tokens"], True, cache=cache, batch_size=80
    )
    base = DecodeConfig(max_new_tokens=e["max_new_tokens"], seed=plan.seed, chain_depth=e["chain_depth"])
    chain = acceptance.mode_configs(base, ["chain"])
    drafters = {name: load_drafter(folder, target) for name, folder in folders.items()}
    runs = {run.drafter: run for run in acceptance.run_greedy_replay(target, drafters, refs, chain)}
    lengths = [len(res.token_ids) for res in next(iter(runs.values())).results]  # greedy: the same for all
    mt_split = reference_split(refs, lengths)
    stores = {
        "heldout": (held, extract_features(target, held, precision="no")),
        "mtbench": (mt_split, extract_features(target, mt_split, precision="no")),
    }
    head = target.model.lm_head.weight.detach()
    gaps, bins, spread = [], [], {}
    for name, drafter in drafters.items():
        rows = {}
        for which, (split, store) in stores.items():
            evals = EvalSet.build(store, drafter.cfg, target, len(split), 2)
            rows[which] = outcome_rows(drafter, evals, split, head, steps, 2).assign(set=which, drafter=name)
        turn = {i: ref.turn + 1 for i, ref in enumerate(refs)}
        rows["mtbench"]["turn"] = rows["mtbench"]["sequence"].map(turn)
        run = runs[name]
        starts = {i: cycle_start_positions(res) for i, res in enumerate(run.results)}
        attempts, accepts = run.step_counts()
        gaps.append(
            gap_table(rows["heldout"], rows["mtbench"], starts, (accepts[0], attempts[0]), FIRST).assign(
                drafter=name
            )
        )
        both = pd.concat(rows.values(), ignore_index=True)
        bins += [
            binned_accuracy(both, "answer_pos"),
            binned_accuracy(both, "p1"),
            binned_accuracy(rows["mtbench"], "turn"),
        ]
        h0 = rows["heldout"][rows["heldout"]["k"] == 0]["ce"]
        spread[name] = dict(
            ce_mean=float(h0.mean()),
            ce_sd=float(h0.std()),
            sd_per_mean=float(h0.std() / h0.mean()),
            n=len(h0),
        )
    out = assets.REPO_ROOT / "figures" / "onpolicy" / "data"
    for name, parts in (("mtbench_gap.csv", gaps), ("mtbench_gap_bins.csv", bins)):
        merged_table(out / name, pd.concat(parts, ignore_index=True), ["drafter"]).to_csv(
            out / name, index=False
        )
    spread_path = out / "ce_spread.json"
    old = json.loads(spread_path.read_text()) if spread_path.is_file() else {}
    spread = {**old, **spread, "machine": dict(precision="float32", threads=torch.get_num_threads())}
    spread_path.write_text(json.dumps(spread, indent=1) + "\n")
    print(pd.concat(gaps).to_string())
    plots.set_caption(out, "04_mtbench_gap", CAPTION)
    plots.draw("04_mtbench_gap", out, out.parent)


if __name__ == "__main__":
    main()
