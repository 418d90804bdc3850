"""Where the numbers were taken and what each stage cost: the machine and versions, and :func:`stage`, which records
a stage's seconds and peak memory (or its error) and writes the result after it."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
from contextlib import contextmanager

import torch

from kvshot_lib.target import bf16_tier, cpu_model, machine_label


def preflight() -> dict:
    """Versions, and a refusal before any work where transformers is not 5.x (the per-layer cache API the suite
    reads). A 5.x older than the suite's floor (pyproject.toml) runs: target/forward.py passes its cache as
    ``past_key_values=``; the check records the versions it ran on."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__).major < 5:
        raise SystemExit(
            f"gpu_check: transformers {transformers.__version__} is older than 5.0 (the per-layer KV cache the "
            "suite reads); this machine cannot run the check."
        )
    return dict(torch=torch.__version__, transformers=transformers.__version__, python=sys.version.split()[0])


def machine() -> dict:
    """Where the numbers were taken, and its file-name label (``target.machine_label``: the GPU, else the CPU, its
    cores and bf16 tier)."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    cpu, cores = cpu_model(), os.cpu_count()
    name = machine_label(gpu, cpu, cores, bf16_tier())
    return dict(gpu=gpu, cpu=cpu, cores=cores, torch_threads=torch.get_num_threads(), name=name)


def sync(device: str) -> None:
    """Wait for the GPU's queued work (nothing on a CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_memory_gib(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


@contextmanager
def stage(stages: dict, name: str, device: str, save=None):
    """One measurement: its seconds and peak memory go into ``stages[name]``; an error is recorded, not raised;
    ``save()`` then writes everything measured so far."""
    row = stages.setdefault(name, {})
    print(f"[gpu-check] {name} ...", flush=True)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        yield row
    except Exception as e:  # the other stages still run; the error is in the result
        traceback.print_exc()
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        sync(device)
        row["seconds"] = round(time.perf_counter() - t0, 2)
        row["peak_memory_gib"] = round(peak_memory_gib(device), 3)
        if save is not None:
            save()  # before the line below: a run killed once it is printed has the stage on disk
        print(f"[gpu-check] {name}: {json.dumps(_short(row))}", flush=True)


def _short(row: dict) -> dict:
    return {k: v for k, v in row.items() if not isinstance(v, (list, dict))}
