"""Gather reference jobs' outputs into the run's tables, figures, checkpoints and regenerated data.

The committed tables under ``figures/<name>/data/`` are the merged state: each new job replaces the rows it
trained (a rerun of a row wins) and adds the rest, so rounds of jobs on different days build one table.
:func:`merge` writes

* ``runs/<name>/results/`` and ``figures/<name>/data/``: ``per_step_accuracy.csv``, ``training_history.csv``,
  ``heldout_eval.csv`` (notebook 02's figures), ``acceptance_by_step.csv`` / ``acceptance_summary.csv``
  (notebook 03's), and the run's own ``reference_rows.csv`` (tokens seen, wall time, plateau, early stopping
  per row), ``reference_table.csv`` (the paper's Table 5 layout), ``acceptance_bootstrap.csv`` and
  ``reference_jobs.csv`` (the GPU, the software versions and the time of every job);
* the figures, through :func:`kvshot_lib.plots.publish`, so ``kvshot figures --profile <name>`` redraws them;
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

from ..target import assets
from ..target.assets import REPO_ROOT
from ..training.convergence import heldout_acceptance
from . import outputs

FIGURES = {
    "02_per_step_accuracy": ("per_step_accuracy.csv",),
    "02_training_curves": ("training_history.csv",),
    "02_heldout_over_training": ("heldout_eval.csv",),
    "03_acceptance_by_step": ("acceptance_by_step.csv",),
    "03_mat_by_drafter": ("acceptance_summary.csv",),
}
ACCEPTANCE_KEYS = ["drafter", "mode", "temperature"]


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


def _replace(old: pd.DataFrame, new: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    if new.empty:
        return old
    if old.empty:
        return new.reset_index(drop=True)
    drop = (
        old.set_index(keys).index.isin(new.set_index(keys).index)
        if keys[1:]
        else old[keys[0]].isin(new[keys[0]])
    )
    return pd.concat([old[~drop], new], ignore_index=True)


def _read(folder: Path, name: str) -> pd.DataFrame:
    path = Path(folder) / name
    return pd.read_csv(path) if path.is_file() else pd.DataFrame()


def _row_tables(members: dict, summary: pd.DataFrame, table: str) -> list[pd.DataFrame]:
    """Each row's ``rows/<row>/<table>.csv`` of a job, labelled with its drafter, paradigm and regime."""
    label = summary.set_index("drafter")[["paradigm", "regime"]]
    frames = [(d, outputs.csv_member(members, f"rows/{d}/{table}.csv")) for d in summary["drafter"]]
    return [
        f.assign(drafter=d, paradigm=label.loc[d, "paradigm"], regime=label.loc[d, "regime"])
        for d, f in frames
        if not f.empty
    ]


def per_step_rows(summary: pd.DataFrame, evals: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Final held-out accuracy per (drafter, draft step), in notebook 02's ``per_step_accuracy.csv`` layout."""
    rows = []
    for _, s in summary.iterrows():
        ev = evals.get(s["drafter"])
        if ev is None or ev.empty:
            continue
        final = ev.iloc[-1]
        for k in sorted(int(c[4:]) for c in ev.columns if c.startswith("acc_") and c[4:].isdigit()):
            rows.append(
                dict(
                    drafter=s["drafter"],
                    paradigm=s["paradigm"],
                    regime=s["regime"],
                    kv_mode=s.get("kv_mode"),
                    n_layers=s.get("n_layers"),
                    draft_step=k,
                    accuracy=final[f"acc_{k}"],
                    ce=final.get(f"ce_{k}"),
                    n=final.get(f"n_{k}"),
                    ceiling=final.get("ceiling"),
                )
            )
    return pd.DataFrame(rows)


def merge(plan, sources, root: Path = REPO_ROOT, name: str | None = None, verify_target=None) -> dict:
    """Merge the job outputs under ``sources`` into ``root``'s run ``name`` (default: the plan's profile)."""
    name = name or plan.profile
    root = Path(root)
    data_dir, results = root / "figures" / name / "data", root / "runs" / name / "results"
    results.mkdir(parents=True, exist_ok=True)
    tables = {t: _read(data_dir, t) for t in (
        "reference_rows.csv", "per_step_accuracy.csv", "training_history.csv", "heldout_eval.csv",
        "acceptance_by_step.csv", "acceptance_summary.csv", "acceptance_bootstrap.csv", "reference_jobs.csv",
    )}  # fmt: skip
    merged_jobs, checkpoints, regenerated = [], [], []
    for folder in job_folders(sources):
        m = outputs.read_tables(folder / outputs.TABLES)
        env = json.loads(m.get("environment.json", b"{}") or b"{}")
        job = json.loads(m.get("job.json", b"{}") or b"{}")
        summary = outputs.csv_member(m, "summary.csv")
        if not summary.empty and "paradigm" in summary:
            summary = summary[summary["paradigm"].notna()]  # rows skipped for lack of time have no results
            evals = {f["drafter"].iloc[0]: f for f in _row_tables(m, summary, "eval")}
            tables["reference_rows.csv"] = _replace(tables["reference_rows.csv"], summary, ["drafter"])
            tables["per_step_accuracy.csv"] = _replace(
                tables["per_step_accuracy.csv"], per_step_rows(summary, evals), ["drafter"]
            )
            for table, frames in (
                ("training_history.csv", _row_tables(m, summary, "history")),
                ("heldout_eval.csv", list(evals.values())),
            ):
                if frames:
                    tables[table] = _replace(tables[table], pd.concat(frames, ignore_index=True), ["drafter"])
        for t in ("acceptance_by_step.csv", "acceptance_summary.csv", "acceptance_bootstrap.csv"):
            tables[t] = _replace(tables[t], outputs.csv_member(m, t), ACCEPTANCE_KEYS)
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
        tables["reference_jobs.csv"] = _replace(
            tables["reference_jobs.csv"], pd.DataFrame([info]), ["job", "started"]
        )
        merged_jobs.append(info)
        checkpoints += _import_checkpoints(folder, root, name)
        regenerated += _keep_regenerated(folder, root, name)
    tables["reference_table.csv"] = reference_table(tables)
    written = _write(tables, results, data_dir)
    figures = _publish(
        plan,
        tables,
        results,
        root / "figures" / name,
        merged_jobs or tables["reference_jobs.csv"].to_dict("records"),
    )
    verified = _verify(checkpoints, verify_target) if verify_target is not None else []
    return dict(jobs=merged_jobs, tables=written, figures=figures, checkpoints=[str(c) for c in checkpoints],
                regenerated=regenerated, verified=verified)  # fmt: skip


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
    cache = Path(cache or assets.cache_dir()) / "regenerated"
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


def reference_table(tables: dict) -> pd.DataFrame:
    """The paper's Table 5 layout: held-out per-step accuracy (and MT-bench alpha_k, MAT, retention at T=0 with
    95% bootstrap intervals where the evaluation job ran), tokens seen, wall time and the plateau per row."""
    rows = tables["reference_rows.csv"]
    if rows.empty:
        return pd.DataFrame()
    out = []
    boot = tables["acceptance_bootstrap.csv"]
    per_step = tables["per_step_accuracy.csv"]
    for _, r in rows.iterrows():
        mine = per_step[per_step["drafter"] == r["drafter"]] if not per_step.empty else per_step
        acc = {
            f"acc_{int(k)}": float(a) for k, a in zip(mine.get("draft_step", []), mine.get("accuracy", []))
        }
        rec = dict(
            drafter=r["drafter"], paradigm=r["paradigm"], regime=r["regime"], n_layers=r.get("n_layers"),
            kv_mode=r.get("kv_mode"), seed=r.get("seed"), responses=r.get("responses", ""),
            train_tokens=r.get("train_tokens"), seconds=r.get("seconds"), steps=r.get("steps_trained"),
            plateau_delta=r.get("plateau_delta"), plateaued=r.get("plateaued"), stopped_early=r.get("stopped_early"),
        )  # fmt: skip
        rec.update({f"heldout_{k}": v for k, v in acc.items()})
        rec["heldout_mat"] = heldout_acceptance(acc) if acc else None
        rec["heldout_retention"] = (
            acc["acc_6"] / acc["acc_0"] if "acc_6" in acc and acc.get("acc_0") else None
        )
        if not boot.empty:
            b = boot[
                (boot["drafter"] == r["drafter"]) & (boot["mode"] == "chain") & (boot["temperature"] == 0.0)
            ]
            for _, m in b.iterrows():
                rec[f"mtbench_{m['metric']}"] = m["value"]
                rec[f"mtbench_{m['metric']}_ci"] = f"[{m['lo']:.3f}, {m['hi']:.3f}]"
        out.append(rec)
    return pd.DataFrame(out)


def _write(tables: dict, results: Path, data_dir: Path) -> list[str]:
    data_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for t, df in tables.items():
        if df.empty:
            continue
        df.to_csv(results / t, index=False)
        if not any(t in f for f in FIGURES.values()):  # figure tables reach data/ through publish
            df.to_csv(data_dir / t, index=False)
        written.append(t)
    return written


def _publish(plan, tables: dict, results: Path, figure_dir: Path, jobs: list[dict]) -> list[str]:
    from .. import plots

    gpus = sorted({str(j.get("gpu")) for j in jobs if j.get("gpu")})
    rows = tables["reference_rows.csv"]
    tokens = rows["train_tokens"] if "train_tokens" in rows else pd.Series(dtype=float)
    lo, hi = (int(tokens.min()), int(tokens.max())) if len(tokens) else (0, 0)
    seen = f"{lo:,}{f'–{hi:,}' if hi != lo else ''} training tokens per drafter" if len(tokens) else ""
    context = " · ".join(
        x
        for x in (f"{plan.target} · reference run ({', '.join(gpus) or 'no GPU'}), online training", seen)
        if x
    )
    drawn = []
    for fig, needs in FIGURES.items():
        if all(not tables[t].empty for t in needs):
            import matplotlib.pyplot as plt

            plt.close(plots.publish(fig, results, figure_dir, context))
            drawn.append(fig)
    return drawn


def _verify(checkpoints: list[Path], target) -> list[dict]:
    """Load every imported checkpoint on the CPU with ``target`` (they must load; a wrong target is refused)."""
    from ..drafters import load_drafter

    done = []
    for path in checkpoints:
        d = load_drafter(path, target)
        done.append(dict(path=str(path), paradigm=d.cfg.paradigm, parameters=d.n_trainable()))
    return done
