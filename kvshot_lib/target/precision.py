"""Precision follows the hardware: bf16 where the device computes it natively, float32 elsewhere.

``mixed_precision`` is ``"auto"`` (the default), ``"no"`` (float32), ``"bf16"`` or ``"fp16"`` (CUDA only).
:func:`resolve_precision` turns it into what runs:

* ``auto`` picks ``bf16`` on a CUDA GPU that supports it, and on a CPU whose flags include AMX-BF16 or
  AVX512-BF16 (a bf16 matmul of the draft head's shape runs 5-8x faster than float32 there); elsewhere
  ``no``. An explicit ``bf16`` on a CPU without them is refused before any work, with the fix in the
  message (bf16 would be emulated there, slower than float32).
* :func:`autocast` is the one context manager the training loop, feature extraction, held-out evaluation
  and the probes run under: parameters stay float32 (the optimizer's master copy), matmuls run in bf16.
* :func:`decode_dtype` is what decoding runs in: the whole target (weights, KV cache, logits) and the drafter
  in bf16 where the hardware has it, float32 as the exact reference (``fp32``);
* :func:`machine_record` is what every result table carries, so that a number from an AMX machine is never
  compared silently with one from a machine without: the precision, the CPU model and its bf16 ISA.

Tests simulate a CPU without bf16 by patching :func:`cpu_flags` (``tests/test_precision.py``).
"""

from __future__ import annotations

import contextlib
import functools
import platform
from pathlib import Path

import torch

PRECISIONS = ("auto", "no", "bf16", "fp16")
BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # a CPU with either computes bf16 matmuls natively
ISA_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512_fp16")


class PrecisionError(ValueError):
    """A precision this device cannot run (or an unknown one)."""


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = platform.processor() or platform.machine(), frozenset()
    path = Path("/proc/cpuinfo")
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = frozenset(value.split())
    return model, flags


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


def _device_kind(device) -> str:
    if str(device) == "auto":  # as load_target resolves it
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def resolve_precision(requested: str, device: str | torch.device = "cpu") -> str:
    """``"bf16"``, ``"fp16"`` or ``"no"``: what ``requested`` (``auto`` / ``no`` / ``bf16`` / ``fp16``) runs as
    on ``device`` (``"auto"``: CUDA when there is one, as ``load_target`` picks)."""
    kind = _device_kind(device)
    if requested not in PRECISIONS:
        raise PrecisionError(f"mixed_precision must be one of {PRECISIONS}, got {requested!r}.")
    if kind == "cuda":
        if requested == "auto":
            return "bf16" if torch.cuda.is_bf16_supported() else "no"
        return requested
    if requested == "fp16":
        raise PrecisionError(
            "mixed_precision='fp16' runs on CUDA only; on a CPU use 'bf16' (where the CPU has it) or 'no'."
        )
    if requested == "auto":
        return "bf16" if cpu_has_bf16() else "no"
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
    """The dtype a decoding run holds its target and drafter in: ``fp32`` (the exact reference), ``bf16``, or
    ``auto`` (bf16 where :func:`resolve_precision` picks it for ``device``). Unlike training, decoding casts
    the weights themselves: autocast would re-cast every weight at every forward, which costs more than a
    one-token step saves."""
    if precision not in DECODE_PRECISIONS:
        raise PrecisionError(f"decoding precision must be one of {DECODE_PRECISIONS}, got {precision!r}.")
    resolved = resolve_precision({"fp32": "no"}.get(precision, precision), device)
    return torch.bfloat16 if resolved == "bf16" else torch.float16 if resolved == "fp16" else torch.float32


def precision_label(dtype: torch.dtype) -> str:
    """``fp32`` / ``bf16`` / ``fp16``: the name a result table gives a decoding run's dtype."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def machine_record(precision: str, device: str | torch.device = "cpu") -> dict:
    """The columns every result table carries: precision, device, CPU model and its bf16 ISA."""
    kind = _device_kind(device)
    gpu = torch.cuda.get_device_name() if kind == "cuda" and torch.cuda.is_available() else ""
    return dict(
        precision={"no": "fp32"}.get(precision, precision),
        device=gpu or kind,
        cpu=cpu_model(),
        bf16_isa=bf16_isa(),
        threads=torch.get_num_threads(),
    )
