"""A greedy-generation worker on vLLM CPU, run *by path* inside ``.venv-serve`` (``make interop-env``).

It imports only the standard library and vLLM (the suite's own environment has no vLLM, and vLLM's pins a
transformers of its own), so it is a script, not a module of the suite: :class:`~kvshot_lib.corpus.vllm_engine.
VllmGreedy` starts it as ``.venv-serve/bin/python kvshot_lib/corpus/vllm_worker.py MODEL_DIR --dtype D`` and
speaks one JSON object per line:

* in:  ``{"prompts": [[token ids], ...], "max_new_tokens": n, "stop_ids": [ids]}``
* out: ``{"outputs": [[token ids], ...], "seconds": s}``: greedy continuations, each cut after its first stop
  token (included, as :func:`~kvshot_lib.corpus.regenerate.batched_greedy` returns them).

vLLM's own log lines go to stderr; the protocol has stdout to itself. What vLLM CPU needs on this machine (the
brief's notes): no engine subprocess (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), eager mode, a KV-cache space.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", help="a Hugging Face model folder (the suite's converted safetensors target)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-gib", default="4")
    ap.add_argument("--threads", default=str(os.cpu_count() or 1))
    a = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", a.kv_cache_gib)
    os.environ.setdefault("OMP_NUM_THREADS", a.threads)  # else vLLM serves on one thread
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything printed by vLLM goes to stderr
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=a.model, dtype=a.dtype, enforce_eager=True, max_model_len=a.max_model_len, seed=0)
    protocol.write(json.dumps({"ready": True, "vllm": __import__("vllm").__version__}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        stops = list(req["stop_ids"])
        params = SamplingParams(
            temperature=0.0, max_tokens=int(req["max_new_tokens"]), stop_token_ids=stops, detokenize=False
        )
        t0 = time.perf_counter()
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]], params, use_tqdm=False
        )
        rows = []
        for o in outs:  # vLLM returns them in the order asked
            ids = list(o.outputs[0].token_ids)
            if o.outputs[0].finish_reason == "stop" and (not ids or ids[-1] not in stops):
                ids.append(stops[0])  # a stop that vLLM left out of the ids: keep the suite's convention
            rows.append(ids)
        protocol.write(json.dumps({"outputs": rows, "seconds": time.perf_counter() - t0}) + "\n")


if __name__ == "__main__":
    main()
