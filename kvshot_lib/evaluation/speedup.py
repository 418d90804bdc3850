"""End-to-end speed: wall-clock tokens/s of every decoding method on the same prompts, in the same run.

Methods (:data:`METHODS`):
* ``ar``: our plain decoding loop with a KV cache (the baseline of every speedup);
* ``chain`` / ``tree``: speculative decoding with a drafter (trained, ``ngram`` prompt lookup, ``self``) in the
  fixed shape of the base config;
* ``chain_chosen`` / ``tree_chosen``: the same with the shape chosen by expected speed (``decoding.speed_model``: the
  measured cost model of the precision, acceptance estimates learned online by the method's own runs);
* ``combined``: a chosen tree with prompt lookup's continuation in the same proposal (trained drafters);
* ``hf_generate``: Hugging Face's ``generate`` (greedy, or sampling at temperature > 0);
* ``hf_prompt_lookup``: ``generate`` with ``prompt_lookup_num_tokens`` (greedy only).

Each *precision* (``fp32``, the exact reference; ``bf16`` where the CPU has it; ``auto``, the one whose plain
decoding step the cost model measures faster here, see ``decoding.cost_model.decode_choice_for``) is a
:class:`Setup`: the target cast to it, and the drafters bound to that copy and cast with it. What ``auto`` chose,
with both timings, goes into every row of the tables (:data:`.speed_table.AUTO_COLUMNS`). For fairness the
repetitions are the outer loop, then the prompts, then the precisions, then the methods, so that a slow spell of
a shared machine hits every method alike; one untimed warm-up generation per method runs first. Every speedup
is a ratio against ``ar`` of the same precision, temperature and repetition (:mod:`.speed_table`), and every
greedy row carries the share of its outputs equal to that ``ar``'s (``exact_match_vs_ar``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch
from tqdm.auto import tqdm

from ..corpus import answer_text, chat_prompt_ids, load_mtbench, mtbench_messages
from ..decoding.config import DecodeConfig, GenerationResult
from ..decoding.cost_model import cost_model_for, decode_choice_for
from ..decoding.cycle import stop_tokens
from ..decoding.generate import generate
from ..decoding.speed_model import SpeedModel
from ..drafters import NgramDrafter, drafter_for_target
from ..target import cast_target, decode_dtype, precision_label
from ..target.precision import DTYPES, PrecisionChoice
from .speed_table import machine_info, machine_name, speedup_table

HF_METHODS = ("hf_generate", "hf_prompt_lookup")
CHOSEN_METHODS = ("chain_chosen", "tree_chosen", "combined")
METHODS = ("ar", "chain", "tree", *CHOSEN_METHODS, *HF_METHODS)
FIXED_METHODS = ("ar", "chain", "tree", *HF_METHODS)  # what needs no cost model
# a chosen shape's caps: it drafts and verifies fewer nodes wherever they do not pay
CHOSEN_CAPS = dict(chain_depth=8, tree_depth=8, tree_top_k=4, tree_budget=48, lookup_tokens=8)

__all__ = [
    "CHOSEN_CAPS",
    "CHOSEN_METHODS",
    "FIXED_METHODS",
    "HF_METHODS",
    "METHODS",
    "Method",
    "Setup",
    "hf_generate",
    "machine_info",
    "machine_name",
    "mtbench_first_turns",
    "plan_methods",
    "precision_setups",
    "run_benchmark",
    "run_mtbench_benchmark",
    "speedup_table",
]


def mtbench_first_turns(tokenizer, n_questions: int | None) -> list[list[int]]:
    """Chat-templated first-turn prompts of the first ``n_questions`` MT-bench questions."""
    return [chat_prompt_ids(tokenizer, mtbench_messages(q)) for q in load_mtbench(n_questions)]


@dataclass
class Setup:
    """One precision of a benchmark: the target in that dtype and the drafters bound to it."""

    precision: str  # "fp32" | "bf16" | ...
    target: object
    drafters: dict
    auto: PrecisionChoice | None = None  # what "auto" chose in this benchmark (None: it was not asked for)


def precision_setups(target, drafters: dict, precisions=("fp32",)) -> list[Setup]:
    """A :class:`Setup` per precision (``fp32``, ``bf16``, or ``auto``: the faster for plain decoding here, by
    ``decoding.cost_model.decode_choice_for``): the target cast to it (a copy, unless it is already in that
    dtype) and every drafter bound to that copy, in its dtype. Every setup carries the ``auto`` choice."""
    setups = []
    auto = decode_choice_for(target) if "auto" in precisions else None
    for p in precisions:
        dtype = DTYPES[auto.precision] if p == "auto" else decode_dtype(p, target.info.device)
        label = precision_label(dtype)
        if any(s.precision == label for s in setups):
            continue  # "auto" that resolves to a precision already listed
        tgt = cast_target(target, dtype)
        bound = {
            name: drafter_for_target(d, tgt, dtype) if tgt is not target else d
            for name, d in drafters.items()
        }
        setups.append(Setup(label, tgt, bound, auto))
    return setups


@dataclass
class Method:
    """One row of the benchmark: a method, its drafter (``-`` for none), its decoding config and precision;
    ``results[i]`` was measured in repetition ``reps[i]``."""

    method: str
    drafter: str
    cfg: DecodeConfig
    results: list[GenerationResult] = field(default_factory=list)
    precision: str = "fp32"
    reps: list[int] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list, repr=False)  # the prompt of each result
    auto: dict = field(default_factory=dict)  # PrecisionChoice.record() of "auto"; {} if not asked


def plan_methods(
    drafters: dict,
    methods,
    temperatures,
    base: DecodeConfig,
    precision: str = "fp32",
    cost=None,
    chosen_caps: dict | None = None,
    drafter_methods: dict | None = None,
) -> list[Method]:
    """Every (method, drafter, temperature) to run; ``ar`` always, first, at each temperature. Chosen shapes
    need ``cost`` (a ``decoding.CostModel`` with every drafter's costs); each gets its own :class:`SpeedModel`
    and the caps ``chosen_caps`` (default :data:`CHOSEN_CAPS`) in place of the base config's fixed sizes.
    ``drafter_methods``: drafter name -> the only methods it runs (e.g. ``{"ngram": ("chain",)}``)."""
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise ValueError(f"Unknown methods {bad}; choose from {METHODS}.")
    if cost is None and any(m in CHOSEN_METHODS for m in methods):
        raise ValueError(
            f"methods {CHOSEN_METHODS} need the cost model: plan_methods(..., cost=cost_model_for(...))."
        )
    plan = []
    allowed = drafter_methods or {}

    def runs(name, method):
        return method in allowed.get(name, METHODS)

    for temperature in temperatures:
        cfg = replace(base, temperature=float(temperature)).validate()
        plan.append(Method("ar", "-", replace(cfg, mode="ar"), precision=precision))
        for m in methods:
            if m in ("chain", "tree"):
                plan += [
                    Method(m, name, replace(cfg, mode=m), precision=precision)
                    for name in drafters
                    if runs(name, m)
                ]
            elif m in CHOSEN_METHODS:
                for name, drafter in drafters.items():
                    if (m == "combined" and isinstance(drafter, NgramDrafter)) or not runs(name, m):
                        continue  # prompt lookup joined to itself, or not asked for
                    mode, lookup = ("chain", False) if m == "chain_chosen" else ("tree", m == "combined")
                    speed = SpeedModel(cost, name)
                    caps = chosen_caps or CHOSEN_CAPS
                    chosen = replace(cfg, mode=mode, shape="chosen", lookup=lookup, speed=speed, **caps)
                    plan.append(Method(m, name, chosen, precision=precision))
            elif m == "hf_generate":
                plan.append(Method(m, "-", cfg, precision=precision))
            elif m == "hf_prompt_lookup" and temperature == 0:
                plan.append(Method(m, "ngram", cfg, precision=precision))
    return plan


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


def _plan_setups(
    setups: list[Setup], methods, temperatures, base: DecodeConfig, caps, remeasure: bool, drafter_methods
) -> dict[str, list[Method]]:
    plans = {}
    for s in setups:
        cost = None
        if any(m in CHOSEN_METHODS for m in methods):
            cost = cost_model_for(s.target, s.drafters, kernel=base.small_batch_kernel, remeasure=remeasure)
        plans[s.precision] = plan_methods(
            s.drafters, methods, temperatures, base, s.precision, cost, caps, drafter_methods
        )
        for m in plans[s.precision]:
            m.auto = s.auto.record() if s.auto is not None else {}
    return plans


def run_benchmark(
    target,
    drafters: dict,
    prompts: list[list[int]],
    methods=FIXED_METHODS,
    temperatures=(0.0,),
    base: DecodeConfig | None = None,
    prompt_lookup_num_tokens: int = 10,
    progress: bool = True,
    plan: list[Method] | None = None,
    precisions=("fp32",),
    repeats: int = 1,
    setups: list[Setup] | None = None,
    chosen_caps: dict | None = None,
    remeasure_costs: bool = False,
    drafter_methods: dict | None = None,
) -> list[Method]:
    """Run every planned method on every prompt, ``repeats`` times, in every precision (repetitions outer, then
    prompts, then precisions, then methods); returns the raw results. Pass the ``plan`` (and ``setups``) of an
    earlier call to append to it (no new warm-up). ``target``/``drafters`` are the float32 ones; the other
    precisions are copies (:func:`precision_setups`). ``remeasure_costs``: measure the cost models afresh rather
    than read them from the cache."""
    if not prompts:
        raise ValueError("no prompts to benchmark.")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}.")
    setups = setups or precision_setups(target, drafters, precisions)
    by_precision = {s.precision: s for s in setups}
    if plan is None:
        plans = _plan_setups(
            setups,
            methods,
            temperatures,
            base or DecodeConfig(),
            chosen_caps,
            remeasure_costs,
            drafter_methods,
        )
        plan = [m for s in setups for m in plans[s.precision]]
        for m in plan:  # untimed warm-up of every code path
            warm = replace(m, cfg=replace(m.cfg, max_new_tokens=4), results=[], reps=[], prompts=[])
            _run_one(by_precision[m.precision], warm, prompts[0], prompt_lookup_num_tokens)
    offset = len(plan[0].results)  # prompts already run: seeds stay distinct
    total = repeats * len(prompts)
    bar = tqdm(total=total, desc="speed benchmark", disable=not progress)
    for rep in range(repeats):
        for i, prompt in enumerate(prompts, start=offset):
            for s in setups:
                for m in (m for m in plan if m.precision == s.precision):
                    seeded = replace(m, cfg=replace(m.cfg, seed=m.cfg.seed * 1_000_003 + i))
                    m.results.append(_run_one(s, seeded, prompt, prompt_lookup_num_tokens))
                    m.reps.append(rep)
                    m.prompts.append(list(prompt))
            bar.update()
    bar.close()
    return plan


def _run_one(setup: Setup, m: Method, prompt, prompt_lookup_num_tokens: int) -> GenerationResult:
    if m.method == "hf_generate":
        return hf_generate(setup.target, prompt, m.cfg)
    if m.method == "hf_prompt_lookup":
        return hf_generate(setup.target, prompt, m.cfg, prompt_lookup=prompt_lookup_num_tokens)
    return generate(setup.target, prompt, m.cfg, setup.drafters.get(m.drafter))


def run_mtbench_benchmark(
    target, drafters: dict, n_questions: int | None, turns: int = 2, **kwargs
) -> list[Method]:
    """:func:`run_benchmark` on MT-bench: the first turns, then (``turns=2``) the second turns, whose prompts
    hold the first answer of our plain decoding at the first temperature benchmarked (greedy when 0 is listed
    first) in the first precision. Every method sees the same prompts. With ``repeats > 1`` each repetition
    runs the first turns and then the second turns."""
    if turns not in (1, 2):
        raise ValueError(f"turns must be 1 or 2, got {turns!r}.")
    questions = load_mtbench(n_questions)
    tok = target.tokenizer
    repeats = kwargs.pop("repeats", 1)
    on_repeat = kwargs.pop("on_repeat", None)
    setups = kwargs.pop("setups", None) or precision_setups(
        target, drafters, kwargs.pop("precisions", ("fp32",))
    )
    kwargs.pop("precisions", None)
    first = [chat_prompt_ids(tok, mtbench_messages(q)) for q in questions]
    plan, second = kwargs.pop("plan", None), None
    for done in range(1, repeats + 1):
        plan = run_benchmark(target, drafters, first, plan=plan, setups=setups, **kwargs)
        kwargs.pop("remeasure_costs", None)  # once is enough
        if turns == 2:
            if second is None:
                stops = set(stop_tokens(None, target.info))
                ar = next(m for m in plan if m.method == "ar")
                answers = [answer_text(tok, r.token_ids, stops) for r in ar.results[: len(questions)]]
                second = [chat_prompt_ids(tok, mtbench_messages(q, 1, a)) for q, a in zip(questions, answers)]
            plan = run_benchmark(target, drafters, second, plan=plan, setups=setups, **kwargs)
        _number_repetitions(plan, done)
        if on_repeat is not None:
            on_repeat(plan, done)
    return plan


def _number_repetitions(plan: list[Method], repeats: int) -> None:
    """Each method ran its prompts in ``repeats`` equal blocks: label every result with its block."""
    for m in plan:
        per = len(m.results) // repeats
        m.reps = [i // per for i in range(len(m.results))] if per else []
