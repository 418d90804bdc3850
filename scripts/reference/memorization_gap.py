"""The data question's direct test: has a drafter memorized the answers it trained on?
(:mod:`kvshot_lib.diagnostics.memorization`).

For stage 2's and stage 3's headline drafters, and stage 4's two hidden drafters (the same 24M token-passes on
stage 2's and stage 3's data), from their checkpoints, on the default target in float32:
teacher-forced acc_0..acc_6 and cross-entropy on ``--conversations`` of the drafter's own training conversations
(seen), against the same number it never saw from the same seeded training split (the conversations stage 3 added
after stage 2's slice: only a stage-2 row has them) and against the held-out split. Each set is prepared the way
the row trained (its conversations with looping answers dropped, or each loop cut after its first repetition).
A data-limited drafter fits what it has seen better than what it has not: the gap grows with its passes over the
data (stage 2: 5.5 passes over 1.32M tokens; stage 3: 1.2 passes over 6.32M).
Then each stage-2-data drafter against its stage-3-data peer of the same budget (:data:`PAIRS`) on the same
conversations, paired: the first's seen ones (the second trained on them too, a few times fewer) and the held-out
ones neither saw. Writes
``figures/onpolicy/data/memorization_gap.csv`` and ``memorization_paired.csv``, and draws
``figures/onpolicy/04_memorization_gap``.

    # stage 2's and stage 3's checkpoints come back from git history first (the onpolicy profile's comment says how)
    .venv/bin/python scripts/reference/memorization_gap.py   # ~20 minutes on 2 CPU cores, 14 once features exist
    # stage 4's pair only (the other rows' tables are kept)
    .venv/bin/python scripts/reference/memorization_gap.py --drafter hidden31-ttt-noloop-s4=checkpoints/onpolicy/hidden31-ttt-noloop-s4 \
        --drafter hidden31-ttt-s4=checkpoints/onpolicy/hidden31-ttt-s4
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pandas as pd
import torch

from kvshot_lib import plots
from kvshot_lib.corpus import cut_looping, extract_features
from kvshot_lib.diagnostics import paired_difference, per_sequence, seen_unseen_gap
from kvshot_lib.drafters import load_drafter
from kvshot_lib.reference import checkpoint_folders, merged_table
from kvshot_lib.reference import data as ref_data
from kvshot_lib.reference import plan as ref_plan
from kvshot_lib.target import assets, load_target
from kvshot_lib.training import EvalSet

DRAFTERS = {
    "hidden31-ttt-noloop-s2": "runs/onpolicy/drafters/hidden31-ttt-noloop-s2",
    "hidden31-ttt-s3": "runs/onpolicy/drafters/hidden31-ttt-s3",  # from git history (onpolicy profile)
    "hybrid31-ttt-s3": "runs/onpolicy/drafters/hybrid31-ttt-s3",  # from git history (onpolicy profile)
    "hidden31-ttt-noloop-s4": "checkpoints/onpolicy/hidden31-ttt-noloop-s4",
    "hidden31-ttt-s4": "checkpoints/onpolicy/hidden31-ttt-s4",
}
PAIRS = (  # many passes over little data, few over much, at the same budget
    ("hidden31-ttt-noloop-s2", "hidden31-ttt-s3"),  # ~7.5M token-passes
    ("hidden31-ttt-noloop-s4", "hidden31-ttt-s4"),  # 24M
)
WIDEST = "hidden31-ttt-s3"  # the row whose slice holds every other row's (the unseen pool of a smaller slice)
STEPS, BATCH = 7, 2
CAPTION = (
    "SmolLM2-135M-Instruct, float32 · target-answered ShareGPT conversations, prepared as each row trained · "
    "seen: its own training conversations; unseen: later ones of the same split, or the held-out split"
)


def prepared(split, loops: str, stops):
    """``split`` the way a row with ``loops`` trained on it (``drop``: without conversations whose answers loop;
    ``cut``: each loop cut after its first repetition; ``keep``: as it is)."""
    if loops == "drop":
        return split.subset(ref_data.without_looping(split, stops))
    return cut_looping(split, stops) if loops == "cut" else split


def sample(split, n: int, seed: int):
    """``n`` conversations of ``split`` drawn without replacement (all of them where it has fewer), in order."""
    rng = np.random.default_rng(seed)
    return split.subset(sorted(rng.choice(len(split), min(n, len(split)), replace=False)))


def passes_over_data(info, row) -> dict:
    """A row's unique training tokens, its token-passes in all (a row continued from another's weights counts
    the passes before it, ``tokens_before``) and its passes over its data, from its ``reference_rows.csv`` entry
    ``info``; NaN where it has none."""
    unique, trained = info.get("unique_tokens", np.nan), info.get("train_tokens", np.nan)
    total = trained + row.train_config().tokens_before
    return dict(unique_tokens=unique, token_passes=total, passes=round(total / unique, 2))


def evaluate(part, target, drafter, row) -> pd.DataFrame:
    """Per-conversation outcomes (:func:`per_sequence`) of ``drafter`` on the conversations ``part``, cropped at
    ``row``'s ``max_tokens`` as in training."""
    store = extract_features(target, part, precision="no")
    evals = EvalSet.build(store, drafter.cfg, target, len(part), BATCH, row.train_config().max_tokens)
    return per_sequence(drafter, evals, STEPS, BATCH)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", action="append", metavar="NAME=FOLDER", help="a row's checkpoint to measure")
    ap.add_argument("--conversations", type=int, default=64, help="per set (the held-out split has 64)")
    args = ap.parse_args()
    if args.conversations < 8:
        sys.exit(f"--conversations must be at least 8, got {args.conversations}.")
    plan = ref_plan.load_plan("onpolicy")
    try:
        folders = checkpoint_folders(args.drafter, DRAFTERS, assets.REPO_ROOT)
        rows = {name: plan.row(name) for name in folders}  # NAME: a row of the onpolicy plan
    except (ValueError, ref_plan.PlanError) as e:
        sys.exit(str(e))
    torch.manual_seed(0)
    target = load_target(plan.target, device="cpu", dtype="float32")
    stops = target.info.eos_token_ids
    widest = plan.row_data_spec(plan.row(WIDEST))
    history = pd.read_csv(assets.REPO_ROOT / "figures" / "onpolicy" / "data" / "reference_rows.csv")
    history = history.set_index("drafter")
    drafters = {name: load_drafter(folder, target) for name, folder in folders.items()}
    tables, parts, measured = [], {}, {}
    for name, drafter in drafters.items():
        row = rows[name]
        spec = plan.row_data_spec(row)
        train, held, _ = ref_data.data_splits(plan, target, row.responses, spec)
        sets = {"held-out split": held}
        if spec["n_train_conversations"] < widest["n_train_conversations"]:
            pool, _, _ = ref_data.data_splits(plan, target, row.responses, widest)
            mine = set(train.source_ids)
            sets["later training conversations"] = pool.subset(
                [i for i, s in enumerate(pool.source_ids) if s not in mine]
            )
        parts[name, "seen"] = sample(prepared(train, row.loops, stops), args.conversations, seed=1)
        measured[name, "seen"] = evaluate(parts[name, "seen"], target, drafter, row)
        info = history.loc[name] if name in history.index else {}
        for i, (unseen_set, split) in enumerate(sets.items()):
            parts[name, unseen_set] = sample(
                prepared(split, row.loops, stops), args.conversations, seed=2 + i
            )
            measured[name, unseen_set] = evaluate(parts[name, unseen_set], target, drafter, row)
            tables.append(
                seen_unseen_gap(measured[name, "seen"], measured[name, unseen_set]).assign(
                    drafter=name,
                    unseen_set=unseen_set,
                    loops=row.loops,
                    **passes_over_data(info, row),
                )
            )
            print(f"{name} vs {unseen_set}:\n{tables[-1][tables[-1]['k'] == 0].to_string(index=False)}")
    out = assets.REPO_ROOT / "figures" / "onpolicy" / "data"
    path = out / "memorization_gap.csv"
    merged_table(path, pd.concat(tables, ignore_index=True), ["drafter"]).to_csv(path, index=False)
    for x, y in PAIRS:  # y on x's seen conversations and x's held-out ones, paired with x
        if x not in drafters or y not in drafters:
            continue
        on = {
            which: evaluate(parts[x, which], target, drafters[y], rows[y])
            for which in ("seen", "held-out split")
        }
        paired = paired_difference(
            measured[x, "seen"], on["seen"], measured[x, "held-out split"], on["held-out split"]
        ).assign(drafter=x, minus=y, unseen_set="held-out split")
        print(f"{x} - {y}, seen by {x} minus held out:\n{paired[paired['k'] == 0].to_string(index=False)}")
        path = out / "memorization_paired.csv"
        merged_table(path, paired, ["drafter", "minus"]).to_csv(path, index=False)
    plots.set_caption(out, "04_memorization_gap", CAPTION)
    plots.draw("04_memorization_gap", out, out.parent)


if __name__ == "__main__":
    main()
