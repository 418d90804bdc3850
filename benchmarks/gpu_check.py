"""The paper-scale GPU path in one short command: a target with Qwen3-8B's architecture and random weights.

    make gpu-bundle    here, with the suite installed: writes gpu_bundle/ (git-ignored, a few MB): SmolLM2's tokenizer
                       files, a slice of ShareGPT and the MT-bench questions, laid out as in their packages
    make gpu-check     on the GPU machine, with its own torch and transformers and PYTHONPATH=. (no install, no
                       registry, no hub): reads the bundle through KVSHOT_ASSETS_DIR and runs this script

The target is built in bf16 on the GPU from a transformers ``Qwen3Config`` at Qwen3-8B's shape (36 layers, hidden
4096, 32 query / 8 KV heads, head_dim 128, intermediate 12288), with SmolLM2's tokenizer and 49,152-token vocabulary
instead of Qwen3's 151,936, so that the suite's real ShareGPT and MT-bench pipeline runs unchanged. Each stage
records its seconds and peak memory (GPU: ``max_memory_allocated``, reset per stage; CPU: the process's peak RSS).
The stages run most important first, and the JSON and table are written after every one, so a lease that ends
mid-run leaves what was measured; a stage that would not finish within ``budget_s`` is skipped and says so:

1. ``plain_decoding``: plain decoding tokens/s on MT-bench prompts, eagerly on a ``DynamicCache`` and on the fast
   path (the static cache; on a GPU every step a CUDA graph replay, ``kvshot_lib/target/graphs.py``), with the
   graphs' capture seconds apart;
2. ``verification_cost``: c_v(k), one forward of k new tokens on a cache relative to k=1, k up to 64, on the fast
   path (causal and tree-masked; ``decoding.measure_verification``), and the eager c_v(1) beside it;
3. ``cycle_overhead``: one speculative cycle's work outside the target's verify forward (drafter steps, tree
   building, acceptance, commit), per cycle, against c_v(1), for a chain and a tree, drafted on the device (a CUDA
   graph of the whole draft loop, ``decoding/device_draft.py``) and on the host, with the draft graphs' capture
   seconds apart;
3b. ``replayed_acceptance``: speculative decoding at the paper's acceptance (``decoding/replay.py``): the hidden, KV
   (1, 2, 4 layers) and hybrid drafters at the target's shape draft for real, the target verifies for real, each
   cycle's accepted length is drawn from the drafter's Table 5 row (trees: stretched to Table 4's MAT) and plain
   decoding's tokens are committed: tokens/s, speedup over plain decoding, drafting ms per cycle, and each drafter's
   drafting time against the hidden one's;
4. ``greedy_equality``: chain and tree speculative decoding on the fast path against plain decoding, with fresh
   hidden, KV and hybrid drafters (random in effect: acceptance means nothing here, exactness and cost do) and the
   target drafting for itself (every draft accepted: multi-token commits), in the target's dtype; and
   ``greedy_equality_fp32``, the same with the target cast to float32 in place (bf16 may part at near-ties;
   float32 must not). Each row also says whether the outputs agree up to the first near-tie of plain decoding's
   logits (a top-2 gap under ``tie_fraction`` of the logits' spread), so that a bf16 difference at a tie is told
   apart from a wrong mask or slot;
5. ``train_<drafter>``: online training tokens/s of hidden-ttt, kv-ttt and hybrid-ttt (``train_drafter`` with
   ``data_source="online"``, the target in the loop) at the qwen3-8b profile's batch, length and draft vocabulary;
6. ``extraction``: feature extraction tokens/s (``corpus.extract_features``, bytes per token of the store);
7. ``compiled_forward`` (a GPU only): plain decoding with the target's norms and MLPs compiled by ``torch.compile``
   inside its captured graphs (``DecodeConfig.compile_target``), with the compile and capture seconds.

A failing stage is recorded and the others still run (the exit status is 1). Writes
``benchmarks/results/gpu_check_<gpu>.json`` and ``.md``; ``--scale tiny`` runs the same code at toy shapes on a CPU
in seconds (``tests/test_gpu_check.py``). The dry run of ``kvshot run --profile qwen3-8b`` reads its rates.

This file runs the stages; what each one measures, the bundle, the scales and the report are in
``benchmarks/gpu_stages/`` (its ``__init__`` names the module of each).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
from gpu_stages import (
    QWEN3_VOCAB,
    SCALES,
    TRAINING_ROWS,
    bound,
    bundle_assets,
    compiled_forward,
    cycle_overhead,
    float32_in_place,
    fresh_drafters,
    greedy_equality,
    load_tokenizer,
    machine,
    markdown,
    measure_extraction,
    measure_training,
    plain_decoding,
    preflight,
    replay_drafters,
    replayed_acceptance,
    stage,
    sync,
    verification_cost,
    write_bundle,
    write_results,
)

from kvshot_lib import corpus
from kvshot_lib.drafters import drafter_for_target
from kvshot_lib.target import REPO_ROOT, random_target
from kvshot_lib.training import build_draft_vocab

RESULTS = REPO_ROOT / "benchmarks" / "results"


def run_check(bundle: Path | None, scale_name: str, device: str, out_dir: Path, seed: int = 0) -> dict:
    """Every stage, most important first; the result is written after each (:func:`write_results`)."""
    scale = SCALES[scale_name]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if scale_name == "qwen3-8b" and not device.startswith("cuda"):
        raise SystemExit("gpu_check: the qwen3-8b scale needs a CUDA GPU (about 16 GiB of bf16 weights and more); "
                         "on a CPU run --scale tiny.")  # fmt: skip
    t_start = time.perf_counter()
    stages: dict = {}
    result = dict(
        check="gpu_check",
        scale=scale_name,
        device=device,
        machine=machine(),
        versions=preflight(),
        complete=False,
        settings={k: v for k, v in asdict(scale).items() if k != "config"},
        stages=stages,
        errors={},
    )

    def save() -> None:
        result["errors"] = {k: v["error"] for k, v in stages.items() if "error" in v}
        result["total_seconds"] = round(time.perf_counter() - t_start, 1)
        write_results(result, out_dir)

    def due(name: str, key: str | None = None) -> bool:
        """Whether stage ``name`` can end within the budget; if not it is recorded as skipped."""
        need = scale.needs.get(key or name, 0)
        if time.perf_counter() - t_start + need <= scale.budget_s:
            return True
        stages[name] = dict(
            skipped=f"would end past the check's budget of {scale.budget_s:.0f} s (needs ~{need} s)"
        )
        save()
        return False

    with bundle_assets(bundle), tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        tokenizer = load_tokenizer(bundle)
        note = (
            f"vocabulary: SmolLM2's tokenizer, {len(tokenizer):,} tokens, not Qwen3's {QWEN3_VOCAB:,}: the embedding "
            "and LM head are smaller than Qwen3-8B's; every other shape is Qwen3-8B's"
        )
        print(f"[gpu-check] {note}", flush=True)
        result["target"] = dict(
            architecture={k: v for k, v in scale.config.items() if k != "vocab_size"},
            family="qwen3",
            weights=f"random, seed {seed}",
            dtype=scale.dtype,
            vocab_size=len(tokenizer),
            vocabulary_note=note,
        )
        with stage(stages, "build", device, save) as row:
            target = random_target(
                scale.config, "qwen3", tokenizer, device, scale.dtype, seed, name=f"random-{scale_name}"
            )
            sync(device)
            row.update(n_params=target.info.n_params, dtype=target.info.dtype)
        if "error" in stages["build"]:
            raise SystemExit(f"gpu_check: the target could not be built: {stages['build']['error']}")
        split = dict(
            max_len=scale.max_len, seed=seed, eval_size=4 * scale.batch_size, use_cache=False
        )  # slack
        train = corpus.tokenize_sharegpt(tokenizer, "train", scale.train_steps * scale.batch_size, **split)
        heldout = corpus.tokenize_sharegpt(tokenizer, "eval", scale.batch_size, **split)
        questions = corpus.load_mtbench(scale.prompts)
        prompts = [corpus.chat_prompt_ids(tokenizer, corpus.mtbench_messages(q)) for q in questions]
        result["data"] = dict(
            bundle=str(bundle) if bundle else "installed assets",
            train_conversations=len(train),
            mean_tokens_per_conversation=round(train.n_tokens / max(1, len(train)), 1),
            max_len=scale.max_len,
        )
        d2t = build_draft_vocab(train, target, scale.draft_vocab_size)
        dtype = next(target.model.parameters()).dtype
        drafters = fresh_drafters(target, d2t, seed)
        if due("plain_decoding"):
            with stage(stages, "plain_decoding", device, save) as row:
                row.update(plain_decoding(target, prompts, scale))
        if due("verification_cost"):
            with stage(stages, "verification_cost", device, save) as row:
                row.update(verification_cost(target, scale))
        cv = stages.get("verification_cost", {})
        if "rows" in cv and due("cycle_overhead"):
            with stage(stages, "cycle_overhead", device, save) as row:
                hidden = drafter_for_target(drafters["hidden-ttt"], target, dtype)
                row.update(cycle_overhead(target, hidden, prompts[:2], scale, cv))
        if due("replayed_acceptance"):
            with stage(stages, "replayed_acceptance", device, save) as row:
                replayed = replay_drafters(target, d2t, scale, dtype, seed)
                row.update(replayed_acceptance(target, replayed, prompts[: scale.replay_prompts], scale))
                del replayed
        if due("greedy_equality"):
            with stage(stages, "greedy_equality", device, save) as row:
                equality_prompts = prompts[: scale.equality_prompts]
                row.update(greedy_equality(target, bound(drafters, target, dtype), equality_prompts, scale))
        if device.startswith("cuda") and due(
            "compiled_forward"
        ):  # a CPU does not compile (no GPU graph to fuse)
            with stage(stages, "compiled_forward", device, save) as row:
                uncompiled = stages.get("plain_decoding", {}).get("graphs_tokens_per_s")
                row.update(compiled_forward(target, prompts[:1], scale, uncompiled))
        # kv-ttt trained 3.5x slower than hidden-ttt on an H100. The suspect: its learned recency bias
        # (TrainConfig.kv_recency, on for kv only) gathers a [heads, T, T] table whose backward scatters ~10^8
        # elements into [heads, W + 1] per layer and TTT step; the last row times kv-ttt without it.
        for name, paradigm, over in TRAINING_ROWS:
            if due(name, "train"):
                with stage(stages, name, device, save) as row:
                    row.update(measure_training(target, train, heldout, d2t, scale, paradigm, work, **over))
        if due("extraction"):
            with stage(stages, "extraction", device, save) as row:
                extract = corpus.tokenize_sharegpt(tokenizer, "train", scale.extract_conversations, **split)
                row.update(measure_extraction(target, extract, work, scale.precision))
        if dtype != torch.float32 and due("greedy_equality_fp32"):  # last: it casts the target in place
            with stage(stages, "greedy_equality_fp32", device, save) as row:
                fp32 = float32_in_place(target, device)
                if fp32 is None:
                    row["skipped"] = "the GPU's free memory cannot hold a float32 copy of the target"
                else:
                    equality_prompts = prompts[: scale.equality_prompts]
                    row.update(
                        greedy_equality(fp32, bound(drafters, fp32, torch.float32), equality_prompts, scale)
                    )
    result["complete"] = True
    save()
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--bundle",
        type=Path,
        default=None,
        help="the folder make gpu-bundle wrote (default: installed assets)",
    )
    ap.add_argument("--scale", choices=sorted(SCALES), default="qwen3-8b")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads (0: torch's default; 1 on a busy CPU)"
    )
    ap.add_argument(
        "--write-bundle", type=Path, default=None, metavar="DIR", help="write the bundle and stop"
    )
    ap.add_argument("--conversations", type=int, default=400, help="ShareGPT records in the bundle")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.write_bundle:
        manifest = write_bundle(args.write_bundle, args.conversations)
        print(
            f"wrote {args.write_bundle}: {manifest['bytes'] / 1e6:.1f} MB, {manifest['sharegpt_records']} ShareGPT records"
        )
        return manifest
    result = run_check(args.bundle, args.scale, args.device, args.out_dir)
    dest = write_results(result, args.out_dir)  # run_check wrote it after every stage; this names it
    print(markdown(result))
    print(f"wrote {dest} and {dest.with_suffix('.md').name}")
    return result


if __name__ == "__main__":
    sys.exit(1 if main().get("errors") else 0)
