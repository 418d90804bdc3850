"""Gather the remote jobs' outputs into the run: its tables and figures, checkpoints and regenerated data.

Each job folder (one holding ``tables.tar.gz``, oldest job first) brings trained rows, acceptance tables and the
job's machine; :func:`merge` hands them to :func:`kvshot_lib.reference.update_run`, which writes
``runs/<name>/results/`` and ``figures/<name>/`` exactly as a run on this machine does (a rerun row replaces the
old one). Besides, it writes

* ``checkpoints/<name>/<row>/`` (``config.json`` + bf16 ``model.safetensors``) for the headline rows, and a
  copy in ``runs/<name>/drafters/`` where notebooks 03 and 06 look for drafters;
* ``data/<name>/regenerated/<folder>.tar.gz`` (committed, so the regeneration travels to the next machine),
  unpacked into the local cache.
"""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import pandas as pd

from kvshot_lib.reference import tables, update_run
from kvshot_lib.target import REPO_ROOT, cache_dir

from . import outputs


def job_folders(sources) -> list[Path]:
    """Every job output folder (one holding ``tables.tar.gz``) under the given folders, oldest job first."""
    found = []
    for src in sources:
        src = Path(src)
        found += [
            p.parent
            for p in (
                [src / outputs.TABLES] if (src / outputs.TABLES).is_file() else src.rglob(outputs.TABLES)
            )
        ]

    def started(folder: Path) -> str:
        env = json.loads(outputs.read_tables(folder / outputs.TABLES).get("environment.json", b"{}") or b"{}")
        return env.get("started", "")

    return sorted(set(found), key=started)


def job_tables(folder: Path) -> dict[str, pd.DataFrame]:
    """The run's tables that one job folder brings (:data:`kvshot_lib.reference.tables.KEYS`)."""
    m = outputs.read_tables(folder / outputs.TABLES)
    env = json.loads(m.get("environment.json", b"{}") or b"{}")
    job = json.loads(m.get("job.json", b"{}") or b"{}")
    summary = outputs.csv_member(m, "summary.csv")
    if "paradigm" in summary:
        summary = summary[summary["paradigm"].notna()]  # rows skipped for lack of time have no results
    rows = list(summary["drafter"]) if "drafter" in summary else []
    found = {"reference_rows.csv": summary}
    for t in outputs.ROW_TABLES:
        frames = [f for f in (outputs.csv_member(m, f"rows/{d}/{t}") for d in rows) if not f.empty]
        found[t] = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    for t in ("acceptance_by_step.csv", "acceptance_summary.csv", "acceptance_bootstrap.csv"):
        found[t] = outputs.csv_member(m, t)
    info = dict(
        job=env.get("job", folder.name),
        kind=env.get("kind", ""),
        rows=" ".join(env.get("rows", []) or []),
        gpu=env.get("gpu", env.get("device", "")),
        torch=env.get("torch", ""),
        transformers=env.get("transformers", ""),
        started=env.get("started", ""),
        seconds=job.get("seconds"),
    )
    found["reference_jobs.csv"] = pd.DataFrame([info])
    return found


def merge(plan, sources, root: Path = REPO_ROOT, name: str | None = None, verify_target=None) -> dict:
    """Merge the job outputs under ``sources`` into ``root``'s run ``name`` (default: the plan's profile)."""
    name = name or plan.profile
    root = Path(root)
    new: dict[str, pd.DataFrame] = {}
    jobs, checkpoints, regenerated = [], [], []
    for folder in job_folders(sources):
        for t, df in job_tables(folder).items():
            new[t] = tables.replace_rows(new.get(t, pd.DataFrame()), df, tables.KEYS[t])
        jobs.append(new["reference_jobs.csv"].iloc[-1].to_dict())
        checkpoints += _import_checkpoints(folder, root, name)
        regenerated += _keep_regenerated(folder, root, name)
    written = update_run(plan, new, root, name)
    verified = _verify(checkpoints, verify_target) if verify_target is not None else []
    return dict(jobs=jobs, **written, checkpoints=[str(c) for c in checkpoints], regenerated=regenerated,
                verified=verified)  # fmt: skip


def _import_checkpoints(folder: Path, root: Path, name: str) -> list[Path]:
    groups: dict[str, list[Path]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        row = f.name.split(".")[0]
        groups.setdefault(row, []).append(f)
    done = []
    for row, files in groups.items():
        ckpt = outputs.import_checkpoint(files, root / "checkpoints" / name / row)
        local = root / "runs" / name / "drafters" / row
        shutil.rmtree(local, ignore_errors=True)
        shutil.copytree(ckpt, local)
        done.append(ckpt)
    return done


def _keep_regenerated(folder: Path, root: Path, name: str) -> list[str]:
    kept, dest_dir = [], root / "data" / name / "regenerated"
    files = sorted(folder.glob("regenerated-*.tar.gz"))
    for stem in {f.name.removeprefix("regenerated-").split(".")[0] for f in files}:
        for old in dest_dir.glob(f"{stem}*.tar.gz"):  # a later regeneration holds every earlier shard
            old.unlink()
    for f in files:
        dest = dest_dir / f.name.removeprefix("regenerated-")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, dest)
        kept.append(str(dest))
    install_regenerated(dest_dir)
    return kept


def install_regenerated(src: Path, cache: Path | None = None) -> list[str]:
    """Unpack regeneration archives (one or several parts per folder) into the cache, unless the cache's folder
    already has as many shards."""
    cache = Path(cache or cache_dir()) / "regenerated"
    parts: dict[str, list[Path]] = {}
    for f in sorted(Path(src).glob("*.tar.gz")) if Path(src).is_dir() else []:
        parts.setdefault(f.name.split(".")[0], []).append(f)
    done = []
    for stem, files in parts.items():
        with tarfile.open(files[0]) as t:
            manifest = json.loads(t.extractfile(f"{stem}/manifest.json").read())
        have = cache / stem / "manifest.json"
        if have.is_file() and len(json.loads(have.read_text())["shards"]) >= len(manifest["shards"]):
            continue
        shutil.rmtree(cache / stem, ignore_errors=True)
        for f in files:
            with tarfile.open(f) as t:
                t.extractall(cache, filter="data")
        done.append(stem)
    return done


def _verify(checkpoints: list[Path], target) -> list[dict]:
    """Load every imported checkpoint on the CPU with ``target`` (they must load; a wrong target is refused)."""
    from kvshot_lib.drafters import load_drafter

    done = []
    for path in checkpoints:
        d = load_drafter(path, target)
        done.append(dict(path=str(path), paradigm=d.cfg.paradigm, parameters=d.n_trainable()))
    return done
