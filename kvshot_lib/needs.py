"""What a profile's run needs before it starts: memory, disk and time per notebook, and whether this machine has it.

``kvshot run --profile NAME --dry-run`` prints :func:`plan_needs` as a table (:func:`needs_table`) and refuses, in
one line, where the memory or the disk at hand is short (:func:`shortfall`); a real ``kvshot run`` refuses the same
way before any notebook starts (``--force`` runs anyway). Every figure is an estimate, and each says where it came
from:

* memory and disk from the target's architecture (:func:`~kvshot_lib.target.target_shape`: its config, no
  weights) and the profile's parameters: the weights, the KV cache of the longest context, the drafters held at
  once (float32), a feature store (``data_source: store``: the target's own bytes per token of the captured
  layers) and the drafters' checkpoints (bf16) with one resumable state;
* time from :mod:`kvshot_lib.run_time`: the work each notebook does (:func:`~kvshot_lib.run_time.notebook_seconds`)
  divided by rates measured on one machine for one target (:class:`~kvshot_lib.run_time.Rates`: a
  ``benchmarks/gpu_check.py`` result on a CUDA run, a CPU table on a CPU run), scaled by parameters to another
  architecture; the table's rates line (:func:`rates_line`) names the file and any scaling.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from .run_time import (
    RESULTS_DIR,
    Rates,
    drafters_of,
    kv_readers,
    measured,
    notebook_seconds,
    target_params,
    this_machine,
    tokens_per_sequence,
    trained_specs,
)
from .target import REPO_ROOT, cache_dir, repo_relative, target_shape

GIB, GB = 2**30, 1e9


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


def notebook_need(number: str, p: dict, full: dict, s: dict, rates: Rates, counted: set, cuda: bool) -> Need:
    """The need of notebook ``number`` with parameters ``p`` (every notebook's in ``full``) for a target of shape
    ``s``; ``counted`` remembers what an earlier notebook of the run already holds (the feature store)."""
    wbytes = target_params(s) * _dtype_bytes(p.get("dtype", "auto"), cuda)
    need = Need(number, wbytes / GIB, sources={"estimate"})
    seq = tokens_per_sequence(p, rates) if "max_len" in p else 0
    trained = trained_specs(full)

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
    line = f"rates: {repo_relative(path)} (measured on {where}, target {r.get('target', {}).get('name') or r.get('scale')}"
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
