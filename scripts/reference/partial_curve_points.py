"""Learning-curve points of reference rows that are still training (or were stopped), beside finished rows.

A row of the reference run logs an annealed learning-curve point at each budget of its plan (cap/32, cap/16,
...; WSD decay branches, ``training/schedule.py``). The data order and the stable-phase learning rate are
functions of the step, so the points a row has logged when it is stopped are the points the full row would
log at those budgets. This reads them from the row's saved state (``runs/<run>/drafters/<row>/state/``, or its
carried position ``checkpoints/<run>/<row>.partial/`` where that is further along, ``training/carry.py``;
once the row finished, its logs),
tables them like notebook 02 (:func:`~kvshot_lib.evaluation.curve_table`), and compares them at equal budgets
with any other row, saved or committed (``figures/<run>/data/learning_curves.csv``)::

    python scripts/reference/partial_curve_points.py --rows kv-ttt-tinit /tmp/ctl:kv-ttt --against kv-ttt \
        --out figures/reference/data/partial/kv-ttt-tinit_curve.csv

A later stretch of a row whose control's state is gone keeps the control's points and held-out evaluations
from the earlier tables (``--keep figures/reference/data/partial/kv-ttt-tinit_curve.csv``, and the
``_heldout.csv`` beside it).

A row is ``NAME`` (trained in this checkout's ``runs/``) or ``ROOT:NAME`` (a run started with ``--root ROOT``,
e.g. a control row trained beside a committed one of the same name).
Prints the points and the gaps (:func:`~kvshot_lib.evaluation.gap_by_budget`, 95% normal intervals), then the
held-out acc_0 of every evaluation so far (every ``eval_every`` steps, at the stable learning rate) beside the
``--against`` rows' at the same steps; ``--out`` writes the tables (``X.csv``, ``X_gaps.csv``,
``X_heldout.csv``, ``X_convergence.csv``: the convergence rule over the points so far, and ``X_points.csv``: its
inputs, each point's held-out acc_0 and cross-entropy with their standard errors, and ``X_progress.csv``: per stretch
between restarts from a carried position, the steps, seconds and token-passes, the rate of the plain steps and
the machine); ``--stopped`` adds
the points of rows that will train no further to ``figures/<run>/data/stopped_curves.csv``, which ``kvshot figures`` draws beside the finished rows' learning
curves (``02_learning_curves``). A label ``row@here`` names a row trained on this machine whose name is also a
committed row's and which has not finished.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from kvshot_lib.evaluation import curve_table, gap_by_budget
from kvshot_lib.reference import carried_folder, load_plan
from kvshot_lib.target import REPO_ROOT, machine_record, resolve_precision
from kvshot_lib.training import (
    MACHINE_COLS,
    by_stretch,
    carried_ahead,
    convergence_table,
    finished_extra,
    known_machines,
    read_carried,
    read_logs,
    read_train_state,
    se_acc,
    se_ce,
    stretches,
)


def finished_state(out_dir: Path) -> dict | None:
    """A finished row's config, logs and last step in a saved state's form (finishing removes the state), with
    the machine that finished it; None if no row finished there."""
    extra = finished_extra(out_dir)
    if extra is None:
        return None
    logs = read_logs(out_dir)
    return dict(
        config=extra["train_config"],
        logs=logs,
        step=int(logs["history"][-1]["step"]),
        machine=extra.get("machine"),
    )


def saved_points(run_dir: Path, row: str, label: str) -> dict[str, pd.DataFrame]:
    """The tables of row ``row``'s saved state, by the name ``--out`` gives them: ``curve`` (the points logged so
    far, as a ``curve_table``), ``heldout`` (its held-out evaluations, every ``eval_every`` steps at the stable
    learning rate), ``convergence`` (the rule's verdict over the points, :func:`~kvshot_lib.training.convergence_table`,
    at the row's ``converge_z``), ``points`` (the rule's inputs: each point's held-out acc_0 and cross-entropy with
    their standard errors) and ``progress`` (per stretch, :func:`stretches`)."""
    meta = read_train_state(run_dir / "drafters" / row) or finished_state(run_dir / "drafters" / row)
    carried = carried_folder(run_dir.parent.parent / "checkpoints" / run_dir.name / row)
    carried_meta = read_carried(carried) if carried_ahead(carried, meta) else None
    meta = carried_meta or meta
    if meta is None:
        raise SystemExit(
            f"no saved state for {row!r} under {run_dir / 'drafters'} nor {carried}: is it training?"
        )
    cfg = meta["config"]
    # a state is this machine's; a finished row names the machine that finished it
    machine = meta.get("machine") or machine_record(resolve_precision(cfg["mixed_precision"], "cpu"))
    label_cols = dict(
        drafter=label,
        paradigm=cfg["paradigm"],
        regime=cfg["regime"],
        target_kv=cfg.get("target_kv", "real"),
        **{k: machine.get(k) for k in MACHINE_COLS},
    )
    curve = pd.DataFrame(meta["logs"]["curve"]).assign(**label_cols)
    evals = pd.DataFrame(meta["logs"].get("eval", [])).assign(**label_cols)
    print(f"{label}: step {meta['step']} saved, {len(curve)} curve points, {len(evals)} held-out evaluations")
    # NaN in states from before these were logged; the standard errors are the rule's own
    logged = curve.reindex(columns=["ce_0", "branch_steps"])
    points = curve.to_dict("records")
    inputs = curve[["drafter", "budget_step", "tokens", "n_0", "acc_0"]].assign(
        branch_steps=logged["branch_steps"],
        ce_0=logged["ce_0"],
        acc_se_0=[se_acc(p) for p in points],
        ce_se_0=[se_ce(p) if pd.notna(p.get("ce_0")) else None for p in points],
        saved_step=meta["step"],
    )
    here = {k: label_cols[k] for k in MACHINE_COLS} if meta is not carried_meta else {}
    progress = pd.DataFrame(
        [
            {**label_cols, **stretch, "saved_step": meta["step"], "train_steps": cfg.get("train_steps")}
            for stretch in stretches(meta["logs"], here)
        ]
    )
    return dict(
        curve=curve_table(curve).assign(saved_step=meta["step"], train_steps=cfg.get("train_steps")),
        heldout=evals,
        convergence=convergence_table(curve, z=cfg.get("converge_z") or 2.0).assign(saved_step=meta["step"]),
        points=inputs,
        progress=progress,
    )


def beside(table: Path, name: str) -> Path:
    """The table written beside an ``--out`` table ``X.csv``: ``X_<name>.csv``."""
    return table.with_name(f"{table.stem}_{name}.csv")


def with_new_drafters(df: pd.DataFrame, earlier: pd.DataFrame) -> pd.DataFrame:
    """``df`` and the rows of ``earlier`` whose drafter ``df`` does not have."""
    return pd.concat([df, earlier[~earlier["drafter"].isin(df["drafter"])]], ignore_index=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="reference")
    ap.add_argument("--rows", nargs="+", required=True, help="rows with a saved state on this machine")
    ap.add_argument("--against", nargs="*", default=[], help="committed rows to compare with")
    ap.add_argument("--out", default=None, help="write the points and gaps here (CSV, gaps beside it)")
    ap.add_argument(
        "--keep",
        default=None,
        help="an earlier --out table: its rows not given in --rows (their states are gone) are kept beside them",
    )
    ap.add_argument(
        "--stopped",
        default=None,
        help="these rows train no further: add their points to this table (figures/<run>/data/stopped_curves.csv "
        "is drawn beside the finished rows' as 02_learning_curves)",
    )
    args = ap.parse_args()
    plan = load_plan(args.run)
    data = REPO_ROOT / "figures" / plan.run_name / "data"
    committed = pd.read_csv(data / "learning_curves.csv")
    where = {r.rpartition(":")[2]: Path(r.rpartition(":")[0] or REPO_ROOT) for r in args.rows}
    run_dirs = {r: root / "runs" / plan.run_name for r, root in where.items()}
    # a row that finished here is the committed row of its name (finishing commits its tables), not beside it
    labels = {
        r: (f"{r}@here" if r in set(committed["drafter"]) and not finished_extra(d / "drafters" / r) else r)
        for r, d in run_dirs.items()
    }
    states = [saved_points(d, r, labels[r]) for r, d in run_dirs.items()]
    saved = {k: pd.concat([t[k] for t in states], ignore_index=True) for k in states[0]}
    keep = Path(args.keep) if args.keep else None
    if keep and beside(keep, "progress").is_file():
        saved["progress"] = known_machines(saved["progress"], pd.read_csv(beside(keep, "progress")))
    here = by_stretch(saved["curve"], saved["progress"], "budget_step")
    verdicts = saved["convergence"]
    heldout = pd.read_csv(data / "heldout_eval.csv")
    heldout = pd.concat(
        [by_stretch(saved["heldout"], saved["progress"], "step")]
        + [heldout[heldout["drafter"].isin(args.against)]]
    )
    if keep:
        here = with_new_drafters(here, pd.read_csv(keep))
        if beside(keep, "heldout").is_file():
            heldout = with_new_drafters(heldout, pd.read_csv(beside(keep, "heldout")))
    names = list(here["drafter"].unique())
    table = pd.concat([here, committed[committed["drafter"].isin(args.against)]], ignore_index=True)
    pairs = [("partial", a, b) for a in names for b in args.against]
    pairs += [("partial", a, b) for a in names for b in names if a < b]
    gaps = gap_by_budget(table, pairs)
    cols = ["drafter", "budget_step", "tokens", "metric", "value", "lo", "hi", "precision", "bf16_isa"]
    print(table[cols].to_string(index=False, float_format="%.4f"))
    if gaps.empty:
        print("no budget in common with the rows compared: no gaps yet")
    else:
        gap_cols = ["drafter", "minus", "metric", "tokens", "gap", "lo", "hi"]
        print(gaps[gap_cols].to_string(index=False, float_format="%+.4f"))
    acc0 = heldout.pivot_table(index="step", columns="drafter", values="acc_0")
    last = heldout.loc[heldout["drafter"].isin(names), "step"].max()  # as far as the saved rows have come
    print(acc0[acc0.index <= last].to_string(float_format="%.4f"))
    # the annealed points, with cross-entropy, and the rate so far
    print(saved["points"].to_string(index=False, float_format="%.4f"))
    print(saved["progress"].to_string(index=False, float_format="%.2f"))
    print(verdicts.to_string(index=False, float_format="%.4f"))  # the convergence rule over the points so far
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        here.to_csv(out, index=False)
        if not gaps.empty:  # no budget in common: no table (an empty one would have no header)
            gaps.to_csv(beside(out, "gaps"), index=False)
        heldout.to_csv(beside(out, "heldout"), index=False)
        verdicts.to_csv(beside(out, "convergence"), index=False)
        for name in ("points", "progress"):
            saved[name].to_csv(beside(out, name), index=False)
    if args.stopped:
        table = Path(args.stopped)
        earlier = pd.read_csv(table) if table.is_file() else here.iloc[:0]
        with_new_drafters(here, earlier).to_csv(table, index=False)
        print(f"{', '.join(names)}: stopped, points written to {table}")


if __name__ == "__main__":
    main()
