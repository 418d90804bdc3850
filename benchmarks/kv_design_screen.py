"""Issue 12's screen: why did the KV-only drafter learn nothing from the target's KV, and what fixes it?

Each variant of the one-layer KV-only drafter is trained on the default profile's data (SmolLM2-135M,
300 ShareGPT conversations, batch 2 x 512 tokens, lr 3e-3, draft vocabulary 4096) for the same number of
steps, then evaluated on the 40 held-out conversations with the target's KV real, zeroed and shuffled.
Its control is the same variant trained with the KV zeroed (``+zero``). A variant reads the KV when its
"real" accuracy beats both its ablations and its control.

    python benchmarks/kv_design_screen.py shared tf 300          # the first design (one shared softmax)
    python benchmarks/kv_design_screen.py separate+recency ttt 300
    python benchmarks/kv_design_screen.py separate+zero tf 300    # its control

Options joined by '+': ``shared`` | ``separate`` (kv_softmax), ``recency`` (a 32-position recency bias),
``zero`` (trained with the target KV zeroed), ``L2`` (two layers). Each result is appended as one JSON line
to ``benchmarks/results/kv_design_screen_<machine>.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvshot_lib import corpus
from kvshot_lib.evaluation import machine_name
from kvshot_lib.target import load_target
from kvshot_lib.training import (
    EvalSet,
    TrainConfig,
    build_draft_vocab,
    evaluate_per_step,
    train_drafter,
    with_target_kv,
)

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("variant", help="options joined by '+', e.g. separate+recency")
    p.add_argument("regime", choices=("tf", "ttt"))
    p.add_argument("steps", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="runs/kv_design_screen")
    args = p.parse_args()
    opts = set(args.variant.split("+"))
    unknown = opts - {"shared", "separate", "recency", "zero", "L2"}
    if unknown:
        raise SystemExit(f"unknown options {sorted(unknown)}; use shared, separate, recency, zero, L2")
    torch.set_num_threads(args.threads)
    tgt = load_target("smollm2-135m", device="cpu", dtype="float32")
    split = corpus.tokenize_sharegpt
    train = corpus.extract_features(tgt, split(tgt.tokenizer, "train", 300, 1024, seed=0))
    heldout = corpus.extract_features(tgt, split(tgt.tokenizer, "eval", 40, 1024, seed=0))
    cfg = TrainConfig(
        paradigm="kv",
        regime=args.regime,
        name=args.variant,
        n_layers=2 if "L2" in opts else 1,
        kv_softmax="separate" if "separate" in opts else "shared",
        kv_recency=32 if "recency" in opts else 0,
        target_kv="zeroed" if "zero" in opts else "real",
        train_steps=args.steps,
        batch_size=2,
        max_tokens=512,
        lr=3e-3,
        branch_fraction=0.25,
        query_group=1,
        eval_every=0,
        probe_every=0,
        draft_vocab_size=4096,
        seed=args.seed,
    )
    t0 = time.perf_counter()
    out = Path(args.out) / f"{args.variant}-{args.regime}-{args.steps}-s{args.seed}"
    d = train_drafter(tgt, train, heldout, cfg, out, d2t=build_draft_vocab(train, tgt, 4096)).drafter.eval()
    seconds = time.perf_counter() - t0
    evals = EvalSet.build(heldout, d.cfg, tgt, 40, 2, 512)
    acc = {}
    for condition in ("real", "zeroed", "shuffled"):
        ev = evaluate_per_step(d, with_target_kv(evals, condition), 7, None, 0.5)
        acc[condition] = [round(ev[f"acc_{k}"], 3) for k in range(7)]
    row = dict(
        variant=args.variant,
        regime=args.regime,
        steps=args.steps,
        seed=args.seed,
        train_s=round(seconds),
        n0=ev["n_0"],
        machine=machine_name(),
        **acc,
    )
    print(json.dumps(row))
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / f"kv_design_screen_{machine_name()}.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
