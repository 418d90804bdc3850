"""vLLM CPU beside the suite's engine, in one interleaved run: plain decoding and EAGLE-3 speculative decoding
with the same drafter (the suite's hidden drafter, exported with ``kvshot export --format eagle3``).

For each MT-bench first turn, in turn: the suite's plain decoding, the suite's chain (k drafts), vLLM plain, vLLM
with the exported drafter (``num_speculative_tokens`` = k), all greedy, batch 1, one thread pool each. It reports

* tokens/s of each (median over prompts and repeats) and each one's ratio to the suite's plain decoding;
* greedy equality: vLLM speculative vs vLLM plain, vLLM plain vs the suite's plain, the suite's chain vs its plain;
  at each divergence from the suite's plain output, the suite's fp32 top-2 logit margin there (two engines' fp32
  kernels round differently, so a near-tie may flip);
* acceptance per draft position, P(the first j+1 drafts all accepted), from the suite's cycles and from vLLM's own
  counters, for the same drafter and prompts.

Needs ``make interop-env`` (``.venv-serve``). Prints and saves ``benchmarks/results/vllm_cpu_<machine>.json``:
    python benchmarks/vllm_cpu.py --drafter checkpoints/reference/hidden-ttt [--n-questions 6] [--k 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvshot_lib.corpus import VllmGreedy, chat_prompt_ids, load_mtbench
from kvshot_lib.decoding import DecodeConfig, generate
from kvshot_lib.drafters import export_eagle3, load_drafter
from kvshot_lib.evaluation import machine_info, machine_name, specpv_fidelity, speed_table
from kvshot_lib.target import REPO_ROOT, load_target

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("suite_plain", "suite_chain", "vllm_plain", "vllm_eagle3")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="checkpoints/reference/hidden-ttt", help="a suite hidden drafter")
    ap.add_argument("--n-questions", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3, help="drafts per cycle: the suite's chain depth and vLLM's k")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target("smollm2-135m", device="cpu", dtype="float32")
    drafter = load_drafter(args.drafter, target)
    export = export_eagle3(drafter, target, REPO_ROOT / "runs" / "vllm_cpu" / f"{drafter.name}-eagle3")
    prompts = [
        chat_prompt_ids(target.tokenizer, [{"role": "user", "content": q.turns[0]}])
        for q in load_mtbench()[: args.n_questions]
    ]
    n = args.max_new_tokens
    plain_cfg = DecodeConfig(mode="ar", max_new_tokens=n)
    chain_cfg = DecodeConfig(mode="chain", max_new_tokens=n, chain_depth=args.k)
    rows, outputs = [], {m: [None] * len(prompts) for m in METHODS}
    accept = {"suite": [0] * args.k, "vllm": [0] * args.k, "suite_cycles": 0, "vllm_drafts": 0}
    with (
        VllmGreedy(target, dtype="float32", max_model_len=4096) as vplain,
        VllmGreedy(target, dtype="float32", max_model_len=4096, spec_model=export, spec_k=args.k) as vspec,
    ):
        for engine in (vplain, vspec):  # warm-up, untimed: first calls pay for allocation and lazy setup
            engine([prompts[0]], 8, one_at_a_time=True)
        generate(target, prompts[0], DecodeConfig(mode="ar", max_new_tokens=8))
        generate(
            target, prompts[0], DecodeConfig(mode="chain", max_new_tokens=8, chain_depth=args.k), drafter
        )
        for rep in range(args.repeats):
            for i, p in enumerate(prompts):
                for method in METHODS:
                    if method.startswith("suite"):
                        out = generate(
                            target, p, plain_cfg if method == "suite_plain" else chain_cfg, drafter
                        )
                        ids, secs = out.token_ids, out.total_s
                        if method == "suite_chain" and rep == 0:
                            accept["suite_cycles"] += out.step_attempts[0] if out.step_attempts else 0
                            for j, a in enumerate(out.step_accepts[: args.k]):
                                accept["suite"][j] += a
                    else:
                        engine = vplain if method == "vllm_plain" else vspec
                        t0 = time.perf_counter()
                        (ids,) = engine([p], n, one_at_a_time=True)
                        secs = (
                            engine.last["per_prompt_seconds"][0] if engine.last else time.perf_counter() - t0
                        )
                        if method == "vllm_eagle3" and rep == 0:
                            spec = engine.last["spec"]
                            accept["vllm_drafts"] += spec["num_drafts"]
                            for j, a in enumerate(spec["num_accepted_tokens_per_pos"][: args.k]):
                                accept["vllm"][j] += a
                    outputs[method][i] = ids
                    rows.append(dict(method=method, prompt=i, repeat=rep, tokens=len(ids), seconds=secs))
                    print(f"rep {rep} prompt {i} {method:12s} {len(ids) / secs:6.1f} tok/s", flush=True)
    speed = {
        m: statistics.median(r["tokens"] / r["seconds"] for r in rows if r["method"] == m) for m in METHODS
    }
    ref = outputs["suite_plain"]
    equality = {}
    for method, against in (
        ("vllm_eagle3", "vllm_plain"),
        ("vllm_plain", "suite_plain"),
        ("suite_chain", "suite_plain"),
    ):
        div = [
            None if a == b else specpv_fidelity.first_divergence(a, b)
            for a, b in zip(outputs[method], outputs[against])
        ]
        equality[f"{method}=={against}"] = dict(
            equal=sum(d is None for d in div),
            of=len(div),
            divergences=[
                dict(
                    prompt=i,
                    at=d,
                    suite_top2_margin=round(speed_table.top2_logits(target, prompts[i] + ref[i][:d])[1], 4),
                )
                for i, d in enumerate(div)
                if d is not None and d < len(ref[i])
            ],
        )
    record = dict(
        machine=machine_info(),
        precision="float32 (suite and vLLM)",
        drafter=str(args.drafter),
        exported_to=str(export.relative_to(REPO_ROOT)),
        settings=dict(vars(args)),
        vllm=vplain.version,
        tokens_per_s=speed,
        ratio_to_suite_plain={m: speed[m] / speed["suite_plain"] for m in METHODS},
        greedy_equality=equality,
        acceptance_by_position=dict(
            suite=[a / max(1, accept["suite_cycles"]) for a in accept["suite"]],
            vllm=[a / max(1, accept["vllm_drafts"]) for a in accept["vllm"]],
            suite_cycles=accept["suite_cycles"],
            vllm_drafts=accept["vllm_drafts"],
        ),
        rows=rows,
    )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"vllm_cpu_{machine_name(record['machine'])}.json"
    out.write_text(json.dumps(record, indent=1))
    print(
        json.dumps(
            {k: record[k] for k in ("tokens_per_s", "ratio_to_suite_plain", "acceptance_by_position")},
            indent=1,
        )
    )
    print(json.dumps(equality, indent=1))
    print(f"saved {out.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
