"""Decoding speed on the default target: plain decoding, every drafter in chain and tree mode, HF generate.

Reports, on this machine, in one run:
* a bare greedy loop (one target forward per token on a cache + argmax: the floor of Python overhead) and
  our plain decoding (``mode="ar"``) in tokens/s;
* the cost of one target forward of k new tokens on a cache, relative to k = 1, with and without the
  small-batch matmul kernel (``kvshot_lib.decoding.kernels``): what verifying a k-token block costs;
* the MT-bench speed table of ``kvshot_lib.evaluation.speedup`` (the one notebook 06 writes) for the baseline drafters
  and every trained drafter under ``--run-dir``/drafters/, with the best chain and tree speedups.

Prints and saves ``benchmarks/results/speedup_<machine>[_<dtype>][_4bit].json``. Usage:
    python benchmarks/speedup.py [--n-questions 3] [--turns 2] [--max-new-tokens 64] [--threads 1]
    python benchmarks/speedup.py --device cuda --dtype bfloat16 [--load-in-4bit]   # on a GPU
    python benchmarks/speedup.py --run-dir none --drafters ngram --tag reference \
        --checkpoints checkpoints/reference/hidden-ttt checkpoints/onpolicy/hidden31-ttt-s4   # committed drafters
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from kvshot_lib.decoding import DecodeConfig, autoregressive_generate, small_batch_linear
from kvshot_lib.drafters import drafters_for_run, resolve_drafter
from kvshot_lib.evaluation import speedup
from kvshot_lib.target import forward as seam
from kvshot_lib.target import load_target

RESULTS = Path(__file__).resolve().parent / "results"


def _clock(device: torch.device) -> float:
    """Wall time after the device's queued work is done (a GPU runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.inference_mode()
def bare_loop_tokens_per_s(model, prompt: list[int], n: int) -> float:
    cache = seam.new_cache(model)
    ids = torch.tensor([prompt], device=model.device)  # [1, T]
    tok = seam.forward(model, ids, cache).logits[:, -1:].argmax(-1)  # [1, 1]
    t0 = _clock(model.device)
    for _ in range(n):
        tok = seam.forward(model, tok, cache).logits[:, -1:].argmax(-1)
    return n / (_clock(model.device) - t0)


@torch.inference_mode()
def block_costs(model, prompt: list[int], ks=(1, 2, 3, 4, 5, 8, 16, 32), reps: int = 5) -> dict:
    """Median seconds of a k-token forward on a cache of the prompt, with and without the kernel (the
    kernel is CPU-only: on a GPU only the plain forward is timed)."""
    cache = seam.new_cache(model)
    seam.forward(model, torch.tensor([prompt], device=model.device), cache)
    out = {}
    for kernel in (False, True) if model.device.type == "cpu" else (False,):
        with small_batch_linear(model, enabled=kernel):
            for k in ks:
                x = torch.randint(100, 1000, (1, k), device=model.device)
                times = []
                for _ in range(reps):
                    t0 = _clock(model.device)
                    seam.forward(model, x, cache)
                    times.append(_clock(model.device) - t0)
                    seam.crop(cache, len(prompt))
                out[f"{'kernel' if kernel else 'blas'}_k{k}"] = sorted(times)[reps // 2]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument(
        "--run-dir", default="runs/default", help="where notebook 02 left trained drafters ('none')"
    )
    ap.add_argument("--checkpoints", nargs="*", default=[], help="more trained drafters: checkpoint folders")
    ap.add_argument("--tag", default="", help="appended to the results file's name")
    ap.add_argument("--drafters", nargs="+", default=["ngram", "self"], help="baseline drafters")
    ap.add_argument("--n-questions", type=int, default=3, help="MT-bench questions")
    ap.add_argument("--turns", type=int, default=2, choices=(1, 2))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--chain-depth", type=int, default=3)
    ap.add_argument("--tree-depth", type=int, default=5)
    ap.add_argument("--tree-top-k", type=int, default=3)
    ap.add_argument("--tree-budget", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16, float16")
    ap.add_argument("--load-in-4bit", action="store_true", help="bitsandbytes 4-bit target (CUDA only)")
    args = ap.parse_args()
    bad = [c for c in args.checkpoints if not (Path(c) / "config.json").is_file()]
    if bad:
        raise SystemExit(f"speedup.py: not a drafter checkpoint folder (no config.json): {', '.join(bad)}")
    if args.threads:
        torch.set_num_threads(args.threads)

    tgt = load_target(args.target, device=args.device, dtype=args.dtype, load_in_4bit=args.load_in_4bit)
    drafters, note = drafters_for_run(None if args.run_dir == "none" else args.run_dir, tgt, args.drafters)
    drafters.update({Path(c).name: resolve_drafter(c, tgt) for c in args.checkpoints})
    note += f" Checkpoints: {', '.join(args.checkpoints)}." if args.checkpoints else ""
    print(note)
    prompts = speedup.mtbench_first_turns(tgt.tokenizer, 1)
    machine = speedup.machine_info()
    print("machine:", machine)

    bare = bare_loop_tokens_per_s(tgt.model, prompts[0], 48)
    ar = autoregressive_generate(
        tgt, prompts[0], DecodeConfig(mode="ar", max_new_tokens=48, stop_token_ids=())
    )
    print(
        f"bare loop {bare:.1f} tokens/s; our plain decoding {ar.tokens_per_s:.1f} tokens/s end to end "
        f"({(len(ar.token_ids) - 1) / ar.verify_s:.1f} after prefill)"
    )
    costs = block_costs(tgt.model, prompts[0])
    one = costs["blas_k1"]
    print(
        "cost of a k-token forward / 1-token:",
        "  ".join(
            f"k={k.split('_k')[1]}: {v / one:.2f}" + ("*" if k.startswith("kernel") else "")
            for k, v in costs.items()
        ),
        "(* = small-batch kernel)",
    )

    base = DecodeConfig(
        max_new_tokens=args.max_new_tokens,
        chain_depth=args.chain_depth,
        tree_depth=args.tree_depth,
        tree_top_k=args.tree_top_k,
        tree_budget=args.tree_budget,
    )
    plan = speedup.run_mtbench_benchmark(tgt, drafters, args.n_questions, args.turns, base=base)
    table = speedup.speedup_table(plan, speedup.machine_name(machine))
    print(
        table[
            [
                "method",
                "drafter",
                "tokens_per_s",
                "speedup_vs_ar",
                "mat",
                "exact_match_vs_ar",
                "draft_s",
                "verify_s",
            ]
        ].to_string(index=False, float_format=lambda x: f"{x:.3f}")
    )
    best = {
        m: table[table["method"] == m].sort_values("speedup_vs_ar").tail(1).to_dict("records")
        for m in ("chain", "tree")
    }
    for m, rows in best.items():
        if rows:
            print(
                f"best {m}: {rows[0]['drafter']} at {rows[0]['speedup_vs_ar']:.2f}x (MAT {rows[0]['mat']:.2f})"
            )

    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = ("" if args.dtype == "float32" else f"_{args.dtype}") + ("_4bit" if args.load_in_4bit else "")
    suffix += f"_{args.tag}" if args.tag else ""
    path = RESULTS / f"speedup_{speedup.machine_name(machine)}{suffix}.json"
    path.write_text(
        json.dumps(
            dict(
                machine=machine,
                target=args.target,
                note=note,
                args=vars(args),
                bare_loop_tokens_per_s=bare,
                ar_tokens_per_s=ar.tokens_per_s,
                ar_decode_tokens_per_s=(len(ar.token_ids) - 1) / ar.verify_s,
                block_cost_seconds=costs,
                block_cost_relative={k: v / one for k, v in costs.items()},
                table=table.to_dict("records"),
                best=best,
                config=replace(base).__dict__,
            ),
            indent=1,
            default=str,
        )
    )
    print("wrote", path)


if __name__ == "__main__":
    main()
