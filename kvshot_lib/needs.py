"""What a profile's run needs before it starts: memory, disk and time per notebook, and whether this machine has it.

``kvshot run --profile NAME --dry-run`` prints :func:`plan_needs` as a table (:func:`needs_table`) and refuses, in
one line, where the memory or the disk at hand is short (:func:`shortfall`); a real ``kvshot run`` refuses the same
way before any notebook starts (``--force`` runs anyway). Every figure is an estimate, and each says where it came
from:

* memory and disk from the target's architecture (:func:`~kvshot_lib.target.target_shape`: its config, no
  weights) and the profile's parameters: the weights, the KV cache of the longest context, the drafters held at
  once (float32), a feature store (``data_source: store``: the target's own bytes per token of the captured
  layers) and the drafters' checkpoints (bf16) with one resumable state;
* time is the work divided by rates measured on one machine for one target (:class:`Rates`): on a CUDA run
  ``benchmarks/gpu_check.py``'s result (``benchmarks/results/gpu_check_<gpu>.json``, else the newest), on a CPU
  run the CPU table (``cpu_rates_<cpu>.json``, else the newest), derived from committed CPU measurements, each
  stage naming its source. Rates of another architecture are scaled by the ratio of parameters, and the table
  says so. The work is counted as each notebook does it (:func:`notebook_seconds`): target passes at the forward
  rate; training at each paradigm's measured rate; plain decoding at the plain-decoding rate (the CUDA-graph
  path's ``graphs_tokens_per_s`` where the check has it); speculative decoding as tokens / MAT cycles, each one
  verification forward of its width (the measured c_v(k) / c_v(1)) and the drafter's steps; and the greedy
  replay of notebooks 03 and 04 (``evaluation.acceptance.replay_greedy``) as one plain decoding of each
  reference, one forward over it, and only the drafter's calls per cycle for each drafter. MATs are assumed
  (:data:`ASSUMED_MAT`). ``benchmarks/results/dry_run_check_*.csv`` holds the check against ``make demo``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from .drafters.config import READS_KV
from .target import REPO_ROOT, cache_dir, target_shape

GIB, GB = 2**30, 1e9
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
ARCH_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)
# MT-bench tokens per cycle assumed by the time estimates, from figures/reference/data/acceptance_generations.csv
# (SmolLM2, T=0, 160 turns): hidden-ttt at 8M token-passes 1.59 (chain) and 2.33 (tree), prompt lookup 1.49 /
# 1.51. A larger target's drafters accept more, so its speculative time is an upper bound.
ASSUMED_MAT = {"chain": 1.6, "tree": 2.3, "ngram": 1.5, "random": 1.0}
MTBENCH_PROMPT = (100, 130)  # prompt tokens of turn 1, and of turn 2 before the first answer (same file)


@dataclass
class Need:
    notebook: str
    memory_gib: float
    disk_gb: float = 0.0  # checkpoints and states, under runs/
    cache_gb: float = 0.0  # the feature store, under the cache
    hours: float | None = None
    note: str = ""
    sources: set[str] = field(default_factory=set)  # "measured" / "estimate"


def _dtype_bytes(dtype: str, cuda: bool) -> int:
    return 2 if dtype in ("bfloat16", "bf16", "float16", "fp16") or (dtype == "auto" and cuda) else 4


def target_params(s: dict) -> int:
    """Parameters of a Llama/Qwen3 model of shape ``s`` (embedding, layers, final norm, untied LM head)."""
    H, D, F = s["hidden_size"], s["head_dim"], s["intermediate_size"]
    layer = (
        H * (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * D + s["num_attention_heads"] * D * H
    )
    layer += 3 * H * F + 2 * H + 2 * D
    head = 0 if s["tie_word_embeddings"] else s["vocab_size"] * H
    return s["vocab_size"] * H + s["num_hidden_layers"] * layer + H + head


def drafter_params(s: dict, n_layers: int = 1) -> int:
    """Trainable parameters of an EAGLE-3-like drafter (``fc`` over three layers, ``n_layers`` decoder layers over
    [embedding, feature]); the draft LM head is the target's rows, frozen. An estimate for every paradigm."""
    H, D = s["hidden_size"], s["head_dim"]
    layer = 2 * H * (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * D
    layer += s["num_attention_heads"] * D * H + 3 * H * s["intermediate_size"]
    return 3 * H * H + n_layers * layer


def kv_bytes(s: dict, context: int, dtype_bytes: int) -> int:
    return 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * s["head_dim"] * context * dtype_bytes


def store_bytes_per_token(s: dict) -> int:
    """A bf16 feature store's bytes per token: three hidden layers, their K/V, the final hidden state."""
    return 2 * (3 * s["hidden_size"] + 3 * 2 * s["num_key_value_heads"] * s["head_dim"] + s["hidden_size"])


def turns_for_interval(cv: float, half_width: float = 0.05, z: float = 1.96) -> int:
    """Turns a speed ratio needs for its 95% interval to lie within ``±half_width`` of it. A turn's speed ratio is
    inversely proportional to its cycles per token; over n equal turns the ratio's relative standard error is
    cv / sqrt(n) (cv: the per-turn coefficient of variation of cycles per token), so n = (z cv / half_width)^2."""
    return math.ceil((z * cv / half_width) ** 2)


def this_machine(cuda: bool) -> str:
    """This machine's label in rates file names, as ``evaluation.machine_name`` gives it (the GPU's name, else the
    CPU's, its cores and bf16 tier), without importing ``kvshot_lib.evaluation``: a bare GPU machine may lack scipy."""
    import torch

    from .target import bf16_tier, cpu_model

    gpu = torch.cuda.get_device_name(0) if cuda and torch.cuda.is_available() else None
    label = gpu or f"{cpu_model()}-{os.cpu_count()}cores-{bf16_tier()}"
    return "".join(c if c.isalnum() else "-" for c in label).strip("-").lower()


def measured(cuda: bool, results_dir: Path = RESULTS_DIR) -> tuple[dict, Path] | tuple[None, None]:
    """This machine's rates (``gpu_check_<gpu>.json`` on a CUDA run, ``cpu_rates_<cpu>.json`` on a CPU run), else
    the newest of that kind at full scale, else (None, None)."""
    kind = "gpu_check" if cuda else "cpu_rates"
    files = [p for p in Path(results_dir).glob(f"{kind}_*.json") if not p.stem.endswith("_tiny")]
    if not files:
        return None, None
    path = next((p for p in files if p.stem == f"{kind}_{this_machine(cuda)}"), None)
    path = path or max(files, key=lambda p: p.stat().st_mtime)
    return json.loads(path.read_text()), path


def _times(rate: float | None, factor: float) -> float | None:
    return rate * factor if rate else None


class Rates:
    """A gpu_check result's or a CPU table's rates, by what the estimates ask for, for a target of shape ``s``;
    rates measured on another architecture are scaled by the ratio of parameters (``scale``)."""

    def __init__(self, result: dict | None, s: dict | None = None):
        self.result = result or {}
        stages = self.result.get("stages", {})
        self.train = {k.removeprefix("train_"): v for k, v in stages.items() if k.startswith("train_")}
        there = self.result.get("target", {}).get("architecture")
        self.same_target = s is None or not there or all(s[k] == there[k] for k in ARCH_KEYS)
        self.scale = 1.0
        if not self.same_target:  # the measured target's parameters over this one's
            measured_on = dict(there, vocab_size=self.result["target"].get("vocab_size", s["vocab_size"]))
            self.scale = target_params(measured_on) / target_params(s)
        ext, dec = stages.get("extraction", {}), stages.get("plain_decoding", {})
        self.extract = _times(ext.get("tokens_per_s"), self.scale)
        self.forward = _times(ext.get("forward_tokens_per_s") or ext.get("tokens_per_s"), self.scale)
        self.bytes_per_token = ext.get("bytes_per_token") if self.same_target else None
        self.graphs = bool(dec.get("graphs_tokens_per_s"))  # the CUDA-graph path's plain decoding, preferred
        eager = {
            False: dec.get("tokens_per_s"),
            True: dec.get("bf16_tokens_per_s") or dec.get("tokens_per_s"),
        }
        self._decode = {
            bf16: _times(dec.get("graphs_tokens_per_s") or r, self.scale) for bf16, r in eager.items()
        }
        self.hf_decode = _times(dec.get("tokens_per_s"), self.scale)  # transformers' generate: eager
        self.verify, self.drafting = stages.get("verification_cost", {}), stages.get("drafting", {})
        chain, depth = (
            stages.get("cycle_overhead", {}).get("chain", {}),
            self.result.get("settings", {}).get("chain_depth"),
        )
        self.cycle_step = (
            chain["overhead_over_cv1"] / depth if chain.get("overhead_over_cv1") and depth else None
        )
        self.build_gib = stages.get("build", {}).get("peak_memory_gib", 0.0)
        self.startup_s = stages.get("notebook_startup_s", {}).get("seconds", 0.0)
        self.target_layers = (s or {}).get("num_hidden_layers", 32)

    def decode(self, bf16: bool = False) -> float | None:
        """Our engine's plain decoding tokens/s (bf16: the table's bf16 rate where it has one apart)."""
        return self._decode[bf16]

    def train_rate(self, paradigm: str, regime: str = "ttt") -> float | None:
        """Training tokens/s of ``paradigm`` in ``regime``: ttt's where the regime was not measured (teacher forcing
        unrolls one step: an upper bound of the time), the slowest paradigm's where the paradigm was not."""
        m = self.train.get(f"{paradigm}-{regime}") or self.train.get(f"{paradigm}-ttt") or {}
        slowest = min((v["tokens_per_s"] for v in self.train.values() if v.get("tokens_per_s")), default=None)
        return _times(m.get("tokens_per_s") or slowest, self.scale)

    def verify_rel(self, mode: str, k: int, bf16: bool = False) -> float:
        """c_v(k) / c_v(1): at the measured size at or above ``k`` (linear past the largest); 1 where unmeasured."""
        rows = (bf16 and self.verify.get("bf16_rows")) or self.verify.get("rows") or []
        col = "tree_rel" if mode == "tree" else "chain_rel"
        above = [r for r in rows if r["k"] >= k]
        if above:
            return min(above, key=lambda r: r["k"])[col]
        return rows[-1][col] * k / rows[-1]["k"] if rows else 1.0

    def draft_step(self, n_layers: int, bf16: bool = False) -> float:
        """One step of an ``n_layers`` drafter in plain decoding steps: the measured step of a one-layer drafter
        (its layer and its fc / LM head: two units; or a gpu_check's chain cycle overhead per drafted token), else
        two units over the target's layers."""
        one = (
            (bf16 and self.drafting.get("bf16_step_rel")) or self.drafting.get("step_rel") or self.cycle_step
        )
        return (one or 2 / self.target_layers) * (n_layers + 1) / 2

    def seconds(self, work: float, rate: float | None) -> float | None:
        return None if not rate else work / rate


@dataclass(frozen=True)
class Drafter:
    """What a time estimate needs of a drafter: its kind (trained, block, ngram, random, self) and its layers."""

    name: str
    kind: str = "trained"
    n_layers: int = 1

    def mat(self, mode: str, depth: int) -> float:
        if self.kind == "self":  # the target drafting for itself: every greedy draft is accepted
            return depth + 1.0
        return ASSUMED_MAT.get(self.kind, ASSUMED_MAT[mode])

    def step(self, rates: Rates, bf16: bool) -> float:
        """One call in plain decoding steps: the self drafter's is a target forward; prompt lookup's is a lookup."""
        fixed = {"self": 1.0, "ngram": 0.01, "random": 0.0}
        return fixed[self.kind] if self.kind in fixed else rates.draft_step(self.n_layers, bf16)


def speculative_seconds(tokens: float, d: Drafter, mode: str, depth: int, width: int, rates: Rates,
                        bf16: bool = False, replay: bool = False) -> float | None:  # fmt: skip
    """``tokens`` decoded by ``d`` in ``mode``, drafting ``depth`` deep and verifying ``width`` tokens a cycle:
    tokens / MAT cycles, each one verification forward (none in the greedy replay) and the drafter's calls (one
    for a block; in the replay a chain stops at its first wrong draft: MAT calls on average)."""
    step = rates.seconds(1.0, rates.decode(bf16))
    if step is None:
        return None
    mat = d.mat(mode, depth)
    calls = 1.0 if d.kind == "block" else min(mat, depth) if replay and mode == "chain" else depth
    verify = 0.0 if replay else rates.verify_rel(mode, width, bf16)
    return tokens / mat * (verify + calls * d.step(rates, bf16)) * step


def _total(*parts: float | None) -> float | None:
    return None if any(p is None for p in parts) else sum(parts)


def _tokens_per_sequence(p: dict, rates: Rates) -> float:
    """Mean tokens of a training conversation at ``max_len`` (measured where the rates hold that length)."""
    cap = min(p.get("max_tokens") or p["max_len"], p["max_len"])
    data = rates.result.get("data", {})
    mean = data.get("mean_tokens_per_conversation") if data.get("max_len") == p["max_len"] else None
    return min(cap, mean) if mean else cap


def _trained(full: dict) -> list[dict]:
    return list(full.get("02", {}).get("drafters") or [])


def _name(spec: dict) -> str:
    """A notebook 02 drafter's name as ``training.TrainConfig`` gives it."""
    block = spec.get("paradigm") == "block"
    name = f"block-{spec.get('context')}" if block else f"{spec.get('paradigm')}-{spec.get('regime', 'ttt')}"
    return spec.get("name") or name + ("-zeroed" if spec.get("target_kv") == "zeroed" else "")


def drafters_of(p: dict, full: dict, trained_only: list[str] | None = None) -> list[Drafter]:
    """The drafters notebook 03 or 06 loads: its baselines, the run's trained ones (02's) and the extra checkpoint
    folders (``<row>@<run>``, one layer assumed); ``trained_only`` keeps only the trained ones it names."""
    out = [
        Drafter(b, b if b in ("ngram", "random", "self") else "trained")
        for b in p.get("baseline_drafters", [])
    ]
    specs = [(_name(d), d.get("paradigm"), d.get("n_layers", 1)) for d in _trained(full)]
    specs += [(f"{Path(e).name}@{Path(e).parent.name}", "hidden", 1) for e in p.get("extra_drafters", [])]
    kept = [(n, "block" if k == "block" else "trained", la) for n, k, la in specs]
    return out + [Drafter(*d) for d in kept if trained_only is None or d[0] in trained_only]


def kv_readers(trained: list[dict]) -> tuple[list[dict], list[dict]]:
    """Notebook 04's drafters: those that read the real target KV (no block drafter), and of those the ones
    that concatenate heads (the λ sweep's)."""
    readers = [d for d in trained if d.get("paradigm") in READS_KV and d.get("target_kv", "real") == "real"]
    return readers, [d for d in readers if d.get("kv_mode", "concat") == "concat"]


def prompt_of(new: int) -> float:
    """Mean prompt tokens of an MT-bench turn (both turns) whose first answer had ``new`` tokens."""
    return (MTBENCH_PROMPT[0] + MTBENCH_PROMPT[1] + new) / 2


def references_seconds(turns: int, new: int, rates: Rates) -> float | None:
    """Plain greedy decoding of ``turns`` MT-bench turns, ``new`` tokens each, prefill included."""
    return _total(
        rates.seconds(turns * new, rates.decode()), rates.seconds(turns * prompt_of(new), rates.forward)
    )


def training_seconds(
    specs: list[dict], steps: int, p: dict, seq: float, rates: Rates, evals: int
) -> float | None:
    """``specs`` trained ``steps`` steps each, with a gradient probe every ``probe_every`` steps (one step more
    each) and ``evals`` held-out evaluations (forward only: a third of a step's cost per token)."""
    probes = steps // p["probe_every"] if p.get("probe_every") else 0
    tokens = (steps + probes) * p.get("batch_size", 2) * seq + evals * p.get("eval_sequences", 0) * seq / 3
    return _total(
        *(rates.seconds(tokens, rates.train_rate(d.get("paradigm"), d.get("regime", "ttt"))) for d in specs)
    )


def _shapes(p: dict) -> dict[str, tuple[int, int]]:
    """Per mode, how deep the drafter drafts and how many tokens a cycle verifies."""
    return {
        "chain": (p["chain_depth"], p["chain_depth"] + 1),
        "tree": (p["tree_depth"], p["tree_budget"] + 1),
    }


def acceptance_seconds(p: dict, full: dict, rates: Rates) -> float | None:
    """Notebook 03 for every drafter and mode: at T=0 the greedy replay (one plain decoding and one forward per
    turn, then only each drafter's calls), at T>0 the engine on ``n_questions_sampled`` questions."""
    new, parts, shape = p["max_new_tokens"], [], _shapes(p)
    for t in p["temperatures"]:
        replay = t == 0 and p.get("greedy_replay", True)
        turns = 2 * (p["n_questions"] if t == 0 else p["n_questions_sampled"])
        if replay:
            passes = rates.seconds(turns * (prompt_of(new) + new), rates.forward)
            parts += [references_seconds(turns, new, rates), passes]
        parts += [speculative_seconds(turns * new, d, m, *shape[m], rates, replay=replay)
                  for d in drafters_of(p, full) for m in p["modes"]]  # fmt: skip
    return _total(*parts)


def query_error_seconds(p: dict, full: dict, rates: Rates) -> float | None:
    """Notebook 04 on the greedy references (notebook 03's, unless its sizes differ): per KV reader one target
    forward and one unrolled drafter forward per turn; per head-concatenating one a forward with the queries and
    a greedy chain replay per λ."""
    readers, concat = kv_readers(_trained(full))
    turns, new = 2 * p["n_questions"], p["max_new_tokens"]
    tokens, ours = turns * (prompt_of(new) + new), full.get("03", {})
    shared = (ours.get("n_questions"), ours.get("max_new_tokens")) == (p["n_questions"], new)
    parts = [] if shared else [references_seconds(turns, new, rates)]
    for d in readers:
        parts += [
            rates.seconds(tokens, rates.forward),
            rates.seconds(tokens / 3, rates.train_rate(d["paradigm"])),
        ]
    for d in concat:
        drafter = Drafter(_name(d), n_layers=d.get("n_layers", 1))
        replay = speculative_seconds(turns * new, drafter, "chain", p["chain_depth"], 0, rates, replay=True)
        parts += [rates.seconds(tokens, rates.forward), *[replay] * len(p["lambdas"])]
    return _total(*parts)


SPEED_METHODS = ("chain", "tree", "chain_chosen", "tree_chosen", "combined")


def speed_table_seconds(p: dict, full: dict, rates: Rates) -> float | None:
    """Notebook 06: every row ``evaluation.speedup.plan_methods`` plans (``ar``, the HF baselines, each drafter in
    each speculative method it is allowed), each over its ``n_questions`` x ``turns`` prompts (prefill included),
    per precision and repetition; a chosen shape is costed as its mode's fixed one, ``combined`` as a tree."""
    allowed, new = p.get("drafter_methods") or {}, p["max_new_tokens"]
    prompts, shape, parts = p["repeats"] * p["n_questions"] * p["turns"], _shapes(p), []
    rows = [
        (d, "chain" if m.startswith("chain") else "tree")
        for d in drafters_of(p, full, p.get("trained_drafters"))
        for m in p["methods"]
        if m in SPEED_METHODS
        and m in allowed.get(d.name, SPEED_METHODS)
        and (m, d.kind) != ("combined", "ngram")
    ]
    for precision in p["precisions"]:
        bf16 = precision == "bf16" or (
            precision == "auto" and (rates.decode(True) or 0) > (rates.decode() or 0)
        )
        for t in p["temperatures"]:
            hf = [m for m in p["methods"] if m == "hf_generate" or (m == "hf_prompt_lookup" and t == 0)]
            parts += [rates.seconds(prompts * new, rates.decode(bf16))]
            parts += [rates.seconds(prompts * new, rates.hf_decode) for _ in hf]
            parts += [
                speculative_seconds(prompts * new, d, mode, *shape[mode], rates, bf16) for d, mode in rows
            ]
    prefill = rates.seconds(prompts * prompt_of(new), rates.forward)
    return _total(*parts, *([prefill] * len(parts)))


def notebook_seconds(number: str, p: dict, full: dict, seq: float, rates: Rates) -> float | None:
    """Seconds notebook ``number`` computes for with parameters ``p`` (every notebook's in ``full``), its start
    (kernel, imports, target) included; None where a rate it needs was not measured."""
    if number == "00" and p.get("data_source", "store") == "store":
        work = rates.seconds((p["n_train_conversations"] + p["n_eval_conversations"]) * seq, rates.extract)
    elif number == "01":  # one target pass over each document; the probes' own training is not counted
        work = rates.seconds((p["n_train_docs"] + p["n_test_docs"]) * p["probe_max_len"], rates.forward)
    elif number == "02":
        steps = round(p["train_steps"] * (1 + p.get("decay_fraction", 0.1) if p.get("curve_points") else 1))
        evals = steps // max(1, p.get("eval_every") or steps) + 1 + (p.get("curve_points") or 0)
        work = training_seconds(_trained(full), steps, p, seq, rates, evals)
    elif number == "05":
        runs = [p["remedy_drafter"]] * len(p["remedies"]) * len(p["remedy_seeds"])
        work = training_seconds(runs, p["remedy_train_steps"], p, seq, rates, 2)
    elif number in ("03", "04", "06"):
        work = {"03": acceptance_seconds, "04": query_error_seconds, "06": speed_table_seconds}[number](
            p, full, rates
        )
    elif number == "07":  # the fidelity and speed sweeps, each prompt prefilled once, and the timed forwards
        sweep = 1 + len(p["budgets"]) * len(p["full_everys"]) * len(p["fidelity_variants"])
        speed = 1 + len(p["speed_budgets"]) * len(p["speed_full_everys"]) * len(p["speed_variants"])
        tokens = p["n_fidelity_prompts"] * sweep * p["fidelity_max_new_tokens"]
        tokens += (1 + p["max_trained_drafters"]) * p["n_speed_prompts"] * speed * p["max_new_tokens"]
        prefill = sum(p["contexts"]) * max(p["n_fidelity_prompts"], p["n_speed_prompts"]) + sum(
            p["cost_lengths"]
        )
        work = _total(
            rates.seconds(len(p["contexts"]) * tokens, rates.decode()), rates.seconds(prefill, rates.forward)
        )
    else:
        work = 0.0
    return _total(work, rates.startup_s) if rates.result else None


def notebook_need(number: str, p: dict, full: dict, s: dict, rates: Rates, counted: set, cuda: bool) -> Need:
    """The need of notebook ``number`` with parameters ``p`` (every notebook's in ``full``) for a target of shape
    ``s``; ``counted`` remembers what an earlier notebook of the run already holds (the feature store)."""
    wbytes = target_params(s) * _dtype_bytes(p.get("dtype", "auto"), cuda)
    need = Need(number, wbytes / GIB, sources={"estimate"})
    seq = _tokens_per_sequence(p, rates) if "max_len" in p else 0
    trained = _trained(full)

    def train(specs: list[dict], steps: int, label: str) -> None:
        B, vocab, K = p.get("batch_size", 2), p.get("draft_vocab_size", 8192), p.get("ttt_steps", 7)
        for spec in specs:
            paradigm, layers = spec.get("paradigm"), spec.get("n_layers", 1)
            m = rates.train.get(f"{paradigm}-ttt") if layers == 1 and rates.same_target else None
            same = m and (m.get("batch_size"), m.get("max_len"), m.get("draft_vocab_size")) == (
                B, p.get("max_tokens"), vocab)  # fmt: skip
            if same and m.get("peak_memory_gib"):
                peak = (
                    m["peak_memory_gib"] - rates.build_gib + wbytes / GIB
                )  # the check's peak, the real weights
                need.sources.add("measured")
            else:  # the draft logits of every unrolled step, kept for backward, and AdamW's state
                peak = (wbytes + B * seq * vocab * 4 * K * 3 + drafter_params(s, layers) * 16) / GIB
            need.memory_gib = max(need.memory_gib, peak)
            need.disk_gb += ((m or {}).get("checkpoint_bytes") or drafter_params(s, layers) * 2) / GB
        need.disk_gb += (
            max(drafter_params(s, d.get("n_layers", 1)) for d in specs) * 12 / GB
        )  # resumable state
        need.note = f"{len(specs)} {label} x {steps} steps x {B} x ~{seq:.0f} tokens"

    def decode(context: int, drafters: int, what: str) -> None:
        held = kv_bytes(s, context, 2 if cuda else 4) + drafters * drafter_params(s) * 4
        need.memory_gib += held / GIB
        need.note = what

    if number in ("00", "02", "05") and p.get("data_source", "store") == "store" and "store" not in counted:
        counted.add("store")
        n_conv = p["n_train_conversations"] + p["n_eval_conversations"]
        need.cache_gb += n_conv * seq * (rates.bytes_per_token or store_bytes_per_token(s)) / GB
        need.note = f"feature store: {n_conv} conversations x ~{seq:.0f} tokens"
    if number == "00" and not need.note:
        need.note = "tokenizing" + ("; no feature store (online)" if p.get("data_source") == "online" else "")
    elif number == "01":
        tokens = (p["n_train_docs"] + p["n_test_docs"]) * p["probe_max_len"]
        need.memory_gib += kv_bytes(s, p["probe_max_len"], 2) / GIB
        need.note = f"target passes over {tokens:,} tokens (the probes' own training not counted)"
    elif number == "02":
        curve = 1 + p.get("decay_fraction", 0.1) if p.get("curve_points") else 1.0
        train(trained, round(p["train_steps"] * curve), "drafters")
    elif number == "05":
        runs = [p["remedy_drafter"]] * len(p["remedies"]) * len(p["remedy_seeds"])
        train(runs, p["remedy_train_steps"], "remedy runs")
    elif number == "03":
        n = len(drafters_of(p, full)) * len(p["modes"])
        decode(1024 + p["max_new_tokens"], len(trained),
               f"MT-bench: greedy replay of {n} drafter x mode on {2 * p['n_questions']} turns, engine on "
               f"{2 * p['n_questions_sampled']} at T>0, {p['max_new_tokens']} tokens")  # fmt: skip
    elif number == "04":
        readers = len(kv_readers(trained)[0])
        decode(1024 + p["max_new_tokens"], readers,
               f"MT-bench, {readers} KV-reading drafters on {2 * p['n_questions']} turns")  # fmt: skip
    elif number == "06":
        n = len(drafters_of(p, full, p.get("trained_drafters")))
        decode(1024 + p["max_new_tokens"], n,
               f"MT-bench speed table: {n} drafters, {p['n_questions']} questions x {p['turns']} turns x "
               f"{p['max_new_tokens']} tokens, T in {p['temperatures']}")  # fmt: skip
    elif number == "07":
        decode(max(p["contexts"]) + p["max_new_tokens"], 2, f"long contexts {p['contexts']}")
    need.hours = None if (t := notebook_seconds(number, p, full, seq, rates)) is None else t / 3600
    return need


def plan_needs(
    full: dict[str, dict], selected: list[str], results_dir: Path | None = None
) -> tuple[list[Need], dict]:
    """One :class:`Need` per notebook in ``selected``; ``full`` holds every notebook's parameters (the profile's over
    the notebook's defaults). Returns them with the context: the target's shape and where the rates came from."""
    first = full[selected[0]] if selected else next(iter(full.values()))
    target, device = first.get("target", ""), str(first.get("device", "auto"))
    cuda = device.startswith("cuda")
    if device == "auto":
        import torch

        cuda = torch.cuda.is_available()
    result, path = measured(cuda, results_dir or RESULTS_DIR)
    s = target_shape(target)
    there = (result or {}).get("target", {})
    if (
        s is None and there.get("name") == target and there.get("architecture")
    ):  # a fresh clone: no config yet
        s = dict(there["architecture"], family=there.get("family", ""), vocab_size=there["vocab_size"])
    if s is None:
        raise ValueError(
            f"the architecture of target {target!r} cannot be read without loading it: pass a local folder "
            "(--set target=/path/to/model) or a preset."
        )
    rates, counted = Rates(result, s), set()
    needs = [notebook_need(n, full[n], full, s, rates, counted, cuda) for n in sorted(full) if n in selected]
    context = dict(
        target=target,
        shape=s,
        params=target_params(s),
        weights_gib=target_params(s) * _dtype_bytes(first.get("dtype", "auto"), cuda) / GIB,
        dtype=first.get("dtype", "auto"),
        device=device,
        data_source=next((full[n]["data_source"] for n in sorted(full) if "data_source" in full[n]), None),
        rates_file=path,
        rates=rates,
    )
    return needs, context


def _available_ram() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def at_hand(device: str, runs_dir: Path = REPO_ROOT / "runs") -> dict:
    """Free memory where the target will run (the GPU's, or the RAM's; None: a CUDA run on a machine without CUDA)
    and free disk where the feature store (the cache) and the checkpoints (``runs/``) go."""
    import torch

    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if cuda:
        memory = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None
    else:
        memory = _available_ram()
    runs = Path(runs_dir)
    while not runs.exists():
        runs = runs.parent
    cache = cache_dir()
    return dict(
        memory_kind="GPU" if cuda else "RAM",
        memory=memory,
        cache=(cache, shutil.disk_usage(cache).free),
        runs=(runs, shutil.disk_usage(runs).free),
        same_disk=os.stat(cache).st_dev == os.stat(runs).st_dev,
    )


def shortfall(needs: list[Need], hand: dict) -> str | None:
    """One line saying what is short and by how much, or None when the run fits."""
    short = []
    peak = max(needs, key=lambda n: n.memory_gib)
    what = f"{'GPU memory' if hand['memory_kind'] == 'GPU' else 'RAM'}: {peak.memory_gib:.1f} GiB at the peak (notebook {peak.notebook})"
    if hand["memory"] is None:
        short.append(f"{what}, and this machine has no CUDA GPU")
    elif hand["memory"] / GIB < peak.memory_gib:
        free = hand["memory"] / GIB
        short.append(f"{what}, {free:.1f} GiB free ({peak.memory_gib - free:.1f} GiB short)")
    cache_gb, runs_gb = sum(n.cache_gb for n in needs), sum(n.disk_gb for n in needs)
    (cache, cache_free), (runs, runs_free) = hand["cache"], hand["runs"]
    checks = [((cache_gb + runs_gb), cache_free, f"{cache} and {runs}")] if hand["same_disk"] else [
        (cache_gb, cache_free, f"{cache} (feature store)"),
        (runs_gb, runs_free, f"{runs} (checkpoints)"),
    ]  # fmt: skip
    for need, free, where in checks:
        if free / GB < need:
            short.append(
                f"disk: {need:.1f} GB under {where}, {free / GB:.1f} GB free ({need - free / GB:.1f} GB short)"
            )
    return "; ".join(short) or None


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def rates_line(context: dict) -> str:
    """Where the time estimates come from: the file, the machine and target it measured, any scaling."""
    path, rates = context["rates_file"], context["rates"]
    if path is None:
        return (
            "rates: none: no gpu_check result or CPU table, so no time estimate (make gpu-check, docs/gpu.md)"
        )
    r = rates.result
    machine = r.get("machine", {})
    where = (
        machine.get("gpu")
        or f"{machine.get('cpu')}, {machine.get('cores')} cores, {machine.get('torch_threads')} torch thread(s)"
    )
    line = f"rates: {_shown(path)} (measured on {where}, target {r.get('target', {}).get('name') or r.get('scale')}"
    line += ", plain decoding with CUDA graphs)" if rates.graphs else ")"
    if not rates.same_target:
        line += f"; scaled x{rates.scale:.3g} to this target by parameters"
    if path.stem.split("_", 2)[-1] != this_machine(path.stem.startswith("gpu_check")):
        line += "; another machine than this one"
    return line


def needs_table(needs: list[Need], context: dict, hand: dict) -> str:
    s, dev = context["shape"], context["device"]
    lines = [
        f"target {context['target']}: {s['family']}, {s['num_hidden_layers']} layers x hidden {s['hidden_size']}, "
        f"{context['params'] / 1e9:.2f}B parameters ({context['weights_gib']:.1f} GiB in {context['dtype']}) on {dev}; "
        f"training data: {context['data_source'] or 'store'}",
        rates_line(context),
        "",
        f"{'notebook':<9}{'memory GiB':>11}{'disk GB':>9}{'time h':>8}  {'basis':<20} what",
    ]  # fmt: skip
    for n in needs:
        time_h = f"{n.hours:.2f}" if n.hours is not None else "-"
        basis = "+".join(sorted(n.sources))
        lines.append(
            f"{n.notebook:<9}{n.memory_gib:>11.1f}{n.disk_gb + n.cache_gb:>9.1f}{time_h:>8}  {basis:<20} {n.note}"
        )
    total_h = None if any(n.hours is None for n in needs) else sum(n.hours for n in needs)
    lines.append(
        f"{'run':<9}{max(n.memory_gib for n in needs):>11.1f}{sum(n.disk_gb + n.cache_gb for n in needs):>9.1f}"
        f"{(f'{total_h:.1f}' if total_h is not None else '-'):>8}  peak memory, total disk and time"
    )
    memory = (
        "no CUDA GPU"
        if hand["memory"] is None
        else f"{hand['memory_kind']} {hand['memory'] / GIB:.1f} GiB free"
    )
    lines.append(
        f"at hand: {memory}; disk {hand['cache'][1] / GB:.1f} GB free under {hand['cache'][0]}"
        + ("" if hand["same_disk"] else f", {hand['runs'][1] / GB:.1f} GB under {hand['runs'][0]}")
    )
    return "\n".join(lines)
