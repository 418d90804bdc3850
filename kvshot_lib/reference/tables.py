"""The reference run's tables and figures, written straight into ``runs/<run>/results/`` and ``figures/<run>/``.

The tables under ``figures/<run>/data/`` are the run's merged state: each update replaces the rows it brings
(a rerun of a row wins, keyed by :data:`KEYS`) and keeps the rest, so rows trained on different days, or on
different machines, build one table. :func:`update_run` writes

* what each trained row brings (:func:`trained_tables`): ``per_step_accuracy.csv``, ``training_history.csv``,
  ``heldout_eval.csv``, ``curve_points.csv`` (the loop's learning-curve log), ``training_times.csv``,
  ``kv_ablation.csv`` (real / zeroed / shuffled target KV) and the run's own ``reference_rows.csv`` (unique
  tokens, token-passes, wall time, machine, plateau, stopping, committed checkpoint per row);
* what the regenerate step brings: ``corpus_tokens.csv`` (each regenerated training slice's tokens, before and
  after its loops are cut or dropped, :func:`~.data.corpus_tokens`);
* what the step on both held-out sets brings (:mod:`.heldout`): ``heldout_cross.csv``;
* what the MT-bench evaluation brings (:func:`acceptance_tables`): ``acceptance_by_step.csv``,
  ``acceptance_summary.csv``, ``acceptance_bootstrap.csv`` (95% intervals of alpha_k, MAT, retention) and
  ``acceptance_generations.csv`` (each generation's accepted drafts and cycles);
* what is derived from the merged tables (:func:`derived_tables`): ``learning_curves.csv`` with
  ``curve_asymptotes.csv`` (fitted asymptotes), ``gap_by_budget.csv`` / ``gap_trends.csv`` (the plan's
  comparisons and the standard ones), ``gate_stats.csv`` (the hybrid's gate over training),
  ``mat_differences.csv`` (MT-bench MAT of each drafter minus the n-gram drafter's, and of the pairs above, on
  the same turns: a paired bootstrap),
  ``paper_table5.csv`` (the paper's Qwen3-8B numbers) and ``reference_table.csv``: the paper's Table 5 layout
  with its numbers beside ours (:func:`reference_table`);

and draws notebook 02's and 03's figures from them through :func:`kvshot_lib.plots.publish`, so that ``kvshot
figures --profile <run>`` redraws them. Every caption gives the unique tokens, the token-passes and the precision.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pandas as pd

from ..target.assets import REPO_ROOT
from ..training import convergence_table, heldout_acceptance

ROWS = ["drafter"]
ACCEPTANCE = ["drafter", "mode", "temperature"]
KEYS = {
    "reference_rows.csv": ROWS,
    "per_step_accuracy.csv": ROWS,
    "training_history.csv": ROWS,
    "heldout_eval.csv": ROWS,
    "curve_points.csv": ROWS,
    "training_times.csv": ROWS,
    "kv_ablation.csv": ROWS,
    "heldout_cross.csv": ["drafter", "heldout"],
    "acceptance_by_step.csv": ACCEPTANCE,
    "acceptance_summary.csv": ACCEPTANCE,
    "acceptance_bootstrap.csv": ACCEPTANCE,
    "acceptance_generations.csv": ACCEPTANCE,
    "reference_jobs.csv": ["job", "started"],
    "corpus_tokens.csv": ["conversations"],
}
# Per-optimizer-step logs, thousands of rows per drafter: kept as one row per block of this many optimizer steps
# (:func:`step_blocks`) and to this many significant digits, in memory before they are drawn and written, so that
# the committed table stays small and a redraw from it is byte-identical.
BLOCKED = {"training_history.csv": 10}
ROUNDED = {"training_history.csv": 5}
# the block's last step's values (seconds and epoch are cumulative)
LAST_IN_BLOCK = ("step", "lr", "seconds", "epoch")
FIGURES = {
    "02_per_step_accuracy": ("per_step_accuracy.csv",),
    "02_paper_table5": ("per_step_accuracy.csv", "paper_table5.csv"),
    "02_training_curves": ("training_history.csv",),
    "02_heldout_over_training": ("heldout_eval.csv",),
    "02_learning_curves": ("learning_curves.csv", "curve_asymptotes.csv"),
    "02_kv_ablation": ("kv_ablation.csv",),
    "02_heldout_cross": ("heldout_cross.csv",),
    "03_acceptance_by_step": ("acceptance_by_step.csv",),
    "03_mat_by_drafter": ("acceptance_summary.csv",),
}
# The KVShot paper's Table 5 (Qwen3-8B, ShareGPT ~70k samples x 3 epochs, SpecForge TTT): alpha_0..alpha_6, MAT,
# retention. A row of the plan names the line it stands for with ``paper:``.
PAPER_TABLE5 = {
    "no target information (control)": (.237, .238, .237, .237, .237, .237, .236, 1.31, .996),
    "KV 1L, head concatenation": (.489, .393, .353, .332, .320, .311, .305, 1.78, .624),
    "KV 1L, linear projection": (.488, .425, .396, .379, .368, .360, .354, 1.83, .725),
    "KV 1L, projection + RoPE": (.494, .427, .397, .381, .369, .360, .353, 1.84, .715),
    "KV-only 2 layers": (.594, .540, .514, .497, .484, .473, .463, 2.23, .779),
    "KV-only 3 layers": (.609, .558, .534, .518, .506, .496, .487, 2.31, .800),
    "KV-only 4 layers": (.614, .565, .542, .527, .515, .505, .495, 2.34, .806),
    "hybrid, random init": (.650, .582, .548, .527, .512, .501, .490, 2.44, .754),
    "hybrid, from the EAGLE-3 checkpoint": (.665, .603, .573, .553, .537, .525, .514, 2.54, .773),
    "EAGLE-3, 1 layer (hidden-only)": (.638, .566, .533, .511, .495, .481, .469, 2.37, .735),
}  # fmt: skip
STEPS = range(7)


def paper_table() -> pd.DataFrame:
    cols = [f"alpha_{k}" for k in STEPS] + ["mat", "retention"]
    return pd.DataFrame([dict(paper_row=name, **dict(zip(cols, v))) for name, v in PAPER_TABLE5.items()])


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


def merged_table(path: Path, new: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """``new`` in place of its own rows (by ``keys``) of the table at ``path``, where there is one; else ``new``."""
    return replace_rows(pd.read_csv(path), new, keys) if path.is_file() else new


def trained_tables(results, summaries: list[dict], ablation: pd.DataFrame | None = None) -> dict:
    """Notebook 02's tables of trained rows (as notebook 02 writes them), their ``reference_rows.csv`` and,
    for KV readers, their KV ablation (:func:`~kvshot_lib.training.kv_ablation_table`)."""
    from ..training import combined_table, per_step_table, training_times

    out = {
        "reference_rows.csv": pd.DataFrame(summaries),
        "per_step_accuracy.csv": per_step_table(results),
        "training_history.csv": combined_table(results, "history"),
        "heldout_eval.csv": combined_table(results, "eval"),
        "curve_points.csv": combined_table(results, "curve"),
        "training_times.csv": training_times(results).assign(
            unique_tokens=[s.get("unique_tokens") for s in summaries]  # summaries are in the results' order
        ),
    }
    if ablation is not None:
        out["kv_ablation.csv"] = ablation
    return out


def acceptance_tables(runs, n_boot: int) -> dict[str, pd.DataFrame]:
    """Notebook 03's acceptance tables and their 95% bootstrap intervals, of :class:`AcceptanceRun` s."""
    from ..evaluation import acceptance_summary, acceptance_table, bootstrap_acceptance, generation_table

    return {
        "acceptance_by_step.csv": acceptance_table(runs),
        "acceptance_summary.csv": acceptance_summary(runs),
        "acceptance_bootstrap.csv": bootstrap_acceptance(runs, n_boot),
        "acceptance_generations.csv": generation_table(runs),
    }


def derived_tables(tables: dict, comparisons=(), baseline_pairs=()) -> dict[str, pd.DataFrame]:
    """What the merged tables give: learning curves and their asymptotes, the gaps between rows by budget (the
    standard pairs of :func:`~kvshot_lib.evaluation.comparison_pairs` and ``comparisons``, ``[(drafter, minus)]``),
    the hybrid gate over training, MT-bench MAT differences on the same turns (each drafter minus the n-gram
    drafter, the same pairs, and ``baseline_pairs``: each row minus another run's checkpoint), the paper's Table 5
    and ours (:func:`reference_table`)."""
    from ..evaluation import (
        asymptotes,
        comparison_pairs,
        curve_table,
        gap_by_budget,
        gap_trends,
        paired_mat_difference,
    )

    out, pairs = {"paper_table5.csv": paper_table()}, []
    points = tables["curve_points.csv"]
    if not points.empty:
        curves = curve_table(points)
        out["learning_curves.csv"], out["curve_asymptotes.csv"] = curves, asymptotes(curves)
        names = set(curves["drafter"])
        pairs = comparison_pairs(curves[["drafter", "paradigm", "regime", "target_kv"]])
        # a plan's pair that a standard one gives already is not repeated
        known = {(a, b) for _, a, b in pairs}
        pairs += [(f"{a} - {b}", a, b) for a, b in comparisons if {a, b} <= names and (a, b) not in known]
        gaps = gap_by_budget(curves, pairs) if pairs else pd.DataFrame()
        out["gap_by_budget.csv"] = gaps
        out["gap_trends.csv"] = gap_trends(gaps) if not gaps.empty else pd.DataFrame()
    evals = tables["heldout_eval.csv"]
    gates = [c for c in evals.columns if c.startswith("gate_")]
    if gates:
        keep = evals.dropna(subset=gates, how="all")
        out["gate_stats.csv"] = keep[["drafter", "step", *gates]].reset_index(drop=True)
    gens = tables["acceptance_generations.csv"]
    if not gens.empty:  # pairs whose drafters were not both evaluated are left out
        ngram = [("drafter - n-gram", d, "ngram") for d in gens["drafter"].unique() if d != "ngram"]
        known = {(a, b) for _, a, b in pairs}  # a plan's pair between rows without a learning curve, as well
        plan = [(f"{a} - {b}", a, b) for a, b in comparisons if (a, b) not in known]
        other = [(f"{a} - {b}", a, b) for a, b in baseline_pairs]
        out["mat_differences.csv"] = paired_mat_difference(gens, ngram + pairs + plan + other)
    if not points.empty:
        out["convergence.csv"] = convergence_table(points)
    out["reference_table.csv"] = reference_table(tables)
    return out


def _interval(boot: pd.DataFrame, drafter: str, mode: str, temperature: float) -> dict:
    b = boot[(boot["drafter"] == drafter) & (boot["mode"] == mode) & (boot["temperature"] == temperature)]
    return {m["metric"]: (m["value"], m["lo"], m["hi"]) for _, m in b.iterrows()}


def reference_table(tables: dict) -> pd.DataFrame:
    """The paper's Table 5 layout, one line per trained row: MT-bench alpha_0..alpha_6, MAT and retention (chain,
    T=0, with 95% bootstrap intervals, where the evaluation ran), the same from the held-out per-step accuracy, the
    tree and T=1 MATs, what the row saw (unique tokens, token-passes, epochs, precision), how it ended (``stable_phase_*``: the
    old rule's reading of acc_0 at a high learning rate; ``convergence``: whether its annealed curve had converged,
    :func:`~kvshot_lib.training.annealed_plateau`), and the paper's Qwen3-8B line it stands for (``paper_*``)."""
    rows = tables["reference_rows.csv"]
    if rows.empty:
        return pd.DataFrame()
    boot, per_step = tables["acceptance_bootstrap.csv"], tables["per_step_accuracy.csv"]
    points = tables.get("curve_points.csv", pd.DataFrame())
    judged = {
        j["drafter"]: dict(
            convergence=j["verdict"],
            converge_acc_gain=j["acc_gain"],
            converge_ce_gain=j["ce_gain"],
            converge_from_tokens=j["from_tokens"],
            converge_to_tokens=j["to_tokens"],
        )  # fmt: skip
        for j in (convergence_table(points).to_dict("records") if not points.empty else [])
    }
    out = []
    for _, r in rows.iterrows():
        mine = per_step[per_step["drafter"] == r["drafter"]] if not per_step.empty else per_step
        acc = {int(k): float(a) for k, a in zip(mine.get("draft_step", []), mine.get("accuracy", []))}
        rec = dict(drafter=r["drafter"], paper_row=r.get("paper_row", ""))
        chain = _interval(boot, r["drafter"], "chain", 0.0) if not boot.empty else {}
        for k in STEPS:
            rec[f"alpha_{k}"] = chain.get(f"alpha_{k}", (None,))[0]
        for m in ("mat", "retention"):
            value, lo, hi = chain.get(m, (None, None, None))
            rec.update({m: value, f"{m}_lo": lo, f"{m}_hi": hi})
        for mode, t in (("tree", 0.0), ("chain", 1.0)):
            got = _interval(boot, r["drafter"], mode, t).get("mat") if not boot.empty else None
            rec[f"mat_{mode}_t{t:g}"] = got[0] if got else None
        rec.update({f"heldout_acc_{k}": acc.get(k) for k in STEPS})
        rec["heldout_mat"] = heldout_acceptance({f"acc_{k}": v for k, v in acc.items()}) if acc else None
        rec["heldout_retention"] = acc[6] / acc[0] if acc.get(6) is not None and acc.get(0) else None
        stop = r.get("stop_reason")  # empty: the row trained to its cap without the plateau rule stopping it
        rec.update(
            unique_tokens=r.get("unique_tokens"), token_passes=r.get("train_tokens"), epochs=r.get("epochs"),
            steps=r.get("steps_trained"), precision=r.get("precision"), device=r.get("device"),
            seconds=r.get("seconds"), stable_phase_flat=r.get("plateaued"),
            stable_phase_delta=r.get("plateau_delta"),
            stop_reason=stop if isinstance(stop, str) and stop else "the token-pass cap",
            checkpoint=r.get("checkpoint"),
        )  # fmt: skip
        rec.update(judged.get(r["drafter"], dict(convergence="undetermined")))
        paper = PAPER_TABLE5.get(r.get("paper_row") or "")
        for j, name in enumerate([f"alpha_{k}" for k in STEPS] + ["mat", "retention"]):
            rec[f"paper_{name}"] = paper[j] if paper else None
        out.append(rec)
    return pd.DataFrame(out)


def update_run(
    plan, new: dict[str, pd.DataFrame], root: Path = REPO_ROOT, name: str | None = None, draw: bool = True
) -> dict:
    """Merge ``new`` tables (``{table: rows}``, tables of :data:`KEYS`) into the run ``name`` (default: the plan's
    run) under ``root``: rewrite its tables, the derived ones and (``draw``) its figures. Returns what it wrote
    and drew."""
    name = name or getattr(plan, "run_name", plan.profile)
    root = Path(root)
    data_dir, results = root / "figures" / name / "data", root / "runs" / name / "results"
    results.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    # two rows trained side by side must not drop each other's rows
    with _exclusive(results / ".update.lock"):
        return _merge_and_write(plan, new, data_dir, results, root / "figures" / name, draw)


@contextlib.contextmanager
def _exclusive(path: Path):
    """Hold an exclusive lock on ``path`` (POSIX; elsewhere no lock: run one process at a time there)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _merge_and_write(plan, new: dict, data_dir: Path, results: Path, figure_dir: Path, draw: bool) -> dict:
    tables = {t: _read(data_dir, t) for t in KEYS}
    for t, df in new.items():
        tables[t] = replace_rows(tables[t], df, KEYS[t])
    for t, size in BLOCKED.items():
        tables[t] = step_blocks(tables[t], size)
    for t, digits in ROUNDED.items():
        tables[t] = significant(tables[t], digits)
    tables.update(derived_tables(tables, getattr(plan, "comparisons", ()), plan.baseline_pairs()))
    written = []
    for t, df in tables.items():
        if df.empty:
            continue
        df.to_csv(results / t, index=False)
        df.to_csv(data_dir / t, index=False)  # the merged state: the next update starts from data/
        written.append(t)
    figures = _publish(plan, tables, results, figure_dir) if draw else []
    return dict(tables=written, figures=figures)


def step_blocks(history: pd.DataFrame, size: int) -> pd.DataFrame:
    """``history``'s per-step rows as one row per drafter and ``size`` consecutive optimizer steps (steps 1..size,
    size+1..2 size, ...): the block's last ``step``, ``lr``, ``seconds`` and ``epoch``, its summed ``tokens``, the mean
    of every other number, and ``steps``, how many optimizer steps the row holds. Rows that already hold their
    ``steps`` pass through, so that applying it again changes nothing."""
    if history.empty or "step" not in history:
        return history
    raw = history["steps"].isna() if "steps" in history else pd.Series(True, index=history.index)
    per_step = history[raw].drop(columns=["steps"], errors="ignore")
    if per_step.empty:
        return history
    numbers = per_step.select_dtypes("number").columns
    how = {c: "last" if c in LAST_IN_BLOCK else "sum" if c == "tokens" else "mean" for c in numbers}
    how.update({c: "first" for c in per_step.columns if c not in numbers and c != "drafter"})
    blocks = (
        per_step.sort_values(["drafter", "step"], kind="stable")
        .assign(steps=1, _block=lambda d: (d["step"] - 1) // size)
        .groupby(["drafter", "_block"], sort=False)
        .agg({**how, "steps": "sum"})
        .reset_index()
        .drop(columns="_block")[[*per_step.columns, "steps"]]
    )
    return pd.concat([history[~raw], blocks], ignore_index=True)


def significant(df: pd.DataFrame, digits: int) -> pd.DataFrame:
    """``df`` with its float columns rounded to ``digits`` significant digits (rounding again changes nothing)."""
    out = df.copy()
    for c in out.select_dtypes("float").columns:
        out[c] = out[c].map(lambda v: float(f"{v:.{digits}g}"))
    return out


def _read(folder: Path, name: str) -> pd.DataFrame:
    path = Path(folder) / name
    try:
        return pd.read_csv(path) if path.is_file() else pd.DataFrame()
    except pd.errors.EmptyDataError:
        return pd.DataFrame()


def caption(plan, tables: dict) -> str:
    """The caption line of every figure: target, data (unique tokens, token-passes per drafter), precision."""
    rows, jobs = tables["reference_rows.csv"], tables["reference_jobs.csv"]
    bits = [f"{plan.target} · {plan.run_name} run"]
    if "unique_tokens" in rows and rows["unique_tokens"].notna().any():
        regenerated = "responses" in rows and str(rows["responses"].iloc[0]).startswith("regenerated")
        answers = " answered by the target" if regenerated else ""
        bits.append(f"ShareGPT V3{answers}, {_span(rows['unique_tokens'])} unique training tokens")
    if "train_tokens" in rows and len(rows):
        bits.append(f"{_span(rows['train_tokens'])} token-passes per drafter")
    if "precision" in rows and rows["precision"].notna().any():
        gpus = {str(g) for g in jobs.get("gpu", []) if isinstance(g, str) and g and g != "cpu"}
        cpus = {str(c) for c in rows.get("cpu", []) if isinstance(c, str) and c}
        where = sorted(gpus) or sorted(cpus) or ["CPU"]
        bits.append(f"{'/'.join(sorted(set(rows['precision'].dropna())))} on {', '.join(where)}")
    return " · ".join(bits)


def _span(values: pd.Series) -> str:
    """``lo–hi`` of a count column (one number where all agree)."""
    lo, hi = int(values.min()), int(values.max())
    return f"{lo:,}{f'–{hi:,}' if hi != lo else ''}"


def _publish(plan, tables: dict, results: Path, figure_dir: Path) -> list[str]:
    import matplotlib.pyplot as plt

    from .. import plots

    context = caption(plan, tables)
    drawn = []
    for fig, needs in FIGURES.items():
        if all(t in tables and not tables[t].empty for t in needs):
            plt.close(plots.publish(fig, results, figure_dir, context))
            drawn.append(fig)
    return drawn
