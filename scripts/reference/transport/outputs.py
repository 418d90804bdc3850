"""What a reference job brings back, within the remote device's limits: at most 8 files of at most 16 MiB, at
most two folders down, names of letters, digits, '.', '_' and '-'.

A job writes into ``<OUT>/<job>/``:

* ``tables.tar.gz``: every small table (per row ``rows/<row>/`` notebook 02's three tables; ``summary.csv``;
  the acceptance tables; ``environment.json``, ``job.json``, ``regenerated.json``), rewritten after each row,
  so a job stopped at its limit still returns what it finished;
* ``<row>.safetensors``: a headline row's checkpoint, trainable weights in bf16 plus ``d2t`` and
  ``target_probe``, with its ``config.json`` in the file's metadata (split in ``<row>.partIofN.safetensors``
  files when over :data:`MAX_FILE`); :func:`import_checkpoint` turns it back into a checkpoint folder;
* ``regenerated-<folder>.tar.gz`` (or ``.partKofN`` files): a regeneration's cache folder (JSON shards and
  manifest).

:func:`check_limits` checks a job's output against those limits (the dry run calls it after every job).
"""

from __future__ import annotations

import io
import json
import re
import shutil
import tarfile
import tempfile
from pathlib import Path

import pandas as pd
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvshot_lib.drafters import checkpoint
from kvshot_lib.reference import tables
from kvshot_lib.target import cache_dir

CONFIG_FILE, WEIGHTS_FILE = checkpoint.CONFIG_FILE, checkpoint.WEIGHTS_FILE

ROW_TABLES = ("per_step_accuracy.csv", "training_history.csv", "heldout_eval.csv")  # per row, in rows/<row>/
MiB = 1 << 20
MAX_FILE = 16 * MiB
MAX_FILES = 8
NAME_OK = re.compile(r"^[A-Za-z0-9._-]+$")
TABLES = "tables.tar.gz"


class OutputLimitError(RuntimeError):
    """A job's output would not come back from the device whole."""


def runs_dir() -> Path:
    """Where the device's jobs keep their trained rows, so that a later job on the same warm machine finds them."""
    return cache_dir() / "reference-runs"


def scratch(out: Path) -> Path:
    """The folder of small files that :func:`pack_tables` archives (outside the returned folder)."""
    path = runs_dir() / f"_tables-{Path(out).name}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def pack_tables(out: Path) -> None:
    tmp = Path(out) / (TABLES + ".tmp")
    with tarfile.open(tmp, "w:gz") as t:
        for f in sorted(scratch(out).rglob("*")):
            if f.is_file():
                t.add(str(f), arcname=str(f.relative_to(scratch(out))), recursive=False)
    tmp.rename(Path(out) / TABLES)


def write_json(out: Path, name: str, data: dict) -> None:
    (scratch(out) / name).write_text(json.dumps(data, indent=1, default=str))
    pack_tables(out)


def write_tables(out: Path, summaries: list[dict]) -> None:
    pd.DataFrame(summaries).to_csv(scratch(out) / "summary.csv", index=False)
    pack_tables(out)


def add_run(out: Path, result, summary: dict, checkpoint: bool) -> None:
    """A finished row: its log tables into the archive, and (``checkpoint``) its bf16 checkpoint file(s)."""
    rows = scratch(out) / "rows" / result.config.name
    rows.mkdir(parents=True, exist_ok=True)
    for name, table in tables.trained_tables([result], [summary]).items():
        if name in ROW_TABLES:
            table.to_csv(rows / name, index=False)
    (rows / "train_config.json").write_text(json.dumps(result.config.as_dict(), indent=1))
    if checkpoint:
        export_checkpoint(result.drafter, Path(out), result.config.name)
    pack_tables(out)


def export_checkpoint(drafter, out: Path, name: str) -> list[Path]:
    """``<out>/<name>.safetensors`` (or ``.partIofN`` files): bf16 trainable weights, config in the metadata."""
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint.save_drafter(drafter, tmp, dtype=torch.bfloat16)
        config = (Path(tmp) / CONFIG_FILE).read_text()
        with safe_open(str(Path(tmp) / WEIGHTS_FILE), "pt") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}
    groups, size = [[]], 0
    budget = MAX_FILE - MiB  # room for the header and the config
    for k in sorted(state, key=lambda k: -state[k].numel() * state[k].element_size()):
        b = state[k].numel() * state[k].element_size()
        if groups[-1] and size + b > budget:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += b
    paths = []
    for i, keys in enumerate(groups):
        suffix = "" if len(groups) == 1 else f".part{i + 1}of{len(groups)}"
        path = Path(out) / f"{name}{suffix}.safetensors"
        save_file({k: state[k] for k in keys}, str(path), metadata={"kvshot_config": config})
        paths.append(path)
    return paths


def import_checkpoint(files: list[Path], folder: Path) -> Path:
    """The checkpoint folder (``config.json`` + ``model.safetensors``) of a job's checkpoint file(s)."""
    state, config = {}, None
    for path in sorted(files):
        with safe_open(str(path), "pt") as f:
            config = f.metadata()["kvshot_config"]
            state.update({k: f.get_tensor(k) for k in f.keys()})
    folder = Path(folder)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": json.loads(config)["format"]})
    (folder / CONFIG_FILE).write_text(config)
    return folder


def add_regenerated(out: Path, folder: Path, raw_budget: int = 40 * MiB) -> list[Path]:
    """A regeneration cache folder as ``regenerated-<folder>.tar.gz``, or ``...partKofN.tar.gz`` files of at most
    ``raw_budget`` bytes of JSON each (about a third of that compressed); every part carries the manifest."""
    folder = Path(folder)
    shards = sorted(folder.glob("shard-*.json"))
    groups, size = [[]], 0
    for f in shards:
        if groups[-1] and size + f.stat().st_size > raw_budget:
            groups.append([])
            size = 0
        groups[-1].append(f)
        size += f.stat().st_size
    for old in Path(out).glob(f"regenerated-{folder.name}*.tar.gz"):
        old.unlink()
    paths = []
    for k, group in enumerate(groups):
        suffix = "" if len(groups) == 1 else f".part{k + 1}of{len(groups)}"
        path = Path(out) / f"regenerated-{folder.name}{suffix}.tar.gz"
        with tarfile.open(path.with_suffix(".tmp"), "w:gz") as t:
            for f in [folder / "manifest.json", *group]:
                t.add(str(f), arcname=f"{folder.name}/{f.name}", recursive=False)
        path.with_suffix(".tmp").rename(path)
        if path.stat().st_size > MAX_FILE:
            raise OutputLimitError(f"{path.name} is {path.stat().st_size / MiB:.1f} MiB; lower raw_budget.")
        paths.append(path)
    return paths


def write_acceptance(out: Path, runs, n_boot: int, done: list[dict]) -> None:
    for name, table in tables.acceptance_tables(runs, n_boot).items():
        table.to_csv(scratch(out) / name, index=False)
    (scratch(out) / "acceptance_done.json").write_text(json.dumps(done, indent=1))
    pack_tables(out)


def read_tables(path: Path) -> dict[str, bytes]:
    """The members of a job's ``tables.tar.gz``: {relative name: bytes}."""
    with tarfile.open(path) as t:
        return {m.name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}


def csv_member(members: dict[str, bytes], name: str) -> pd.DataFrame:
    data = members.get(name)
    if not data:
        return pd.DataFrame()
    try:
        return pd.read_csv(io.BytesIO(data))
    except pd.errors.EmptyDataError:
        return pd.DataFrame()


def check_limits(out_root: Path) -> list[str]:
    """Every problem that would keep part of ``out_root`` from coming back from the device (empty: none)."""
    out_root = Path(out_root)
    files = [p for p in out_root.rglob("*") if p.is_file()]
    problems = []
    if len(files) > MAX_FILES:
        problems.append(f"{len(files)} files (at most {MAX_FILES} come back)")
    for p in files:
        rel = p.relative_to(out_root)
        if p.stat().st_size > MAX_FILE:
            problems.append(f"{rel}: {p.stat().st_size / MiB:.1f} MiB (at most 16 MiB)")
        if len(rel.parts) > 3:
            problems.append(f"{rel}: more than two folders down")
        if not all(NAME_OK.match(part) for part in rel.parts):
            problems.append(f"{rel}: a name outside letters, digits, '.', '_' and '-'")
    if problems:
        raise OutputLimitError("the job's output would not come back whole: " + "; ".join(problems))
    return problems
