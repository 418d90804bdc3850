"""End-to-end speed: wall-clock tokens/s of every decoding method on the same prompts, in the same run.

Methods:
* ``ar``: our plain decoding loop with a KV cache (the baseline of every speedup);
* ``chain`` / ``tree``: speculative decoding with a drafter (trained, ``ngram`` prompt lookup, ``self``);
* ``hf_generate``: Hugging Face's ``generate`` (greedy, or sampling at temperature > 0);
* ``hf_prompt_lookup``: ``generate`` with ``prompt_lookup_num_tokens`` (greedy only).

For fairness the prompts are the outer loop and the methods the inner one, so that a slow spell of a
shared machine hits every method alike; one untimed warm-up generation runs first. Tokens/s is total
new tokens over total wall time (prefill included). Every speedup is a ratio against ``ar`` from the
same call, and the machine's description is saved with the results.
"""

from __future__ import annotations

import math
import os
import platform
import time
from dataclasses import dataclass, field, replace

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..corpus import answer_text, chat_prompt_ids, load_mtbench, mtbench_messages
from ..decoding.cycle import DecodeConfig, GenerationResult, stop_tokens
from ..decoding.dispatch import generate
from . import metrics

HF_METHODS = ("hf_generate", "hf_prompt_lookup")
METHODS = ("ar", "chain", "tree", *HF_METHODS)


def machine_info() -> dict:
    """Where the numbers were taken: host, CPU/GPU, threads, library versions."""
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return dict(
        host=platform.node(),
        cpu=cpu,
        cores=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        gpu=gpu,
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
    )


def machine_name(info: dict | None = None) -> str:
    """A short file-name-safe label: the GPU, else the CPU model and core count."""
    info = info or machine_info()
    label = info["gpu"] or f"{info['cpu']}-{info['cores']}cores"
    return "".join(c if c.isalnum() else "-" for c in label).strip("-").lower()


def mtbench_first_turns(tokenizer, n_questions: int | None) -> list[list[int]]:
    """Chat-templated first-turn prompts of the first ``n_questions`` MT-bench questions."""
    return [chat_prompt_ids(tokenizer, mtbench_messages(q)) for q in load_mtbench(n_questions)]


def run_mtbench_benchmark(
    target, drafters: dict, n_questions: int | None, turns: int = 2, **kwargs
) -> list[Method]:
    """:func:`run_benchmark` on MT-bench: the first turns, then (``turns=2``) the second turns, whose prompts
    hold the first answer of our plain decoding at the first temperature benchmarked (greedy when 0 is
    listed first). Every method sees the same prompts."""
    if turns not in (1, 2):
        raise ValueError(f"turns must be 1 or 2, got {turns!r}.")
    questions = load_mtbench(n_questions)
    tok = target.tokenizer
    plan = run_benchmark(
        target, drafters, [chat_prompt_ids(tok, mtbench_messages(q)) for q in questions], **kwargs
    )
    if turns == 2:
        stops = set(stop_tokens(None, target.info))
        ar = next(m for m in plan if m.method == "ar")
        answers = [answer_text(tok, r.token_ids, stops) for r in ar.results]
        second = [chat_prompt_ids(tok, mtbench_messages(q, 1, a)) for q, a in zip(questions, answers)]
        plan = run_benchmark(target, drafters, second, plan=plan, **kwargs)
    return plan


@dataclass
class Method:
    """One row of the benchmark: a method, its drafter (``-`` for none) and its decoding config."""

    method: str
    drafter: str
    cfg: DecodeConfig
    results: list[GenerationResult] = field(default_factory=list)


@torch.inference_mode()
def hf_generate(
    target, prompt_ids: list[int], cfg: DecodeConfig, prompt_lookup: int | None = None
) -> GenerationResult:
    """Hugging Face ``generate`` timed the same way as our engine (prefill included)."""
    model = target.model
    stops = list(stop_tokens(cfg, target.info))
    ids = torch.tensor([prompt_ids], device=model.device)  # [1, T]
    kwargs = dict(
        max_new_tokens=cfg.max_new_tokens,
        attention_mask=torch.ones_like(ids),
        eos_token_id=stops or None,
        pad_token_id=stops[0] if stops else 0,
    )
    if cfg.temperature > 0:
        kwargs.update(do_sample=True, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    else:
        kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    if prompt_lookup:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup
    if cfg.temperature > 0:
        torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    out = model.generate(ids, **kwargs)
    seconds = time.perf_counter() - t0
    new = out[0, ids.shape[1] :].tolist()
    result = GenerationResult(new, ids.shape[1], "hf")
    result.total_s = seconds
    return result


def plan_methods(drafters: dict, methods, temperatures, base: DecodeConfig) -> list[Method]:
    """Every (method, drafter, temperature) to run; ``ar`` always, first, at each temperature."""
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise ValueError(f"Unknown methods {bad}; choose from {METHODS}.")
    plan = []
    for temperature in temperatures:
        cfg = replace(base, temperature=float(temperature)).validate()
        plan.append(Method("ar", "-", replace(cfg, mode="ar")))
        for m in methods:
            if m in ("chain", "tree"):
                plan += [Method(m, name, replace(cfg, mode=m)) for name in drafters]
            elif m == "hf_generate":
                plan.append(Method(m, "-", cfg))
            elif m == "hf_prompt_lookup" and temperature == 0:
                plan.append(Method(m, "ngram", cfg))
    return plan


def run_benchmark(
    target,
    drafters: dict,
    prompts: list[list[int]],
    methods=METHODS,
    temperatures=(0.0,),
    base: DecodeConfig | None = None,
    prompt_lookup_num_tokens: int = 10,
    progress: bool = True,
    plan: list[Method] | None = None,
) -> list[Method]:
    """Run every planned method on every prompt (prompts outer, methods inner); returns the raw results.
    Pass the ``plan`` of an earlier call to append to it (no new warm-up)."""
    if not prompts:
        raise ValueError("no prompts to benchmark.")
    if plan is None:
        plan = plan_methods(drafters, methods, temperatures, base or DecodeConfig())
        for m in plan:  # untimed warm-up of every code path
            warm = replace(m, cfg=replace(m.cfg, max_new_tokens=4))
            _run_one(target, drafters, warm, prompts[0], prompt_lookup_num_tokens)
    offset = len(plan[0].results)
    for i, prompt in enumerate(tqdm(prompts, desc="speed benchmark", disable=not progress), start=offset):
        for m in plan:
            seeded = replace(m, cfg=replace(m.cfg, seed=m.cfg.seed * 1_000_003 + i))
            m.results.append(_run_one(target, drafters, seeded, prompt, prompt_lookup_num_tokens))
    return plan


def _run_one(target, drafters, m: Method, prompt, prompt_lookup_num_tokens: int) -> GenerationResult:
    if m.method == "hf_generate":
        return hf_generate(target, prompt, m.cfg)
    if m.method == "hf_prompt_lookup":
        return hf_generate(target, prompt, m.cfg, prompt_lookup=prompt_lookup_num_tokens)
    return generate(target, prompt, m.cfg, drafters.get(m.drafter))


def speedup_table(plan: list[Method], machine: str | None = None) -> pd.DataFrame:
    """One row per method x drafter x temperature: tokens/s, speedup vs ``ar``, MAT, exact match vs ``ar``."""
    ar = {m.cfg.temperature: m for m in plan if m.method == "ar"}
    machine = machine or machine_name()
    rows = []
    for m in plan:
        tokens = sum(len(r.token_ids) for r in m.results)
        seconds = sum(r.total_s for r in m.results)
        tps = metrics.tokens_per_second(tokens, seconds)
        base = ar[m.cfg.temperature]
        base_tps = metrics.tokens_per_second(
            sum(len(r.token_ids) for r in base.results), sum(r.total_s for r in base.results)
        )
        exact = math.nan
        if m.cfg.temperature == 0:
            exact = sum(r.token_ids == b.token_ids for r, b in zip(m.results, base.results)) / max(
                len(m.results), 1
            )
        cycles = [a for r in m.results for a in r.accepted_per_cycle]
        rows.append(
            dict(
                method=m.method,
                drafter=m.drafter,
                temperature=m.cfg.temperature,
                tokens_per_s=tps,
                speedup_vs_ar=metrics.speedup(tps, base_tps),
                mat=metrics.mean_accepted_tokens(cycles) if m.method in ("chain", "tree") else math.nan,
                exact_match_vs_ar=exact,
                n_prompts=len(m.results),
                n_tokens=tokens,
                seconds=seconds,
                draft_s=sum(r.draft_s for r in m.results),
                verify_s=sum(r.verify_s for r in m.results),
                prefill_s=sum(r.prefill_s for r in m.results),
                machine=machine,
            )
        )
    return pd.DataFrame(rows)
