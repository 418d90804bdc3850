"""A faster ``nn.Linear`` for the 1-8 rows of a decoding step or a verification block, where the CPU's BLAS is slow.

Verifying k drafted tokens runs every linear layer on a ``[k+1, in]`` input. On the AMD EPYC of the
development machine (one thread), MKL's sgemm for ``x @ W.T`` with 2-5 rows costs 1.4-3.4x the
single-row gemv; the same product computed as ``(W @ x.T).T`` costs 1.1-1.6x for most of SmolLM2's
weight shapes, and some row counts are cheaper than smaller ones (4 rows beat 3). Which way wins
depends on the machine, the weight shape and the row count, so :func:`linear_plan` times both
kernels once per (shape, dtype) for 1-8 rows and picks, for each row count, the fastest
(kernel, padded row count) pair: e.g. 3 rows may run as 4 with a zero row. Plain decoding runs its single row
through the same plan as verification runs its blocks, so the baseline of every speedup gets the same kernels.
Float32 weights only: on the development CPU the bf16 plans (oneDNN) measured on a shared machine made plain
bf16 decoding ~10% slower than ``F.linear`` and Hugging Face's ``generate``, so bf16 keeps ``F.linear``. :func:`small_batch_linear`
patches each ``nn.Linear`` of a model to follow that plan. Results differ from ``F.linear`` only in
floating-point summation order. CPU only; a no-op elsewhere. Patches are removed in ``finally``.
Plans (about 5 s to measure for SmolLM2's five shapes) are cached on disk per CPU model, torch
version and thread count, under ``<cache>/linear_kernels.json``.
"""

from __future__ import annotations

import time
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ..target.disk_cache import read_table, save_entry
from ..target.precision import cpu_model

MAX_ROWS = 8  # block sizes considered
MARGIN = 0.9  # another choice must be at least 10% faster than F.linear to be taken
Plan = dict[int, tuple[int, bool]]  # rows -> (padded rows, use the transposed product)
_PLANS: dict[tuple[int, int, torch.dtype], Plan] = {}


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2]


@torch.inference_mode()
def linear_plan(weight: torch.Tensor, reps: int = 5) -> Plan:
    """For each row count 1..8 where it pays: (rows to pad to, transposed product?) for this weight's shape.

    Timed on enough distinct copies of the weight (64 MB) that, as in a real forward, they stream from
    memory rather than sit in cache."""
    key = (weight.shape[0], weight.shape[1], weight.dtype)
    disk_key = f"{cpu_model()}|torch {torch.__version__}|{torch.get_num_threads()} threads|rows 1-8|{key}"
    cached = read_table(KERNELS).get(disk_key)
    if key not in _PLANS and isinstance(cached, dict):
        _PLANS[key] = {int(m): (int(p), bool(t)) for m, (p, t) in cached.items()}
    if key not in _PLANS:
        g = torch.Generator().manual_seed(0)  # never touch the global RNG
        copies = max(1, -(-16_000_000 // weight.numel()))
        ws = [torch.randn(weight.shape, generator=g, dtype=weight.dtype) for _ in range(copies)]  # [out, in]
        times = {}  # (rows, transposed) -> seconds
        for m in range(1, MAX_ROWS + 1):
            x = torch.randn(m, weight.shape[1], generator=g, dtype=weight.dtype)  # [m, in]
            times[m, False] = _median_time(lambda x=x: [F.linear(x, w) for w in ws], reps)
            times[m, True] = _median_time(lambda x=x: [(w @ x.T).T.contiguous() for w in ws], reps)
        plan = {}
        for m in range(1, MAX_ROWS + 1):
            best = min(((p, t) for p in range(m, MAX_ROWS + 1) for t in (False, True)), key=times.get)
            if best != (m, False) and times[best] < MARGIN * times[m, False]:
                plan[m] = best
        _PLANS[key] = plan
        save_entry(KERNELS, disk_key, {str(m): list(v) for m, v in plan.items()})
    return _PLANS[key]


KERNELS = "linear_kernels.json"


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // self.in_features
    if rows not in self._kvshot_plan:
        return F.linear(x, self.weight, self.bias)
    padded, transposed = self._kvshot_plan[rows]
    x2 = x.reshape(rows, self.in_features)  # [rows, in]
    if padded > rows:
        x2 = torch.cat([x2, x2.new_zeros(padded - rows, self.in_features)])  # [padded, in]
    y = (self.weight @ x2.T).T if transposed else F.linear(x2, self.weight)  # [padded, out]
    y = y[:rows].contiguous().reshape(*x.shape[:-1], self.out_features)
    return y if self.bias is None else y + self.bias


@contextmanager
def small_batch_linear(*modules: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within the block, every float32 CPU ``nn.Linear`` of ``modules`` uses the faster kernel for 1-8 rows."""
    patched = []
    try:
        if enabled:
            for module in modules:
                for lin in module.modules() if isinstance(module, torch.nn.Module) else ():
                    plain = type(lin) is torch.nn.Linear  # not a quantized subclass
                    fp32 = plain and lin.weight.dtype == torch.float32  # bf16: F.linear (module docstring)
                    if fp32 and lin.weight.device.type == "cpu" and "forward" not in lin.__dict__:
                        plan = linear_plan(lin.weight)
                        if plan:
                            lin._kvshot_plan = plan
                            lin.forward = types.MethodType(_forward, lin)
                            patched.append(lin)
        yield
    finally:
        for lin in patched:
            del lin.forward
            del lin._kvshot_plan
