"""Where a cycle's verification time goes, against the cost model the shape chooser reads.

The cost model (``kvshot_lib.decoding.cost_model``) prices a ``k``-token block as the fastest of 12 forwards on a
cache of 256 random tokens. A bf16 run found real tree cycles 25 ms dearer than it said
(``docs/onpolicy-results.md``, the sixth speed run), so the chooser drafted trees that did not pay. This splits the
engine's verify phase on real MT-bench prompts, per precision and draft shape, into the target forward as the
engine calls it (hidden states, mask, growing cache), the tree walk (``verify_tree``) and the rest, beside what the
cost model prices each cycle's block at and the same forward re-timed alone at each cycle's own width and context.

Prints and saves ``benchmarks/results/verify_cost_gap_<machine>.json``. Usage:
    python benchmarks/verify_cost_gap.py --drafter checkpoints/onpolicy/hidden31-ttt-s4 [--n-questions 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvshot_lib.decoding import DecodeConfig, cost_model, engine, generate, small_batch_linear
from kvshot_lib.drafters import resolve_drafter
from kvshot_lib.evaluation import speedup
from kvshot_lib.target import forward as seam
from kvshot_lib.target import load_target

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {
    "chain 4": dict(mode="chain", chain_depth=4),
    "tree 6/4/24": dict(mode="tree", tree_depth=6, tree_top_k=4, tree_budget=24),
    "tree 8/4/48": dict(mode="tree", tree_depth=8, tree_top_k=4, tree_budget=48),
}


class Recorder:
    """Wraps the engine's ``forward`` and ``verify_tree`` to time each call of a cycle's verify phase."""

    def __init__(self):
        self.forwards: list[dict] = []
        self.walk_s = 0.0
        self._forward, self._walk = engine.forward, engine.verify_tree

    def __enter__(self):
        def forward(model, ids, cache, positions=None, mask=None, hidden_states=False):
            past = cache.get_seq_length()
            t0 = time.perf_counter()
            out = self._forward(
                model, ids, cache, positions=positions, mask=mask, hidden_states=hidden_states
            )
            self.forwards.append(
                dict(
                    n=ids.shape[1],
                    past=past,
                    masked=mask is not None,
                    s=time.perf_counter() - t0,
                    args=(ids, positions, mask, hidden_states),
                )
            )
            return out

        def walk(*a, **k):
            t0 = time.perf_counter()
            out = self._walk(*a, **k)
            self.walk_s += time.perf_counter() - t0
            return out

        engine.forward, engine.verify_tree = forward, walk
        return self

    def __exit__(self, *exc):
        engine.forward, engine.verify_tree = self._forward, self._walk


@torch.inference_mode()
def alone(model, prompt, calls, reps: int = 5) -> list[float]:
    """Each recorded forward re-run alone at its own width and context (the prompt's cache cropped to it): the
    median of ``reps``. The cache beyond the prompt holds the prompt's tokens again, not the answer's: K/V values do
    not change a forward's cost."""
    cache = seam.new_cache(model)
    longest = max(c["past"] for c in calls)
    ids = (prompt * (longest // len(prompt) + 1))[:longest]
    seam.forward(model, torch.tensor([ids]), cache, logits_to_keep=1)
    out = []
    with small_batch_linear(model):  # as the engine runs its forwards
        for c in calls:
            tok, pos, mask, hid = c["args"]
            times = []
            for _ in range(reps):
                seam.crop(cache, c["past"])
                t0 = time.perf_counter()
                seam.forward(model, tok, cache, positions=pos, mask=mask, hidden_states=hid)
                times.append(time.perf_counter() - t0)
            out.append(statistics.median(times))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", required=True, help="a trained drafter's checkpoint folder")
    ap.add_argument("--n-questions", type=int, default=3, help="MT-bench questions (first turns)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not (Path(args.drafter) / "config.json").is_file():
        raise SystemExit(
            f"verify_cost_gap.py: not a drafter checkpoint folder (no config.json): {args.drafter}"
        )
    torch.set_num_threads(args.threads)
    base = load_target("smollm2-135m")
    drafter = resolve_drafter(args.drafter, base)
    prompts = speedup.mtbench_first_turns(base.tokenizer, args.n_questions)
    machine = speedup.machine_info()
    rows = []
    for setup in speedup.precision_setups(base, {"d": drafter}, args.precisions):
        tgt, d = setup.target, setup.drafters["d"]
        costs = cost_model.cost_model_for(tgt, {"d": d})
        generate(tgt, prompts[0], DecodeConfig(mode="chain", max_new_tokens=16), d)  # warm-up
        for shape, kw in SHAPES.items():
            cfg = DecodeConfig(max_new_tokens=args.max_new_tokens, **kw)
            for prompt in prompts:
                with Recorder() as rec:
                    res = generate(tgt, prompt, cfg, d)
                calls = rec.forwards[1:]  # [0] is the prefill
                re_alone = alone(tgt.model, prompt, calls)
                cycles = len(calls)
                rows.append(
                    dict(
                        precision=setup.precision,
                        shape=shape,
                        prompt_tokens=len(prompt),
                        cycles=cycles,
                        block_tokens=sum(c["n"] for c in calls) / cycles,
                        mat=(len(res.token_ids)) / cycles,
                        verify_ms=1e3 * res.verify_s / cycles,
                        forward_ms=1e3 * sum(c["s"] for c in calls) / cycles,
                        walk_ms=1e3 * rec.walk_s / cycles,
                        alone_ms=1e3 * sum(re_alone) / cycles,
                        cost_model_ms=1e3 * sum(costs.verify(c["n"], c["masked"]) for c in calls) / cycles,
                        draft_ms=1e3 * res.draft_s / cycles,
                    )
                )
                r = rows[-1]
                print(
                    f"{r['precision']} {shape:12s} prompt {r['prompt_tokens']:4d}: {cycles} cycles, "
                    f"{r['block_tokens']:.1f} block tokens; verify {r['verify_ms']:.1f} ms = forward "
                    f"{r['forward_ms']:.1f} + walk {r['walk_ms']:.1f} + rest; the forward alone "
                    f"{r['alone_ms']:.1f}; cost model {r['cost_model_ms']:.1f}"
                )
    name = speedup.machine_name(machine)
    out = RESULTS / f"verify_cost_gap_{name}.json"
    out.write_text(json.dumps(dict(machine=machine, settings=vars(args), rows=rows), indent=1) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
