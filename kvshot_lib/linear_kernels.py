"""A faster ``nn.Linear`` for the 2-8 rows of a verification block, where the CPU's BLAS is slow.

Verifying k drafted tokens runs every linear layer on a ``[k+1, in]`` input. On the AMD EPYC of the
development machine, MKL's sgemm for ``x @ W.T`` with 2-5 rows costs 1.5-2.5x the single-row gemv,
while the same product computed as ``(W @ x.T).T`` costs 0.5-0.8x of that for most of SmolLM2's weight
shapes (and more for others: down- and k/v-projections). Which kernel wins depends on the machine,
the weight shape and the row count, so :func:`small_batch_linear` measures both once per
(shape, dtype, rows) and patches each ``nn.Linear`` of a model to use the faster one. The two
differ only in floating-point summation order. CPU only; a no-op elsewhere. Patches are removed in
``finally``. Measurements (about 5 s for SmolLM2's five shapes) are cached on disk per CPU model,
torch version and thread count, under ``<cache>/linear_kernels.json``.
"""

from __future__ import annotations

import json
import platform
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

ROWS = range(2, 9)  # block sizes considered
MARGIN = 0.9  # the transposed product must be at least 10% faster to be chosen
_FAST_ROWS: dict[tuple[int, int, torch.dtype], frozenset[int]] = {}


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2]


@torch.inference_mode()
def fast_rows(weight: torch.Tensor, reps: int = 5) -> frozenset[int]:
    """The row counts for which ``(W @ x.T).T`` beats ``F.linear`` on this weight's shape (cached).

    Timed on enough distinct copies of the weight (64 MB) that, as in a real forward, they stream from
    memory rather than sit in cache."""
    key = (weight.shape[0], weight.shape[1], weight.dtype)
    disk_key = f"{_cpu_name()}|torch {torch.__version__}|{torch.get_num_threads()} threads|{key}"
    if key not in _FAST_ROWS and disk_key in _disk():
        _FAST_ROWS[key] = frozenset(_disk()[disk_key])
    if key not in _FAST_ROWS:
        g = torch.Generator().manual_seed(0)  # never touch the global RNG
        copies = max(1, -(-16_000_000 // weight.numel()))
        ws = [torch.randn(weight.shape, generator=g, dtype=weight.dtype) for _ in range(copies)]  # [out, in]
        chosen = set()
        for m in ROWS:
            x = torch.randn(m, weight.shape[1], generator=g, dtype=weight.dtype)  # [m, in]
            blas = _median_time(lambda x=x: [F.linear(x, w) for w in ws], reps)
            trans = _median_time(lambda x=x: [(w @ x.T).T.contiguous() for w in ws], reps)
            if trans < MARGIN * blas:
                chosen.add(m)
        _FAST_ROWS[key] = frozenset(chosen)
        _save_disk(disk_key, sorted(chosen))
    return _FAST_ROWS[key]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "cpu")
    except OSError:
        return platform.processor() or "cpu"


def _disk_path():
    from .assets import cache_dir

    return cache_dir() / "linear_kernels.json"


def _disk() -> dict:
    try:
        return json.loads(_disk_path().read_text())
    except (OSError, ValueError):
        return {}


def _save_disk(key: str, rows: list[int]) -> None:
    try:
        table = {**_disk(), key: rows}
        tmp = _disk_path().with_suffix(".tmp")
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(_disk_path())
    except OSError:
        pass  # a read-only cache only costs a re-measurement


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // self.in_features
    if rows in self._kvshot_fast_rows:
        y = (self.weight @ x.reshape(rows, self.in_features).T).T.contiguous()  # [rows, out]
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias
    return F.linear(x, self.weight, self.bias)


@contextmanager
def small_batch_linear(*modules: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within the block, every CPU ``nn.Linear`` of ``modules`` uses the faster kernel for 2-8 rows."""
    patched = []
    try:
        if enabled:
            for module in modules:
                for lin in module.modules() if isinstance(module, torch.nn.Module) else ():
                    plain = type(lin) is torch.nn.Linear  # not a quantized subclass
                    if plain and lin.weight.device.type == "cpu" and "forward" not in lin.__dict__:
                        rows = fast_rows(lin.weight)
                        if rows:
                            lin._kvshot_fast_rows = rows
                            lin.forward = types.MethodType(_forward, lin)
                            patched.append(lin)
        yield
    finally:
        for lin in patched:
            del lin.forward
            del lin._kvshot_fast_rows
