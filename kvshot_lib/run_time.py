"""How long a profile's run takes, notebook by notebook: the rates it is costed at and the work each notebook does.

The dry run (:mod:`kvshot_lib.needs`, which adds memory and disk and prints the table) asks
:func:`notebook_seconds` for each notebook's time. Time is the work divided by rates measured on one machine for
one target (:class:`Rates`): on a CUDA run ``benchmarks/gpu_check.py``'s result
(``benchmarks/results/gpu_check_<gpu>.json``, else the newest), on a CPU run the CPU table
(``cpu_rates_<cpu>.json``, else the newest), derived from committed CPU measurements, each stage naming its source
(:func:`measured` finds the file). Rates of another architecture are scaled by the ratio of parameters
(:func:`target_params`), and the table says so. The work is counted as each notebook does it: target passes at the
forward rate; training at each paradigm's measured rate (:func:`training_seconds`); plain decoding at the
plain-decoding rate (the CUDA-graph path's ``graphs_tokens_per_s`` where the check has it); speculative decoding
as tokens / MAT cycles, each one verification forward of its width (the measured c_v(k) / c_v(1)) and the
drafter's steps (:func:`speculative_seconds`); and the greedy replay of notebooks 03 and 04
(``evaluation.acceptance.replay_greedy``) as one plain decoding of each reference, one forward over it, and only
the drafter's calls per cycle for each drafter (:func:`acceptance_seconds`, :func:`query_error_seconds`). MATs are
assumed (:data:`ASSUMED_MAT`). ``benchmarks/results/dry_run_check_*.csv`` holds the check against ``make demo``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .drafters.config import READS_KV
from .target import REPO_ROOT

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


def target_params(s: dict) -> int:
    """Parameters of a Llama/Qwen3 model of shape ``s`` (embedding, layers, final norm, untied LM head)."""
    H, D, F = s["hidden_size"], s["head_dim"], s["intermediate_size"]
    layer = (
        H * (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * D + s["num_attention_heads"] * D * H
    )
    layer += 3 * H * F + 2 * H + 2 * D
    head = 0 if s["tie_word_embeddings"] else s["vocab_size"] * H
    return s["vocab_size"] * H + s["num_hidden_layers"] * layer + H + head


def this_machine(cuda: bool) -> str:
    """This machine's label in rates file names (``target.precision.machine_label``: the GPU's name, else the CPU's,
    its cores and bf16 tier)."""
    import torch

    from .target.precision import bf16_tier, cpu_model, machine_label

    gpu = torch.cuda.get_device_name(0) if cuda and torch.cuda.is_available() else None
    return machine_label(gpu, cpu_model(), os.cpu_count(), bf16_tier())


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


def tokens_per_sequence(p: dict, rates: Rates) -> float:
    """Mean tokens of a training conversation at ``max_len`` (measured where the rates hold that length)."""
    cap = min(p.get("max_tokens") or p["max_len"], p["max_len"])
    data = rates.result.get("data", {})
    mean = data.get("mean_tokens_per_conversation") if data.get("max_len") == p["max_len"] else None
    return min(cap, mean) if mean else cap


def trained_specs(full: dict) -> list[dict]:
    """Notebook 02's drafter specs (its ``drafters`` parameter): the drafters the run trains."""
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
    specs = [(_name(d), d.get("paradigm"), d.get("n_layers", 1)) for d in trained_specs(full)]
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
    readers, concat = kv_readers(trained_specs(full))
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
        work = training_seconds(trained_specs(full), steps, p, seq, rates, evals)
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
