"""What a profile's run needs before it starts: memory, disk and time per notebook, and whether this machine has it.

``kvshot run --profile NAME --dry-run`` prints :func:`plan_needs` as a table (:func:`needs_table`) and refuses, in
one line, where the memory or the disk at hand is short (:func:`shortfall`); a real ``kvshot run`` refuses the same
way before any notebook starts (``--force`` runs anyway). Every figure is an estimate, and each says where it came
from:

* memory and disk from the target's architecture (:func:`~kvshot_lib.target.target_shape`: its config, no
  weights) and the profile's parameters: the weights, the KV cache of the longest context, the drafters held at
  once (float32), a feature store (``data_source: store``: bytes per token of the captured layers, the layers
  EAGLE-3 fuses) and the drafters' checkpoints (bf16) with one resumable state;
* where ``benchmarks/gpu_check.py`` has measured this GPU (``benchmarks/results/gpu_check_<gpu>.json``, else the
  newest such file, named in the output), training peaks and checkpoint sizes are its measurements, and time is
  the work divided by its rates: extraction tokens/s for target passes, training tokens/s per paradigm, plain
  decoding tokens/s for every generated token (one target forward per token: an upper bound where drafts are
  accepted). Without one, time is not estimated.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from .drafters.config import READS_KV
from .target import REPO_ROOT, cache_dir, target_shape

GIB, GB = 2**30, 1e9
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


@dataclass
class Need:
    notebook: str
    memory_gib: float
    disk_gb: float = 0.0  # checkpoints and states, under runs/
    cache_gb: float = 0.0  # the feature store, under the cache
    hours: float | None = None
    note: str = ""
    sources: set[str] = field(default_factory=set)  # "measured" / "estimate"


def _dtype_bytes(dtype: str, device: str) -> int:
    return (
        2 if dtype in ("bfloat16", "bf16", "float16", "fp16") or (dtype == "auto" and device == "cuda") else 4
    )


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


def measured(results_dir: Path = RESULTS_DIR) -> tuple[dict, Path] | tuple[None, None]:
    """The gpu_check result of this machine's GPU, else the newest at Qwen3-8B scale, else (None, None)."""
    files = [p for p in results_dir.glob("gpu_check_*.json") if not p.stem.endswith("_tiny")]
    if not files:
        return None, None
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    except (ImportError, RuntimeError):
        gpu = ""
    mine = "".join(c if c.isalnum() else "-" for c in gpu).strip("-").lower()
    path = next((p for p in files if mine and p.stem == f"gpu_check_{mine}"), None)
    path = path or max(files, key=lambda p: p.stat().st_mtime)
    return json.loads(path.read_text()), path


class Rates:
    """The rates and sizes of a gpu_check result, by what the estimates ask for."""

    def __init__(self, result: dict | None):
        self.result = result or {}
        stages = self.result.get("stages", {})
        self.train = {
            k.removeprefix("train_").removesuffix("-ttt"): v
            for k, v in stages.items()
            if k.startswith("train_") and v.get("tokens_per_s")
        }
        self.extract = stages.get("extraction", {}).get("tokens_per_s")
        self.decode = stages.get("plain_decoding", {}).get("tokens_per_s")
        self.build_gib = stages.get("build", {}).get("peak_memory_gib", 0.0)

    def train_rate(self, paradigm: str) -> float | None:
        rates = [v["tokens_per_s"] for v in self.train.values()]
        return self.train.get(paradigm, {}).get("tokens_per_s") or (min(rates) if rates else None)

    def hours(self, tokens: float, rate: float | None) -> float | None:
        return None if not rate else tokens / rate / 3600


def _tokens_per_sequence(p: dict, rates: Rates) -> float:
    """Mean tokens of a training conversation at ``max_len`` (measured where the check used that length)."""
    cap = min(p.get("max_tokens") or p["max_len"], p["max_len"])
    data = rates.result.get("data", {})
    mean = data.get("mean_tokens_per_conversation") if data.get("max_len") == p["max_len"] else None
    return min(cap, mean) if mean else cap


def _trained(full: dict) -> list[dict]:
    return list(full.get("02", {}).get("drafters") or [])


def notebook_need(number: str, p: dict, full: dict, s: dict, rates: Rates, counted: set) -> Need:
    """The need of notebook ``number`` with parameters ``p`` (every notebook's in ``full``) for a target of shape
    ``s``; ``counted`` remembers what an earlier notebook of the run already holds (the feature store)."""
    device = "cuda" if str(p.get("device")).startswith("cuda") else "cpu"
    wbytes = target_params(s) * _dtype_bytes(p.get("dtype", "auto"), device)
    need = Need(number, wbytes / GIB, sources={"estimate"})
    hours = [0.0]  # None once a part has no measured rate
    seq = _tokens_per_sequence(p, rates) if "max_len" in p else 0
    trained = _trained(full)

    def add_hours(h: float | None) -> None:
        hours[0] = None if h is None or hours[0] is None else hours[0] + h

    def train(specs: list[dict], steps: int, label: str) -> None:
        B, vocab, K = p.get("batch_size", 2), p.get("draft_vocab_size", 8192), p.get("ttt_steps", 7)
        for spec in specs:
            paradigm, layers = spec.get("paradigm"), spec.get("n_layers", 1)
            m = rates.train.get(paradigm) if layers == 1 else None
            if m and (m["batch_size"], m["max_len"], m["draft_vocab_size"]) == (
                B,
                p.get("max_tokens"),
                vocab,
            ):
                peak = (
                    m["peak_memory_gib"] - rates.build_gib + wbytes / GIB
                )  # the check's peak, the real weights
                need.sources.add("measured")
            else:  # the draft logits of every unrolled step, kept for backward, and AdamW's state
                peak = (wbytes + B * seq * vocab * 4 * K * 3 + drafter_params(s, layers) * 16) / GIB
            need.memory_gib = max(need.memory_gib, peak)
            need.disk_gb += ((m or {}).get("checkpoint_bytes") or drafter_params(s, layers) * 2) / GB
            add_hours(rates.hours(steps * B * seq, rates.train_rate(paradigm)))
        need.disk_gb += (
            max(drafter_params(s, d.get("n_layers", 1)) for d in specs) * 12 / GB
        )  # one resumable state
        need.note = f"{len(specs)} {label} x {steps} steps x {B} x ~{seq:.0f} tokens"

    def decode(tokens: float, context: int, drafters: int, what: str) -> None:
        held = kv_bytes(s, context, 2 if device == "cuda" else 4) + drafters * drafter_params(s) * 4
        need.memory_gib += held / GIB
        add_hours(rates.hours(tokens, rates.decode))
        need.note = f"{what}: ~{tokens:,.0f} generated tokens"

    if number in ("00", "02", "05") and p.get("data_source", "store") == "store" and "store" not in counted:
        counted.add("store")
        n_conv = p["n_train_conversations"] + p["n_eval_conversations"]
        bpt = rates.result.get("stages", {}).get("extraction", {}).get("bytes_per_token")
        need.cache_gb += n_conv * seq * (bpt or store_bytes_per_token(s)) / GB
        add_hours(rates.hours(n_conv * seq, rates.extract))
        need.note = f"feature store: {n_conv} conversations x ~{seq:.0f} tokens"
    if number == "00" and not need.note:
        need.note = "tokenizing" + ("; no feature store (online)" if p.get("data_source") == "online" else "")
    elif number == "01":
        tokens = (p["n_train_docs"] + p["n_test_docs"]) * p["probe_max_len"]
        need.memory_gib += kv_bytes(s, p["probe_max_len"], 2) / GIB
        add_hours(rates.hours(tokens * len(p.get("seeds", [0])), rates.extract))
        need.note = f"target passes over {tokens:,} tokens (the probes' own training not counted)"
    elif number == "02":
        curve = 1 + p.get("decay_fraction", 0.1) if p.get("curve_points") else 1.0
        train(p["drafters"], round(p["train_steps"] * curve), "drafters")
    elif number == "05":
        runs = [p["remedy_drafter"]] * len(p["remedies"]) * len(p["remedy_seeds"])
        train(runs, p["remedy_train_steps"], "remedy runs")
    elif number == "03":
        drafters = len(p["baseline_drafters"]) + len(trained)
        greedy = p["n_questions"] * 2 * p["max_new_tokens"] * (1 + drafters * len(p["modes"]))
        sampled = sum(t > 0 for t in p["temperatures"]) * p["n_questions_sampled"] * 2 * p["max_new_tokens"]
        decode(
            greedy + sampled * drafters * len(p["modes"]),
            1024 + p["max_new_tokens"],
            len(trained),
            "MT-bench",
        )
    elif number == "04":
        readers = sum(d.get("paradigm") in READS_KV for d in trained)
        tokens = p["n_questions"] * 2 * p["max_new_tokens"] * max(1, readers) * (1 + len(p["lambdas"]))
        decode(tokens, 1024 + p["max_new_tokens"], readers, "MT-bench, KV-reading drafters")
    elif number == "06":
        n_drafters = len(p["baseline_drafters"]) + len(p["trained_drafters"] or trained)
        runs = len(p["methods"]) * n_drafters * len(p["precisions"]) * len(p["temperatures"]) * p["repeats"]
        tokens = runs * p["n_questions"] * p["turns"] * p["max_new_tokens"]
        decode(tokens, 1024 + p["max_new_tokens"], n_drafters, "MT-bench speed table")
    elif number == "07":
        grid = len(p["budgets"]) * len(p["full_everys"]) * len(p["fidelity_variants"])
        speed = len(p["speed_budgets"]) * len(p["speed_full_everys"]) * len(p["speed_variants"])
        per_context = p["n_fidelity_prompts"] * (1 + grid) * p["fidelity_max_new_tokens"]
        per_context += (
            (1 + p["max_trained_drafters"]) * p["n_speed_prompts"] * (1 + speed) * p["max_new_tokens"]
        )
        decode(len(p["contexts"]) * per_context, max(p["contexts"]) + p["max_new_tokens"], 2, "long contexts")
        prompts = max(p["n_fidelity_prompts"], p["n_speed_prompts"])
        add_hours(rates.hours(sum(p["contexts"]) * prompts, rates.extract))
    need.hours = hours[0] if rates.result else None
    return need


def plan_needs(
    full: dict[str, dict], selected: list[str], results_dir: Path | None = None
) -> tuple[list[Need], dict]:
    """One :class:`Need` per notebook in ``selected``; ``full`` holds every notebook's parameters (the profile's over
    the notebook's defaults). Returns them with the context: the target's shape and where the rates came from."""
    target = next(iter(full.values())).get("target", "")
    s = target_shape(target)
    if s is None:
        raise ValueError(
            f"the architecture of target {target!r} cannot be read without loading it: pass a local folder "
            "(--set target=/path/to/model) or a preset."
        )
    result, path = measured(results_dir or RESULTS_DIR)
    rates, counted = Rates(result), set()
    needs = [notebook_need(n, full[n], full, s, rates, counted) for n in sorted(full) if n in selected]
    first = full[selected[0]] if selected else {}
    device = str(first.get("device", "auto"))
    context = dict(
        target=target,
        shape=s,
        params=target_params(s),
        weights_gib=target_params(s) * _dtype_bytes(first.get("dtype", "auto"), device) / GIB,
        dtype=first.get("dtype", "auto"),
        device=device,
        data_source=next((full[n]["data_source"] for n in sorted(full) if "data_source" in full[n]), None),
        rates_file=path,
        rates_gpu=(result or {}).get("machine", {}).get("gpu"),
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


def needs_table(needs: list[Need], context: dict, hand: dict) -> str:
    s, dev = context["shape"], context["device"]
    lines = [
        f"target {context['target']}: {s['family']}, {s['num_hidden_layers']} layers x hidden {s['hidden_size']}, "
        f"{context['params'] / 1e9:.2f}B parameters ({context['weights_gib']:.1f} GiB in {context['dtype']}) on {dev}; "
        f"training data: {context['data_source'] or 'store'}",
        f"rates: {_shown(context['rates_file']) if context['rates_file'] else 'none'}"
        + (f" (measured by gpu_check on {context['rates_gpu']})" if context["rates_file"] else
           ": no gpu_check result, so no time estimate (make gpu-check on the GPU, docs/gpu.md)"),
        "",
        f"{'notebook':<9}{'memory GiB':>11}{'disk GB':>9}{'time h':>8}  {'basis':<20} what",
    ]  # fmt: skip
    for n in needs:
        time_h = f"{n.hours:.1f}" if n.hours is not None else "-"
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
