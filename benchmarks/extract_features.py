"""Feature-extraction throughput on the default target, against raw prefill on the same machine.

Prints and saves ``benchmarks/results/extract_features_<machine>.json``. Usage:
    python benchmarks/extract_features.py [--target smollm2-135m] [--conversations 24] [--max-len 1024] [--threads 0]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

from kvshot_lib import corpus
from kvshot_lib.target import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    tgt = load_target(args.target, device="cpu", dtype="float32")
    split = corpus.tokenize_sharegpt(tgt.tokenizer, "train", args.conversations, args.max_len, seed=0)
    with torch.inference_mode():  # raw prefill: the same sequences, no capture, no writes
        tgt.model.model(split.ids[0][None])  # warm-up
        t0 = time.perf_counter()
        for ids in split.ids:
            tgt.model.model(ids[None])
        prefill_s = time.perf_counter() - t0
    out = Path(tempfile.mkdtemp(prefix="kvshot-bench-"))
    try:
        t0 = time.perf_counter()
        store = corpus.extract_features(tgt, split, out_dir=out)
        extract_s = time.perf_counter() - t0
        summary = store.summary()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    result = {
        "machine": f"{platform.node()} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "target": args.target,
        "tokens": split.n_tokens,
        "conversations": len(split),
        "max_len": args.max_len,
        "prefill_tokens_per_s": round(split.n_tokens / prefill_s, 1),
        "extraction_tokens_per_s": round(split.n_tokens / extract_s, 1),
        "extraction_vs_prefill": round(prefill_s / extract_s, 3),
        "bytes_per_token": summary["bytes_per_token"],
        "layers": {"hidden": summary["hidden_layers"], "kv": summary["kv_layers"]},
    }
    print(json.dumps(result, indent=1))
    dest = Path(__file__).parent / "results" / f"extract_features_{platform.node()}.json"
    dest.parent.mkdir(exist_ok=True)
    dest.write_text(json.dumps(result, indent=1))
    print(f"saved {dest}")


if __name__ == "__main__":
    main()
