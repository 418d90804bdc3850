"""Feature-extraction throughput on the default target: float32 beside the default precision (bf16 where the
CPU has it), alternated in one run, and raw float32 prefill on the same machine.

Prints and saves ``benchmarks/results/extract_features_<machine>.json``. Usage:
    python benchmarks/extract_features.py [--target smollm2-135m] [--conversations 24] [--max-len 1024] [--threads 0] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from kvshot_lib import corpus
from kvshot_lib.evaluation import machine_name
from kvshot_lib.target import load_target, machine_record, resolve_precision


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--repeats", type=int, default=2, help="extractions per precision, alternated")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    tgt = load_target(args.target, device="cpu", dtype="float32")
    split = corpus.tokenize_sharegpt(tgt.tokenizer, "train", args.conversations, args.max_len, seed=0)
    default = resolve_precision("auto", "cpu")
    precisions = ["no", default] if default != "no" else ["no"]
    with torch.inference_mode():  # raw prefill: the same sequences, no capture, no writes
        tgt.model.model(split.ids[0][None])  # warm-up
        t0 = time.perf_counter()
        for ids in split.ids:
            tgt.model.model(ids[None])
        prefill_s = time.perf_counter() - t0
    seconds, summary = dict.fromkeys(precisions, 0.0), {}
    for _ in range(args.repeats):  # alternated, so that other load falls on both precisions alike
        for p in precisions:
            out = Path(tempfile.mkdtemp(prefix="kvshot-bench-"))
            try:
                t0 = time.perf_counter()
                store = corpus.extract_features(tgt, split, out_dir=out, precision=p)
                seconds[p] += time.perf_counter() - t0
                summary[p] = store.summary()
            finally:
                shutil.rmtree(out, ignore_errors=True)
    rate = {p: args.repeats * split.n_tokens / s for p, s in seconds.items()}
    result = {
        "machine": machine_name(),
        **machine_record(default, "cpu"),
        "target": args.target,
        "tokens": split.n_tokens,
        "conversations": len(split),
        "max_len": args.max_len,
        "repeats": args.repeats,
        "prefill_fp32_tokens_per_s": round(split.n_tokens / prefill_s, 1),
        **{f"extraction_{'fp32' if p == 'no' else p}_tokens_per_s": round(r, 1) for p, r in rate.items()},
        "gain": round(rate[precisions[-1]] / rate["no"], 2),
        "bytes_per_token": {("fp32" if p == "no" else p): s["bytes_per_token"] for p, s in summary.items()},
        "store_dtype": {("fp32" if p == "no" else p): s["dtype"] for p, s in summary.items()},
        "layers": {"hidden": summary["no"]["hidden_layers"], "kv": summary["no"]["kv_layers"]},
    }
    print(json.dumps(result, indent=1))
    dest = Path(__file__).parent / "results" / f"extract_features_{machine_name()}.json"
    dest.parent.mkdir(exist_ok=True)
    dest.write_text(json.dumps(result, indent=1))
    print(f"saved {dest}")


if __name__ == "__main__":
    main()
