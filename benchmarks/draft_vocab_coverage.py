"""How much of what the target says can a draft vocabulary hold: built from ShareGPT's original answers or from the
target's own regenerated answers, at 4,096 and 8,192 of SmolLM2's 49,152 tokens.

Coverage is the share of tokens that the vocabulary contains (a drafter can never propose the others), measured
on the target's own greedy MT-bench answers (both turns, the replay the evaluation uses) and on the held-out
regenerated ShareGPT answers. Prints and saves ``benchmarks/results/draft_vocab_coverage.json``:

    python benchmarks/draft_vocab_coverage.py [--n-conversations 3000] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvshot_lib.drafters import count_tokens, coverage, draft_vocab_from_counts
from kvshot_lib.evaluation import greedy_references
from kvshot_lib.reference import data, load_plan
from kvshot_lib.target import load_target

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = (4096, 8192)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-conversations", type=int, default=3000, help="training conversations counted")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="MT-bench greedy answers, per turn")
    args = ap.parse_args()
    plan = load_plan("onpolicy")
    target = load_target(plan.target, device="cpu", dtype="float32")
    V, stops = target.info.vocab_size, tuple(target.info.eos_token_ids)
    original, _, _ = data.data_splits(plan, target, "original")
    regenerated, held, what = data.data_splits(plan, target, "regenerated")
    n = min(args.n_conversations, len(regenerated))
    sources = {
        "original": count_tokens(original.head(min(n, len(original))), V),
        "regenerated": count_tokens(regenerated.head(n), V),
    }
    refs = greedy_references(target, None, args.max_new_tokens, batch_size=16)
    mtbench = torch.bincount(torch.tensor([t for r in refs for t in r.greedy_ids]), minlength=V)[:V]
    on = {"mtbench_greedy": mtbench, "heldout_regenerated": count_tokens(held, V)}
    table = []
    for source, counts in sources.items():
        for size in SIZES:
            d2t = draft_vocab_from_counts(counts, size, always=stops)
            row = dict(vocab_from=source, size=size)
            row.update({f"coverage_{k}": round(coverage(d2t, c), 4) for k, c in on.items()})
            table.append(row)
            print(row)
    record = dict(
        target=target.info.name,
        training_conversations=n,
        training_answer_tokens={k: int(c.sum()) for k, c in sources.items()},
        regenerated=what,
        mtbench=dict(answers=len(refs), tokens=int(mtbench.sum()), max_new_tokens=args.max_new_tokens),
        heldout_regenerated_tokens=int(on["heldout_regenerated"].sum()),
        table=table,
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "draft_vocab_coverage.json").write_text(json.dumps(record, indent=1))
    print("saved benchmarks/results/draft_vocab_coverage.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
