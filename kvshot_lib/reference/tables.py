"""The reference run's tables and figures, written straight into ``runs/<name>/results/`` and ``figures/<name>/``.

The tables under ``figures/<name>/data/`` are the run's merged state: each update replaces the rows it brings
(a rerun of a row wins, keyed by :data:`KEYS`) and keeps the rest, so rounds of training on different days, or
on different machines, build one table. :func:`update_run` writes

* ``per_step_accuracy.csv``, ``training_history.csv``, ``heldout_eval.csv`` (notebook 02's figures, from
  :func:`trained_tables`) and ``acceptance_by_step.csv`` / ``acceptance_summary.csv`` (notebook 03's, from
  :func:`acceptance_tables`), drawn through :func:`kvshot_lib.plots.publish` so that ``kvshot figures
  --profile <name>`` redraws them;
* the run's own ``reference_rows.csv`` (tokens seen, wall time, plateau, early stopping per row),
  ``acceptance_bootstrap.csv`` (95% intervals), ``reference_jobs.csv`` (the machine, the software versions and
  the time of every run) and ``reference_table.csv``: the paper's Table 5 layout (:func:`reference_table`).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ..target.assets import REPO_ROOT
from ..training import heldout_acceptance

ROWS = ["drafter"]
ACCEPTANCE = ["drafter", "mode", "temperature"]
KEYS = {
    "reference_rows.csv": ROWS,
    "per_step_accuracy.csv": ROWS,
    "training_history.csv": ROWS,
    "heldout_eval.csv": ROWS,
    "acceptance_by_step.csv": ACCEPTANCE,
    "acceptance_summary.csv": ACCEPTANCE,
    "acceptance_bootstrap.csv": ACCEPTANCE,
    "reference_jobs.csv": ["job", "started"],
}
FIGURES = {
    "02_per_step_accuracy": ("per_step_accuracy.csv",),
    "02_training_curves": ("training_history.csv",),
    "02_heldout_over_training": ("heldout_eval.csv",),
    "03_acceptance_by_step": ("acceptance_by_step.csv",),
    "03_mat_by_drafter": ("acceptance_summary.csv",),
}


def replace_rows(old: pd.DataFrame, new: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """``old`` without the rows whose ``keys`` appear in ``new``, then ``new``."""
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


def trained_tables(results, summaries: list[dict]) -> dict[str, pd.DataFrame]:
    """Notebook 02's tables of trained rows (:func:`~kvshot_lib.training.per_step_table` and
    :func:`~kvshot_lib.training.combined_table`, as notebook 02 writes them) and their ``reference_rows.csv``."""
    from ..training import combined_table, per_step_table

    return {
        "reference_rows.csv": pd.DataFrame(summaries),
        "per_step_accuracy.csv": per_step_table(results),
        "training_history.csv": combined_table(results, "history"),
        "heldout_eval.csv": combined_table(results, "eval"),
    }


def acceptance_tables(runs, n_boot: int) -> dict[str, pd.DataFrame]:
    """Notebook 03's acceptance tables and their 95% bootstrap intervals, of :class:`AcceptanceRun` s."""
    from ..evaluation import acceptance_summary, acceptance_table, bootstrap_acceptance

    return {
        "acceptance_by_step.csv": acceptance_table(runs),
        "acceptance_summary.csv": acceptance_summary(runs),
        "acceptance_bootstrap.csv": bootstrap_acceptance(runs, n_boot),
    }


def reference_table(tables: dict) -> pd.DataFrame:
    """The paper's Table 5 layout: held-out per-step accuracy (and MT-bench alpha_k, MAT, retention at T=0 with
    95% bootstrap intervals where the evaluation ran), tokens seen, wall time and the plateau per row."""
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


def update_run(plan, new: dict[str, pd.DataFrame], root: Path = REPO_ROOT, name: str | None = None) -> dict:
    """Merge ``new`` tables (``{table: rows}``, tables of :data:`KEYS`) into the run ``name`` (default: the plan's
    profile) under ``root``: rewrite its tables, Table 5 and its figures. Returns what it wrote and drew."""
    name = name or plan.profile
    root = Path(root)
    data_dir, results = root / "figures" / name / "data", root / "runs" / name / "results"
    results.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    tables = {t: _read(data_dir, t) for t in KEYS}
    for t, df in new.items():
        tables[t] = replace_rows(tables[t], df, KEYS[t])
    tables["reference_table.csv"] = reference_table(tables)
    written = []
    for t, df in tables.items():
        if df.empty:
            continue
        df.to_csv(results / t, index=False)
        if not any(t in f for f in FIGURES.values()):  # figure tables reach data/ through publish
            df.to_csv(data_dir / t, index=False)
        written.append(t)
    figures = _publish(plan, tables, results, root / "figures" / name)
    return dict(tables=written, figures=figures)


def _read(folder: Path, name: str) -> pd.DataFrame:
    path = Path(folder) / name
    return pd.read_csv(path) if path.is_file() else pd.DataFrame()


def _publish(plan, tables: dict, results: Path, figure_dir: Path) -> list[str]:
    import matplotlib.pyplot as plt

    from .. import plots

    jobs = tables["reference_jobs.csv"]
    gpus = sorted({str(g) for g in jobs.get("gpu", []) if isinstance(g, str) and g})
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
            plt.close(plots.publish(fig, results, figure_dir, context))
            drawn.append(fig)
    return drawn
