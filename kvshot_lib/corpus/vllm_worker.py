"""A greedy-generation worker on vLLM CPU, run *by path* inside ``.venv-serve`` (``make interop-env``).

It imports only the standard library and vLLM (the suite's own environment has no vLLM, and vLLM's pins a
transformers of its own), so it is a script, not a module of the suite: :class:`~kvshot_lib.corpus.vllm_engine.
VllmGreedy` starts it as ``.venv-serve/bin/python kvshot_lib/corpus/vllm_worker.py MODEL_DIR --dtype D`` and
speaks one JSON object per line:

* in:  ``{"prompts": [[token ids], ...], "max_new_tokens": n, "stop_ids": [ids], "one_at_a_time": false,
  "stop_at_loop": false}``
* out: ``{"outputs": [[token ids], ...], "seconds": s, "per_prompt_seconds": [...], "spec": {...}}``: greedy
  continuations, each cut after its first stop token (included, as
  :func:`~kvshot_lib.corpus.regenerate.batched_greedy` returns them). ``one_at_a_time`` decodes the prompts one
  after the other (batch 1, timed each: what a single-user speed comparison needs) instead of as one batch.
  ``stop_at_loop`` ends an answer once it loops (``looping.py`` beside this file, loaded by path: the suite's own
  rule), checked every 16 tokens by a vLLM logits processor that forces the first stop token; such an answer
  comes back without that token, as if cut by the limit, and ``loop_stopped`` counts them.

``--spec-model DIR --spec-k K`` serves with an EAGLE-3 drafter (``speculative_config={"method": "eagle3", ...}``);
``spec`` then holds vLLM's own counters over the request: drafts, draft tokens and accepted tokens per position.

vLLM's own log lines go to stderr; the protocol has stdout to itself. What vLLM CPU needs on this machine (the
brief's notes): no engine subprocess (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), eager mode, a KV-cache space.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

_spec = importlib.util.spec_from_file_location("kvshot_loops", Path(__file__).with_name("looping.py"))
LOOPS = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(LOOPS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", help="a Hugging Face model folder (the suite's converted safetensors target)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-gib", default="4")
    ap.add_argument("--threads", default=str(os.cpu_count() or 1))
    ap.add_argument("--spec-model", default=None, help="an EAGLE-3 drafter folder: speculative decoding")
    ap.add_argument("--spec-k", type=int, default=3, help="draft tokens per step (num_speculative_tokens)")
    a = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", a.kv_cache_gib)
    os.environ.setdefault("OMP_NUM_THREADS", a.threads)  # else vLLM serves on one thread
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything printed by vLLM goes to stderr
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=a.model, dtype=a.dtype, enforce_eager=True, max_model_len=a.max_model_len, seed=0)
    if not a.spec_model:  # the loop stop is for regeneration; speculative serving keeps vLLM's own path
        kw["logits_processors"] = [loop_stop_class()]
    if a.spec_model:
        kw["speculative_config"] = {
            "method": "eagle3",
            "model": a.spec_model,
            "num_speculative_tokens": a.spec_k,
        }
        kw["disable_log_stats"] = False  # the acceptance counters
    llm = LLM(**kw)
    protocol.write(json.dumps({"ready": True, "vllm": __import__("vllm").__version__}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        stops = list(req["stop_ids"])
        stop_at_loop = bool(req.get("stop_at_loop"))
        params = SamplingParams(
            temperature=0.0,
            max_tokens=int(req["max_new_tokens"]),
            stop_token_ids=stops,
            detokenize=False,
            extra_args={"stop_at_loop": stops[0]} if stop_at_loop else None,
        )
        t0, before = time.perf_counter(), spec_counters(llm) if a.spec_model else {}
        prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
        if req.get("one_at_a_time"):
            outs, per_prompt = [], []
            for p in prompts:
                t1 = time.perf_counter()
                outs += llm.generate([p], params, use_tqdm=False)
                per_prompt.append(time.perf_counter() - t1)
        else:
            outs, per_prompt = llm.generate(prompts, params, use_tqdm=False), []
        rows, loop_stopped = [], 0
        for o in outs:  # vLLM returns them in the order asked
            ids = list(o.outputs[0].token_ids)
            if o.outputs[0].finish_reason == "stop" and (not ids or ids[-1] not in stops):
                ids.append(stops[0])  # a stop that vLLM left out of the ids: keep the suite's convention
            if stop_at_loop and ids and ids[-1] == stops[0] and LOOPS.loops(ids[:-1]):
                ids, loop_stopped = ids[:-1], loop_stopped + 1  # the forced stop: cut, not ended
            rows.append(ids)
        reply = {"outputs": rows, "seconds": time.perf_counter() - t0, "per_prompt_seconds": per_prompt}
        reply["loop_stopped"] = loop_stopped
        if a.spec_model:
            after = spec_counters(llm)
            reply["spec"] = {k: _minus(after[k], before.get(k)) for k in after}
        protocol.write(json.dumps(reply) + "\n")


def loop_stop_class():
    """A vLLM logits processor that ends a request once its output loops: for requests whose
    ``extra_args["stop_at_loop"]`` names a stop token, every LOOPS.CHECK_EVERY tokens it asks LOOPS.loops, and where it
    answers yes leaves that token the only choice."""
    from vllm.v1.sample.logits_processor import LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

    class LoopStop(LogitsProcessor):
        def __init__(self, vllm_config, device, is_pin_memory):
            self.reqs: dict = {}  # batch index -> (its running output ids, the stop token)

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update) -> None:
            def new(params, _prompt, output):
                stop = (params.extra_args or {}).get("stop_at_loop")
                return None if stop is None else (output, int(stop))

            process_dict_updates(self.reqs, batch_update, new)

        def apply(self, logits):
            for index, (output, stop) in self.reqs.items():
                n = len(output)
                if n >= LOOPS.TAIL and n % LOOPS.CHECK_EVERY == 0 and LOOPS.loops(list(output)):
                    logits[index] = float("-inf")
                    logits[index, stop] = 0.0
            return logits

    return LoopStop


def spec_counters(llm) -> dict:
    """vLLM's speculative-decoding counters so far: drafts, draft tokens, accepted tokens (total, per position)."""
    out = {}
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:spec_decode_")
        if name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            out[name] = m.value
        elif name == "num_accepted_tokens_per_pos":
            out[name] = list(m.values)
    return out


def _minus(a, b):
    if b is None:
        return a
    return [x - y for x, y in zip(a, b)] if isinstance(a, list) else a - b


if __name__ == "__main__":
    main()
