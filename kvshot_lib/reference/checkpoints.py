"""The reference run's committed checkpoints: ``checkpoints/<run>/<row>/``, small enough to live in git.

Each is ``config.json`` plus the drafter's trainable weights in bf16 (``d2t`` and the target probe keep their
dtypes; the frozen embedding and LM head are the target's and never saved), so it loads on a CPU from a fresh
clone, with no training, and refuses a target other than its own (:func:`~kvshot_lib.drafters.load_drafter`).
A file holds at most ``max_file_mb`` (a drafter over it is split into numbered files); a row whose copy would
take the committed checkpoints over ``max_total_mb`` is not copied, and its record says so: under a
``checkpoints/`` folder the limit counts every run's rows (the repository's rule is 60 MB in all), except for a
smoke run (``<run>-smoke``, git-ignored), which counts its own. Rows are copied in the plan's order, so when the
budget runs out it is the last rows that give way.
``tests/test_reference_checkpoints.py`` checks the size, the dtypes, the loading, the refusal and lossless decoding.
"""

from __future__ import annotations

import copy
import shutil
import warnings
from pathlib import Path

import torch

MB = 10**6
HEADER_MARGIN = 64 * 1024  # a safetensors file's JSON header, beside its tensors


def _beside(folder: Path) -> list[Path]:
    """The checkpoints that count with ``folder``'s toward the limit (module docstring), itself left out."""
    run = folder.parent
    runs = [run]
    if run.parent.name == "checkpoints" and not run.name.endswith("-smoke"):
        runs = [r for r in run.parent.iterdir() if r.is_dir() and not r.name.endswith("-smoke")]
    return [
        p for r in runs for p in r.iterdir() if p.is_dir() and p != folder and not p.name.endswith(".tmp")
    ]


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def portable_extra(extra: dict) -> dict:
    """A checkpoint's training metadata with the folder it started from relative to the checkout: committed files
    hold no path of the machine that trained them."""
    from ..training import portable_init

    out = copy.deepcopy(extra)
    if isinstance(out.get("init_from"), dict) and "path" in out["init_from"]:
        out["init_from"]["path"] = portable_init(out["init_from"]["path"])
    if "init_from" in out.get("train_config", {}):
        out["train_config"]["init_from"] = portable_init(out["train_config"]["init_from"]) or None
    return out


def commit_checkpoint(
    drafter, folder: Path, max_file_mb: float = 16, max_total_mb: float = 60, write_more=None
) -> dict:
    """Write ``drafter`` as a committed checkpoint at ``folder`` (``checkpoints/<run>/<row>``) within the limits
    (``write_more(tmp_folder)`` adds files beside it first, counted too: a carried run's position).

    Returns ``{"checkpoint", "checkpoint_mb", "checkpoint_files"}``, or ``{"checkpoint": "", "checkpoint_skipped":
    why}`` when the committed checkpoints would exceed ``max_total_mb`` with it (the folder is then left as it was)."""
    from ..drafters import save_drafter

    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    extra = drafter.cfg.extra
    drafter.cfg.extra = portable_extra(extra)
    try:
        save_drafter(drafter, tmp, dtype=torch.bfloat16, max_file_bytes=int(max_file_mb * MB) - HEADER_MARGIN)
    finally:
        drafter.cfg.extra = extra
    if write_more is not None:
        write_more(tmp)
    size = folder_bytes(tmp)
    big = [f.name for f in tmp.iterdir() if f.stat().st_size > max_file_mb * MB]
    others = sum(folder_bytes(p) for p in _beside(folder))
    why = ""
    if big:
        why = f"files {big} exceed {max_file_mb} MB (a single tensor larger than the limit)"
    elif others + size > max_total_mb * MB:
        why = (
            f"{size / MB:.1f} MB more would take the committed checkpoints to {(others + size) / MB:.1f} MB, over "
            f"{max_total_mb} MB; retire one (git history keeps it) or raise the plan's checkpoints.max_total_mb"
        )
    if why:
        shutil.rmtree(tmp)
        return dict(checkpoint="", checkpoint_skipped=why)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    files = sorted(f.name for f in folder.iterdir() if f.suffix == ".safetensors")
    return dict(checkpoint=str(folder), checkpoint_mb=round(size / MB, 2), checkpoint_files=len(files))


PARTIAL = ".partial"  # a carried row's position beside the checkpoints (checkpoints/<run>/<row>.partial)


def carried_folder(checkpoint: Path) -> Path:
    """Where a carried row (the plan's ``carry: true``) keeps its position: beside its checkpoint's folder."""
    return checkpoint.with_name(checkpoint.name + PARTIAL)


def stretch_table(root: Path, run: str, row: str) -> Path:
    """Where a carried row's stretches between restarts, each with its machine, are committed
    (``scripts/reference/partial_curve_points.py --out figures/<run>/data/partial/<row>_curve.csv`` writes them)."""
    return Path(root) / "figures" / run / "data" / "partial" / f"{row}_curve_progress.csv"


def carry_saver(folder: Path, max_file_mb: float = 16, max_total_mb: float = 60):
    """The training loop's ``on_save`` for a carried row: its weights in bf16 (within the committed checkpoints'
    limits, counted with them) and its position (:mod:`kvshot_lib.training.carry`) in ``folder``, replaced whole
    each time. Over the limits it warns and keeps the previous one."""
    from ..training.carry import write_carried

    def on_save(drafter, step: int, config: dict, logs: dict, early_stopping: dict) -> None:
        def position(tmp: Path) -> None:
            write_carried(tmp, step, config, logs, early_stopping)

        record = commit_checkpoint(drafter, folder, max_file_mb, max_total_mb, write_more=position)
        if not record["checkpoint"]:
            warnings.warn(f"{folder.name} not carried: {record['checkpoint_skipped']}", stacklevel=2)

    return on_save


def checkpoint_folders(specs: list[str] | None, defaults: dict[str, str], root: Path) -> dict[str, Path]:
    """``{name: folder}`` from ``NAME=FOLDER`` arguments (folders relative to ``root``, the repository), else from
    ``defaults``; a ``ValueError`` with a one-line message for a malformed argument or a folder without a
    checkpoint (no ``config.json``)."""
    pairs = [spec.split("=", 1) for spec in specs] if specs else [list(p) for p in defaults.items()]
    folders = {}
    for pair in pairs:
        if len(pair) != 2 or not pair[0]:
            raise ValueError(f"--drafter takes NAME=FOLDER, got {'='.join(pair)!r}.")
        folder = root / pair[1]
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"--drafter {pair[0]}: no checkpoint in {pair[1]} (no config.json); train it first."
            )
        folders[pair[0]] = folder
    return folders
