"""The tables of a speed benchmark (:mod:`.speedup`): per repetition, summarized, and where outputs diverge.

* :func:`runs_table`: one row per method, drafter, temperature, precision and repetition: tokens/s (new tokens
  over wall time, prefill included), speedup over ``ar`` of the same precision, temperature and repetition, MAT,
  the exact-match rate against that ``ar`` at temperature 0 (beside every speed, bf16's included: the share of
  greedy outputs equal to plain decoding in the same precision), what ``--precision auto`` chose with its two
  plain-step timings (:data:`AUTO_COLUMNS`, empty where auto was not asked for), and seconds per phase (prefill,
  draft, verify, commit);
* :func:`speedup_table`: the same summarized over repetitions: the median tokens/s and speedup with their
  min-max range, phases per cycle, and ``mat_for_1_5x``: the MAT that would make the method's measured cycle
  1.5x faster per token than plain decoding's measured step (decode time only);
* :func:`machine_info` / :func:`machine_name`: where the numbers were taken, saved with every table;
* :func:`cost_model_table`: the cost models the chosen shapes used, long form (one row per measured size);
* :func:`divergences`: for every greedy output that differs from plain decoding's, the first differing position
  and the top-2 logit margin of plain decoding's forward there, in the run's precision and in float32: bf16
  speculative decoding is exact up to near-ties, which this shows rather than assumes.
"""

from __future__ import annotations

import math
import os
import platform
import statistics

import pandas as pd
import torch

from ..target import bf16_tier, cpu_model
from ..target.forward import forward
from ..target.precision import PrecisionChoice, machine_label
from . import metrics
from .specpv_fidelity import first_divergence


def machine_info() -> dict:
    """Where the numbers were taken: host, CPU/GPU, threads, library versions."""
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return dict(
        host=platform.node(),
        cpu=cpu_model(),
        bf16=bf16_tier(),
        cores=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        gpu=gpu,
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
    )


def machine_name(info: dict | None = None) -> str:
    """A short file-name-safe label: the GPU, else the CPU model, core count and bf16 tier (``amd-epyc-2cores-
    nobf16``); a record written before the tier was kept (no ``bf16`` key) keeps its old label."""
    info = info or machine_info()
    return machine_label(info["gpu"], info["cpu"], info["cores"], info.get("bf16"))


SPECULATIVE = ("chain", "tree", "chain_chosen", "tree_chosen", "combined")
FIRST_COLUMNS = [
    "method",
    "drafter",
    "temperature",
    "tokens_per_s",
    "speedup_vs_ar",
    "mat",
    "exact_match_vs_ar",
]


# what "auto" chose for decoding and the plain-step ms it measured in fp32 and bf16 (target.precision)
AUTO_COLUMNS = list(PrecisionChoice("decode", "").record())


def _auto(m) -> dict:
    """``m``'s :data:`AUTO_COLUMNS`: "" and NaN where ``auto`` was not asked for."""
    return {**PrecisionChoice("decode", "").record(), **getattr(m, "auto", {})}


def _reps(m) -> list[int]:
    return m.reps if len(m.reps) == len(m.results) else [0] * len(m.results)


def _by_rep(m) -> dict[int, list]:
    out: dict[int, list] = {}
    for rep, r in zip(_reps(m), m.results):
        out.setdefault(rep, []).append(r)
    return out


def _tps(results) -> float:
    return metrics.tokens_per_second(sum(len(r.token_ids) for r in results), sum(r.total_s for r in results))


def runs_table(plan, machine: str | None = None) -> pd.DataFrame:
    """One row per method x drafter x temperature x precision x repetition (see the module docstring)."""
    ar = {(m.precision, m.cfg.temperature): _by_rep(m) for m in plan if m.method == "ar"}
    rows = []
    for m in plan:
        base = ar[m.precision, m.cfg.temperature]
        for rep, results in _by_rep(m).items():
            exact = math.nan
            if m.cfg.temperature == 0:
                exact = sum(r.token_ids == b.token_ids for r, b in zip(results, base[rep])) / max(
                    len(results), 1
                )
            cycles = [a for r in results for a in r.accepted_per_cycle]
            rows.append(
                dict(
                    method=m.method,
                    drafter=m.drafter,
                    temperature=m.cfg.temperature,
                    precision=m.precision,
                    **_auto(m),
                    rep=rep,
                    tokens_per_s=_tps(results),
                    speedup_vs_ar=metrics.speedup(_tps(results), _tps(base[rep])),
                    mat=metrics.mean_accepted_tokens(cycles) if m.method in SPECULATIVE else math.nan,
                    exact_match_vs_ar=exact,
                    shape=m.cfg.shape,
                    lookup=m.cfg.lookup,
                    n_prompts=len(results),
                    n_tokens=sum(len(r.token_ids) for r in results),
                    n_cycles=len(cycles),
                    seconds=sum(r.total_s for r in results),
                    prefill_s=sum(r.prefill_s for r in results),
                    draft_s=sum(r.draft_s for r in results),
                    verify_s=sum(r.verify_s for r in results),
                    commit_s=sum(r.commit_s for r in results),
                    machine=machine or "",
                )
            )
    return pd.DataFrame(rows)


def speedup_table(plan, machine: str | None = None) -> pd.DataFrame:
    """One row per method x drafter x temperature x precision, summarized over repetitions: medians with their
    min-max range (one repetition: the run's own numbers)."""
    machine = machine or machine_name()
    runs = runs_table(plan, machine)
    keys = ["method", "drafter", "temperature", "precision", "shape", "lookup"]
    rows = []
    ar_step = {}  # (precision, temperature) -> seconds per decoded token of plain decoding
    for (_, _, t, p, _, _), g in runs[runs["method"] == "ar"].groupby(keys, sort=False):
        decoded = (
            g["n_tokens"] - g["n_prompts"]
        ).sum()  # the first token of each prompt comes with the prefill
        ar_step[p, t] = (g["seconds"] - g["prefill_s"]).sum() / max(decoded, 1)
    for key, g in runs.groupby(keys, sort=False):
        method, drafter, t, p, shape, lookup = key
        n_cycles = g["n_cycles"].sum()
        per_cycle = {
            f"{phase}_ms_per_cycle": 1e3 * g[f"{phase}_s"].sum() / n_cycles if n_cycles else math.nan
            for phase in ("draft", "verify", "commit")
        }
        cycle_s = sum(per_cycle.values()) / 1e3 if n_cycles else math.nan
        step = ar_step.get((p, t), math.nan)
        all_cycles = [a for m in plan if _same(m, key) for r in m.results for a in r.accepted_per_cycle]
        rows.append(
            dict(
                method=method,
                drafter=drafter,
                temperature=t,
                tokens_per_s=statistics.median(g["tokens_per_s"]),
                speedup_vs_ar=statistics.median(g["speedup_vs_ar"]),
                mat=metrics.mean_accepted_tokens(all_cycles) if method in SPECULATIVE else math.nan,
                exact_match_vs_ar=g["exact_match_vs_ar"].mean(),
                precision=p,
                **{c: g[c].iloc[0] for c in AUTO_COLUMNS},
                shape=shape,
                lookup=bool(lookup),
                tokens_per_s_min=g["tokens_per_s"].min(),
                tokens_per_s_max=g["tokens_per_s"].max(),
                speedup_min=g["speedup_vs_ar"].min(),
                speedup_max=g["speedup_vs_ar"].max(),
                n_reps=len(g),
                n_prompts=int(g["n_prompts"].iloc[0]),
                n_tokens=int(g["n_tokens"].sum()),
                seconds=g["seconds"].sum(),
                prefill_s=g["prefill_s"].sum(),
                draft_s=g["draft_s"].sum(),
                verify_s=g["verify_s"].sum(),
                commit_s=g["commit_s"].sum(),
                **per_cycle,
                nodes_per_cycle=_nodes_per_cycle(plan, key),
                mat_for_1_5x=1.5 * cycle_s / step if n_cycles and step == step else math.nan,
                machine=machine,
            )
        )
    return pd.DataFrame(rows)


def _same(m, key) -> bool:
    method, drafter, t, p, shape, lookup = key
    return (m.method, m.drafter, m.cfg.temperature, m.precision, m.cfg.shape, m.cfg.lookup) == (
        method,
        drafter,
        t,
        p,
        shape,
        lookup,
    )


def _nodes_per_cycle(plan, key) -> float:
    drafted = [n for m in plan if _same(m, key) for r in m.results for n in r.drafted_per_cycle]
    return sum(drafted) / len(drafted) if drafted else math.nan


@torch.inference_mode()
def top2_logits(target, prefix: list[int]) -> tuple[float, float]:
    """Top-1 logit of ``target`` after ``prefix`` and its margin over the top-2."""
    model = target.model
    logits = (
        forward(model, torch.tensor([prefix], device=model.device), logits_to_keep=1).logits[0, -1].float()
    )
    top = logits.topk(2).values
    return float(top[0]), float(top[0] - top[1])


def bf16_spacing(x: float) -> float:
    """The gap between adjacent bf16 numbers at ``x`` (8 significant bits): 0.125 for logits in [16, 32)."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0**-133


def divergences(plan, setups, reference: str = "fp32") -> pd.DataFrame:
    """Every greedy result that differs from plain decoding's (same precision, repetition and prompt): the first
    differing position, the two tokens, and plain decoding's top-2 logit margin there in the result's precision
    (also in units of bf16's spacing at the top logit: 0 is an exact tie of bf16 logits) and in ``reference``
    (when that precision was run). Needs the prompts the methods recorded."""
    by_precision = {s.precision: s for s in setups}
    ar = {m.precision: m for m in plan if m.method == "ar" and m.cfg.temperature == 0}
    rows = []
    for m in plan:
        if m.cfg.temperature != 0 or m.method == "ar" or m.precision not in ar:
            continue
        base = ar[m.precision]
        for i, (r, b) in enumerate(zip(m.results, base.results)):
            if r.token_ids == b.token_ids:
                continue
            pos = first_divergence(r.token_ids, b.token_ids)
            prefix = base.prompts[i] + b.token_ids[:pos]
            top, margin = top2_logits(by_precision[m.precision].target, prefix)
            row = dict(
                method=m.method,
                drafter=m.drafter,
                precision=m.precision,
                shape=m.cfg.shape,
                lookup=m.cfg.lookup,
                result=i,
                position=pos,
                plain_token=b.token_ids[pos] if pos < len(b.token_ids) else -1,
                other_token=r.token_ids[pos] if pos < len(r.token_ids) else -1,
                top_logit=top,
                margin=margin,
                margin_bf16_spacings=margin / bf16_spacing(top),
                margin_reference=math.nan,
            )
            if reference in by_precision and reference != m.precision:
                row["margin_reference"] = top2_logits(by_precision[reference].target, prefix)[1]
            rows.append(row)
    columns = [
        "method",
        "drafter",
        "precision",
        "shape",
        "lookup",
        "result",
        "position",
        "plain_token",
        "other_token",
        "top_logit",
        "margin",
        "margin_bf16_spacings",
        "margin_reference",
    ]
    return pd.DataFrame(rows, columns=columns)


def cost_model_table(plan) -> pd.DataFrame:
    """The cost model of every precision in ``plan`` (the one its chosen shapes used), one row per measured
    size: ``precision, part (verify_chain | verify_tree | commit | draft_start | draft_expand), drafter, n,
    seconds, key``."""
    rows, seen = [], set()
    for m in plan:
        cost = m.cfg.speed.cost if m.cfg.speed is not None else None
        if cost is None or cost.key in seen:
            continue
        seen.add(cost.key)
        base = dict(precision=cost.precision, key=cost.key)
        for part in ("verify_chain", "verify_tree"):
            rows += [
                dict(base, part=part, drafter="-", n=k, seconds=s)
                for k, s in sorted(getattr(cost, part).items())
            ]
        rows.append(dict(base, part="commit", drafter="-", n=0, seconds=cost.commit_s))
        for name, d in cost.drafters.items():
            rows.append(dict(base, part="draft_start", drafter=name, n=1, seconds=d.start_s))
            rows += [
                dict(base, part="draft_expand", drafter=name, n=n, seconds=s)
                for n, s in sorted(d.expand_s.items())
            ]
    return pd.DataFrame(rows, columns=["precision", "part", "drafter", "n", "seconds", "key"])
