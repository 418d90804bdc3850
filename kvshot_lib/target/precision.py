"""Precision by measurement: bf16 where this machine computes it natively *and* runs it faster, float32 elsewhere.

``mixed_precision`` is ``"auto"`` (the default), ``"no"`` (float32), ``"bf16"`` or ``"fp16"`` (CUDA only).
:func:`resolve_precision` turns it into what runs:

* ``auto`` is ``no`` where the device has no native bf16 (a CPU whose flags list neither AMX-BF16 nor
  AVX512-BF16, a CUDA GPU without it), decided without timing anything. Elsewhere the flags do not decide: a
  short probe (:func:`train_probe_s`, a few forward+backward steps of a drafter-sized layer under autocast,
  a few seconds per precision, cached per machine in ``<cache>/precision_probes.json``) times both, and bf16
  is taken only where it is at least :data:`BF16_MIN_GAIN` faster. The flags alone chose wrong: on a 2-core
  Intel Xeon with AVX512-BF16 and no AMX, bf16 plain decoding ran at 25.4 tok/s against float32's 26.0, while
  an AMD EPYC with the same flag ran it 1.31x faster. An explicit ``bf16`` on a CPU without native bf16 is
  refused before any work, with the fix in the message (it would be emulated, slower than float32).
* :func:`autocast` is the one context manager the training loop, feature extraction, held-out evaluation
  and the probes run under: parameters stay float32 (the optimizer's master copy), matmuls run in bf16.
* :func:`decode_dtype` is what decoding runs in: the whole target (weights, KV cache, logits) and the drafter
  in ``bf16`` or in float32 (``fp32``), the lossless reference: greedy speculative decoding in fp32 equals plain
  decoding token for token, in bf16 only up to near-ties. ``auto`` takes the precision whose plain decoding step the caller measures faster
  (``decoding.cost_model.decode_precision`` times it through the cached cost model).
* Every ``auto`` choice is a :class:`PrecisionChoice`, printed once per process (on stderr) with both timings;
  its :meth:`~PrecisionChoice.record` goes into the result tables beside the precision.
* :func:`machine_record` is what every result table carries, so that a number from an AMX machine is never
  compared silently with one from a machine without: the precision, the CPU model and its bf16 ISA.

Tests simulate a CPU without bf16 by patching :func:`cpu_flags`, and a faster or slower bf16 by writing the
cached timings (``tests/test_precision.py``, ``tests/test_precision_choice.py``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .disk_cache import read_table, save_entry

PRECISIONS = ("auto", "no", "bf16", "fp16")
BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # a CPU with either computes bf16 matmuls natively
ISA_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512_fp16")


class PrecisionError(ValueError):
    """A precision this device cannot run (or an unknown one)."""


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    text = Path("/proc/cpuinfo").read_text(errors="replace") if Path("/proc/cpuinfo").is_file() else ""
    return cpu_name(text, platform.processor() or platform.machine()), cpu_flags_of(text)


def _first(text: str, key: str) -> str | None:
    """The first value of ``key`` in a ``/proc/cpuinfo`` text."""
    for line in text.splitlines():
        k, _, value = line.partition(":")
        if k.strip() == key:
            return value.strip()
    return None


def cpu_flags_of(text: str) -> frozenset[str]:
    return frozenset((_first(text, "flags") or "").split())


def cpu_name(text: str, fallback: str = "") -> str:
    """The CPU's model name in a ``/proc/cpuinfo`` text. A name a hypervisor masked to one without a model number
    (``AMD EPYC``: a Zen 4 and a Zen 5 both read so on the machines here) gets its family and model
    (``AMD EPYC family 26 model 2``), so that their results are not filed as one machine's."""
    name = _first(text, "model name") or fallback
    family, model = _first(text, "cpu family"), _first(text, "model")
    if not any(c.isdigit() for c in name) and family and model:
        name = f"{name} family {family} model {model}"
    return name


def cpu_model() -> str:
    return _cpuinfo()[0]


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty where the OS does not list them)."""
    return _cpuinfo()[1]


def bf16_isa() -> str:
    """The CPU's bf16/fp16 instruction sets, e.g. ``"amx_bf16 amx_tile avx512_bf16 avx512_fp16"``, or ``"none"``."""
    have = [f for f in ISA_FLAGS if f in cpu_flags()]
    return " ".join(have) or "none"


def cpu_has_bf16() -> bool:
    return any(f in cpu_flags() for f in BF16_FLAGS)


def bf16_tier() -> str:
    """The CPU's fastest bf16 path in one word: ``"amx"``, ``"avx512bf16"`` or ``"nobf16"``. File names and
    machine labels carry it: two CPUs of one model name (an AMD EPYC with AVX512-BF16 and one with AVX2 only)
    differ 4-5x in training throughput, and their results must not overwrite or stand in for each other."""
    flags = cpu_flags()
    return "amx" if "amx_bf16" in flags else "avx512bf16" if "avx512_bf16" in flags else "nobf16"


def machine_label(gpu: str | None, cpu: str, cores: int | None, tier: str | None) -> str:
    """A file-name-safe label of a machine: the GPU, else the CPU model, core count and bf16 tier
    (``amd-epyc-2cores-avx512bf16``; no tier: a record written before the tier was kept). The one rule that
    benchmark results, speed tables and the dry run's rates are named by."""
    label = gpu or f"{cpu}-{cores}cores" + (f"-{tier}" if tier else "")
    return "".join(c if c.isalnum() else "-" for c in label).strip("-").lower()


def _device_kind(device) -> str:
    if str(device) == "auto":  # as load_target resolves it
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def bf16_supported(device: str | torch.device = "cpu") -> bool:
    """Whether ``device`` computes bf16 natively: a CUDA GPU that says so, a CPU with AMX-BF16 or AVX512-BF16."""
    if _device_kind(device) == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return cpu_has_bf16()


def machine_key(device: str | torch.device = "cpu", threads: bool = True) -> str:
    """What a timing depends on: the CPU model and its bf16 tier (or the GPU), torch's version and (``threads``)
    its thread count."""
    if _device_kind(device) == "cuda":
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda"
    else:
        name = f"{cpu_model()}|{bf16_tier()}"
    return f"{name}|torch {torch.__version__}" + (f"|{torch.get_num_threads()} threads" if threads else "")


# ------------------------------------------------------------------------------------ choosing by measurement

# bf16 must measure at least this much faster: fp32 is exact, and a few percent is noise on a shared CPU
BF16_MIN_GAIN = 1.05
TIMED = {"decode": "plain_step", "train": "train_probe"}  # purpose -> what its timing columns are called
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class PrecisionChoice:
    """What ``auto`` picked for ``purpose`` on this machine and the seconds it measured in each precision (NaN
    where nothing was timed: no native bf16, or nothing given to time)."""

    purpose: str  # "decode" | "train"
    precision: str  # "fp32" | "bf16" ("" in the record of a run that did not ask for auto)
    fp32_s: float = math.nan
    bf16_s: float = math.nan
    basis: str = ""  # what was timed, or why nothing was

    def line(self) -> str:
        """The line printed once per process, e.g. ``kvshot: precision auto for decoding: bf16 (...: fp32 38.10 ms,
        bf16 29.02 ms, bf16 1.31x as fast)``."""
        head = f"kvshot: precision auto for {'decoding' if self.purpose == 'decode' else 'training'}: {self.precision}"
        if math.isnan(self.fp32_s):
            return f"{head} ({self.basis})"
        return (
            f"{head} ({self.basis}: fp32 {1e3 * self.fp32_s:.2f} ms, bf16 {1e3 * self.bf16_s:.2f} ms, "
            f"bf16 {self.fp32_s / self.bf16_s:.2f}x as fast; bf16 needs {BF16_MIN_GAIN:.2f}x)"
        )

    def record(self) -> dict:
        """The columns a result table carries beside its precision: ``auto_precision`` and both timings in ms,
        e.g. ``plain_step_ms_fp32`` / ``plain_step_ms_bf16`` (decoding), ``train_probe_ms_*`` (training)."""
        name = TIMED[self.purpose]
        return {
            "auto_precision": self.precision,
            f"{name}_ms_fp32": 1e3 * self.fp32_s,
            f"{name}_ms_bf16": 1e3 * self.bf16_s,
        }


_CHOSEN: dict[tuple, PrecisionChoice] = {}  # (purpose, basis, machine) -> the choice this process made


def choose_precision(
    purpose: str, device, measure: Callable[[str], float] | None, basis: str
) -> PrecisionChoice:
    """``fp32`` where ``device`` has no native bf16 (``measure`` is not called), else the faster of
    ``measure("fp32")`` and ``measure("bf16")`` (seconds; bf16 only if :data:`BF16_MIN_GAIN` faster); ``fp32``
    when there is nothing to measure (``measure=None``). Made and printed once per process for each
    (purpose, basis, machine); ``basis`` names what ``measure`` times."""
    native = bf16_supported(device)
    key = (purpose, basis if native else "", machine_key(device, threads=False))  # no bf16: one line
    if key not in _CHOSEN:
        if not native:
            name = "this GPU" if _device_kind(device) == "cuda" else f"this CPU ({cpu_model()})"
            choice = PrecisionChoice(purpose, "fp32", basis=f"{name} has no native bf16: nothing timed")
        elif measure is None:
            choice = PrecisionChoice(
                purpose, "fp32", basis="nothing timed here, so fp32, the exact reference"
            )
        else:
            fp32_s, bf16_s = measure("fp32"), measure("bf16")
            faster = bf16_s * BF16_MIN_GAIN <= fp32_s
            choice = PrecisionChoice(purpose, "bf16" if faster else "fp32", fp32_s, bf16_s, basis)
        _CHOSEN[key] = choice
        print(choice.line(), file=sys.stderr, flush=True)
    return _CHOSEN[key]


# the training probe: one layer of a drafter of SmolLM2-135M (fc over 3 captured layers, attention, MLP, a head
# over the draft vocab) on a batch of tokens, forward and backward under autocast, as the training loop runs it
PROBE_FORMAT = "train-probe/1"
PROBE_TOKENS, PROBE_HIDDEN, PROBE_HEADS, PROBE_FFN, PROBE_VOCAB = 128, 576, 9, 1536, 8192
PROBE_STEPS = 3  # timed, after one warm-up; the fastest counts
PROBE_BASIS = (
    f"one forward+backward step of a drafter-sized layer ({PROBE_TOKENS} tokens, hidden {PROBE_HIDDEN}, "
    f"draft vocab {PROBE_VOCAB}) under autocast, fastest of {PROBE_STEPS}"
)


def _clock(device) -> float:
    if _device_kind(device) == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def time_train_probe(precision: str, device: str | torch.device = "cpu") -> float:
    """Seconds of one step of the training probe in ``precision`` (``fp32`` / ``bf16``), uncached: one warm-up and
    :data:`PROBE_STEPS` timed steps (about 1 s a step on a 2-core AMD EPYC shared with other work)."""
    dev = torch.device("cuda" if _device_kind(device) == "cuda" else "cpu")
    g = torch.Generator().manual_seed(0)
    T, H, nh, V = PROBE_TOKENS, PROBE_HIDDEN, PROBE_HEADS, PROBE_VOCAB

    def weight(n_in, n_out):
        return (torch.randn(n_out, n_in, generator=g) / n_in**0.5).to(dev).requires_grad_()

    w = dict(fc=weight(3 * H, H), q=weight(H, H), k=weight(H, H), v=weight(H, H), o=weight(H, H))
    w.update(gate=weight(H, PROBE_FFN), up=weight(H, PROBE_FFN), down=weight(PROBE_FFN, H), head=weight(H, V))
    x = torch.randn(1, T, 3 * H, generator=g).to(dev)  # [1, T, 3H]: three captured target layers
    labels = torch.randint(0, V, (T,), generator=g).to(dev)  # [T]
    times = []
    for _ in range(PROBE_STEPS + 1):
        t0 = _clock(dev)
        with autocast({"fp32": "no"}.get(precision, precision), dev):
            h = F.linear(x, w["fc"])  # [1, T, H]
            q, k, v = (
                F.linear(h, w[n]).view(1, T, nh, H // nh).transpose(1, 2) for n in "qkv"
            )  # [1, nh, T, hd]
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [1, nh, T, hd]
            h = h + F.linear(a.transpose(1, 2).reshape(1, T, H), w["o"])  # [1, T, H]
            h = h + F.linear(F.silu(F.linear(h, w["gate"])) * F.linear(h, w["up"]), w["down"])  # [1, T, H]
            logits = F.linear(h, w["head"])  # [1, T, V]
            loss = F.cross_entropy(logits.float().view(T, V), labels)
        loss.backward()
        for p in w.values():
            p.grad = None
        times.append(_clock(dev) - t0)
    return min(times[1:])


def train_probe_key(precision: str, device: str | torch.device = "cpu") -> str:
    """One probe per machine, whatever the thread count: every process on it (a test and the notebook it runs,
    at other thread counts) trains in the same precision."""
    return f"{PROBE_FORMAT}|{machine_key(device, threads=False)}|{precision}"


PROBES = "precision_probes.json"


def train_probe_s(precision: str, device: str | torch.device = "cpu") -> float:
    """:func:`time_train_probe`, measured once per machine and saved in ``<cache>/precision_probes.json``."""
    key = train_probe_key(precision, device)
    cached = read_table(PROBES).get(key)
    if cached is not None:
        return float(cached)
    seconds = time_train_probe(precision, device)
    save_entry(PROBES, key, seconds)
    return seconds


def training_choice(device: str | torch.device = "cpu") -> PrecisionChoice:
    """What ``mixed_precision: auto`` trains in on ``device``: the faster precision of the training probe."""
    return choose_precision("train", device, lambda p: train_probe_s(p, device), PROBE_BASIS)


def decode_choice(
    device: str | torch.device = "cpu", plain_step: Callable[[str], float] | None = None, basis: str = ""
) -> PrecisionChoice:
    """What ``--precision auto`` decodes in on ``device``: the precision whose plain decoding step
    ``plain_step(precision)`` (seconds) is faster; fp32 without it. ``decoding.cost_model.decode_precision``
    passes the step of its cached cost model."""
    return choose_precision("decode", device, plain_step, basis)


# ----------------------------------------------------------------------------------------- resolving requests


def resolve_precision(requested: str, device: str | torch.device = "cpu") -> str:
    """``"bf16"``, ``"fp16"`` or ``"no"``: what ``requested`` (``auto`` / ``no`` / ``bf16`` / ``fp16``) runs as
    on ``device`` (``"auto"``: CUDA when there is one, as ``load_target`` picks). ``auto`` is measured
    (:func:`training_choice`)."""
    kind = _device_kind(device)
    if requested not in PRECISIONS:
        raise PrecisionError(f"mixed_precision must be one of {PRECISIONS}, got {requested!r}.")
    if requested == "auto":
        return {"fp32": "no"}.get(training_choice(device).precision, "bf16")
    if kind == "cuda":
        return requested
    if requested == "fp16":
        raise PrecisionError(
            "mixed_precision='fp16' runs on CUDA only; on a CPU use 'bf16' (where the CPU has it) or 'no'."
        )
    if requested == "bf16" and not cpu_has_bf16():
        raise PrecisionError(
            f"mixed_precision='bf16' asked for, but this CPU ({cpu_model()}) has neither AMX-BF16 nor "
            "AVX512-BF16, so bf16 would be emulated and slower than float32: use mixed_precision='auto' or 'no'."
        )
    return requested


def autocast_dtype(precision: str) -> torch.dtype | None:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def autocast(precision: str, device: str | torch.device = "cpu"):
    """Autocast to the resolved ``precision``'s dtype on ``device`` (a no-op for ``"no"``)."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(_device_kind(device), dtype=dtype)


DECODE_PRECISIONS = ("auto", "fp32", "bf16")


def decode_dtype(precision: str, device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype a decoding run holds its target and drafter in: ``fp32`` (the exact reference), ``bf16`` (refused
    where the device has no native bf16), or ``auto``: here, with no target to time, fp32 (printed once);
    ``decoding.cost_model.decode_precision(target, "auto")`` measures. Unlike training, decoding casts the
    weights themselves: autocast would re-cast every weight at every forward, which costs more than a
    one-token step saves."""
    if precision not in DECODE_PRECISIONS:
        raise PrecisionError(f"decoding precision must be one of {DECODE_PRECISIONS}, got {precision!r}.")
    if precision == "auto":
        return DTYPES[decode_choice(device).precision]
    resolved = resolve_precision({"fp32": "no"}.get(precision, precision), device)
    return torch.bfloat16 if resolved == "bf16" else torch.float16 if resolved == "fp16" else torch.float32


def precision_label(dtype: torch.dtype) -> str:
    """``fp32`` / ``bf16`` / ``fp16``: the name a result table gives a decoding run's dtype."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def machine_record(precision: str, device: str | torch.device = "cpu", requested: str | None = None) -> dict:
    """The columns every result table carries: precision, device, CPU model and its bf16 ISA; where the precision
    was ``requested`` as ``auto``, also what auto measured (:meth:`PrecisionChoice.record` of the training probe)."""
    kind = _device_kind(device)
    gpu = torch.cuda.get_device_name() if kind == "cuda" and torch.cuda.is_available() else ""
    record = dict(
        precision={"no": "fp32"}.get(precision, precision),
        device=gpu or kind,
        cpu=cpu_model(),
        bf16_isa=bf16_isa(),
        threads=torch.get_num_threads(),
    )
    if requested == "auto":
        record.update(training_choice(device).record())
    return record
