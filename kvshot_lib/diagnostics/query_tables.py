"""The saved tables of query-estimation error, built from :class:`~.query_error.SequenceErrors` one sequence
at a time, and the verdict against the stale query.

* ``by_step``: one row per drafter, estimator, level (head / group), sink variant, sequence and draft step:
  metric means over the head pairs and anchors of that sequence (the unit the bootstrap resamples);
* ``by_head``: per (drafter layer, target layer, head) and step, means over every sequence and anchor; at
  head level ``matched`` marks, for a drafter whose one query serves a whole GQA group, the group's head its
  attention matches best (lowest mean ``out_err``), which the causal check substitutes;
* ``vs_acceptance``: per sequence and step, means over the steps the drafter got right (``accepted``) and wrong;
* ``positions``: every anchor of the first few sequences, for the attention explorer.

:func:`stale_verdict` is the test the issue asks for: the drafter's error minus the stale query's, paired by
sequence, with a 95% bootstrap interval, per step and over all steps.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from ..evaluation.bootstrap import mean_ci, two_sided_p
from . import attention_metrics as am
from .query_error import ESTIMATORS, EXTRA, VARIANTS, SequenceErrors

METRIC_COLUMNS = (*am.METRICS, *EXTRA)
LEVELS = ("head", "group")


def _nanmean(x: torch.Tensor, dims) -> tuple[torch.Tensor, torch.Tensor]:
    ok = ~torch.isnan(x)
    n = ok.sum(dims)
    return torch.where(ok, x, 0).sum(dims) / n.clamp(min=1) + torch.where(n > 0, 0, float("nan")), n


class QueryErrorTables:
    """Accumulates the sequences of one drafter; ``labels`` (drafter, paradigm, regime, kv_mode) go on every row."""

    def __init__(self, labels: dict, n_position_sequences: int = 1):
        self.labels = labels
        self.n_position_sequences = n_position_sequences
        self._step, self._acc, self._pos = [], [], []
        self._sums: dict = {}
        self._index: dict = {}

    def add(self, se: SequenceErrors) -> None:
        for level in LEVELS:
            data = getattr(se, level)
            for variant in VARIANTS:
                for e, est in enumerate(ESTIMATORS):
                    base = dict(
                        **self.labels, estimator=est, level=level, variant=variant, sequence=se.seq_id
                    )
                    stack = {m: data[variant][m][e] for m in METRIC_COLUMNS}  # [P, K, A]
                    self._by_step_rows(base, stack, se)
                    self._accumulate(level, variant, est, stack, se)
                    if level == "head":
                        self._accept_rows(base, stack, se)
        if len({r["sequence"] for r in self._pos}) < self.n_position_sequences:
            self._position_rows(se)

    def _by_step_rows(self, base, stack, se) -> None:
        K = se.valid.shape[0]
        means = {m: _nanmean(x, (0, 2)) for m, x in stack.items()}  # [K]
        for k in range(K):
            n = int(se.valid[k].sum()) * stack["out_err"].shape[0]
            if n:
                self._step.append(
                    {**base, "step": k, "n": n, **{m: float(v[0][k]) for m, v in means.items()}}
                )

    def _accept_rows(self, base, stack, se) -> None:
        for k in range(se.valid.shape[0]):
            for accepted in (True, False):
                sel = se.valid[k] & (se.accepted[k] == accepted)  # [A]
                if not bool(sel.any()):
                    continue
                row = {**base, "step": k, "accepted": accepted, "n": int(sel.sum())}
                row.update({m: float(_nanmean(x[:, k, sel], (0, 1))[0]) for m, x in stack.items()})
                self._acc.append(row)

    def _accumulate(self, level, variant, est, stack, se) -> None:
        key = (level, variant, est)
        self._index[level] = se.pairs if level == "head" else se.groups
        sums = {m: torch.where(torch.isnan(x), 0, x).sum(-1) for m, x in stack.items()}  # [P, K]
        counts = {m: (~torch.isnan(x)).sum(-1) for m, x in stack.items()}
        if key not in self._sums:
            self._sums[key] = (sums, counts)
        else:
            old_s, old_c = self._sums[key]
            self._sums[key] = (
                {m: old_s[m] + sums[m] for m in sums},
                {m: old_c[m] + counts[m] for m in counts},
            )

    def _position_rows(self, se) -> None:
        for level in LEVELS:
            index = se.pairs if level == "head" else se.groups
            for variant in VARIANTS:
                data = getattr(se, level)[variant]
                for e, est in enumerate(ESTIMATORS):
                    for c, ident in enumerate(index):
                        for k in range(se.valid.shape[0]):
                            for a in torch.nonzero(se.valid[k]).flatten().tolist():
                                row = dict(**self.labels, estimator=est, level=level, variant=variant)
                                row.update(sequence=se.seq_id, anchor=int(se.anchors[a]), step=k)
                                row.update(_ident(level, ident))
                                row["accepted"] = bool(se.accepted[k, a])
                                row.update({m: float(data[m][e, c, k, a]) for m in METRIC_COLUMNS})
                                self._pos.append(row)

    def by_step(self) -> pd.DataFrame:
        return pd.DataFrame(self._step)

    def vs_acceptance(self) -> pd.DataFrame:
        return pd.DataFrame(self._acc)

    def positions(self) -> pd.DataFrame:
        return pd.DataFrame(self._pos)

    def by_head(self) -> pd.DataFrame:
        rows = []
        for (level, variant, est), (sums, counts) in self._sums.items():
            for c, ident in enumerate(self._index[level]):
                K = sums["out_err"].shape[1]
                for k in range(K):
                    n = int(counts["out_err"][c, k])
                    if not n:
                        continue
                    row = dict(
                        **self.labels, estimator=est, level=level, variant=variant, **_ident(level, ident)
                    )
                    row.update(step=k, n=n)
                    for m in METRIC_COLUMNS:
                        row[m] = float(sums[m][c, k]) / int(counts[m][c, k]) if counts[m][c, k] else np.nan
                    rows.append(row)
        table = pd.DataFrame(rows)
        return mark_matched(table) if len(table) else table


def _ident(level: str, ident: tuple) -> dict:
    if level == "head":
        dl, layer, head, kv, a = ident
        return dict(drafter_layer=dl, layer=layer, head=head, kv_head=kv, drafter_head=a)
    dl, layer, kv = ident
    return dict(drafter_layer=dl, layer=layer, head=-1, kv_head=kv, drafter_head=-1)


def mark_matched(by_head: pd.DataFrame) -> pd.DataFrame:
    """``matched``: per drafter query head, the target head (among those it stands for) whose attention its
    own matches best (lowest mean ``out_err`` over steps, with the sink). With one drafter query per target
    head that is its own head; with one per GQA group it is the head the causal check substitutes."""
    t = by_head.copy()
    sel = (t["estimator"] == "drafter") & (t["level"] == "head") & (t["variant"] == "with_sink")
    keys = ["drafter", "drafter_layer", "drafter_head"]
    mean = t[sel].groupby([*keys, "layer", "head"])["out_err"].mean().reset_index()
    best = mean.loc[mean.groupby(keys)["out_err"].idxmin()]
    chosen = set(best[["drafter", "drafter_layer", "layer", "head"]].itertuples(index=False, name=None))
    t["matched"] = [
        r.level == "head" and (r.drafter, r.drafter_layer, r.layer, r.head) in chosen for r in t.itertuples()
    ]
    return t


def stale_verdict(
    by_step: pd.DataFrame, metric: str = "out_err", seed: int = 0, n_boot: int = 2000
) -> pd.DataFrame:
    """Per drafter, level, variant and step (and ``step = -1``: all steps): the mean over sequences of the
    drafter's ``metric`` minus the stale query's on the same sequence, its 95% bootstrap interval and p-value,
    both means, and ``beats_stale`` (the interval lies below 0)."""
    rows = []
    keys = ["drafter", "level", "variant"]
    sub = by_step[by_step["estimator"].isin(["drafter", "stale"])]
    for key, d in sub.groupby(keys):
        wide = d.pivot_table(index="sequence", columns=["estimator", "step"], values=metric)
        if "drafter" not in wide or "stale" not in wide:
            continue
        diff = wide["drafter"] - wide["stale"]  # [sequences, steps]
        steps = list(diff.columns)
        values = np.column_stack([diff.to_numpy(), diff.mean(axis=1).to_numpy()])
        est, lo, hi, draws = mean_ci(values, n_boot, seed)
        p = two_sided_p(draws)
        drafter = [*wide["drafter"].mean().reindex(steps), wide["drafter"].mean(axis=1).mean()]
        stale = [*wide["stale"].mean().reindex(steps), wide["stale"].mean(axis=1).mean()]
        for c, step in enumerate([*steps, -1]):
            rows.append(
                dict(
                    zip(keys, key),
                    metric=metric,
                    step=step,
                    n_sequences=int(np.isfinite(values[:, c]).sum()),
                    drafter_mean=float(drafter[c]),
                    stale_mean=float(stale[c]),
                    diff=float(est[c]),
                    ci_lo=float(lo[c]),
                    ci_hi=float(hi[c]),
                    p_value=float(p[c]),
                    beats_stale=bool(hi[c] < 0),
                )
            )
    return pd.DataFrame(rows)


def kv_reading_drafters(run_dir, target) -> tuple[dict, str]:
    """The trained drafters under ``<run_dir>/drafters/`` that read the target's real KV cache, and a note
    naming what was left out (hidden-only drafters, zeroed-KV controls)."""
    from ..drafters import drafters_for_run

    found, _ = drafters_for_run(run_dir, target, baselines=[])
    # the block drafter reads the KV too, but drafts a whole block in one forward: its queries at step k are
    # not an unrolled step's, which is what the measurement follows; it is left out (and named in the note)
    keep = {
        n: d
        for n, d in found.items()
        if d.cfg.uses_target_kv and d.cfg.target_kv == "real" and d.cfg.paradigm != "block"
    }
    skipped = sorted(set(found) - set(keep))
    if not keep:
        raise FileNotFoundError(
            f"no KV-reading drafter under {run_dir}/drafters/ (found: {sorted(found) or 'none'}). Run notebook 02 "
            "with a kv or hybrid drafter first, e.g. kvshot run --only 02 --set 'drafters=[{paradigm: kv, regime: ttt}]'."
        )
    note = f"KV-reading drafters: {', '.join(keep)}" + (
        f"; left out (no real target KV, or a block drafter): {', '.join(skipped)}" if skipped else ""
    )
    return keep, note


def measure_drafters(
    target,
    drafters: dict,
    refs,
    n_steps: int,
    max_anchors: int | None = None,
    n_position_sequences: int = 1,
    progress: bool = True,
):
    """Every drafter on every reference (an MT-bench turn with the target's greedy answer).

    Returns the tables (``by_step``, ``by_head``, ``vs_acceptance``, ``positions``) and, per drafter, the
    :class:`SequenceErrors` of the first reference with its attention maps (for the attention explorer)."""
    from tqdm.auto import tqdm

    from .causal_check import sequence_id
    from .query_error import measure_sequence

    frames: dict[str, list] = {"by_step": [], "by_head": [], "vs_acceptance": [], "positions": []}
    maps = {}
    for name, drafter in drafters.items():
        cfg = drafter.cfg
        acc = QueryErrorTables(
            dict(drafter=name, paradigm=cfg.paradigm, regime=cfg.regime, kv_mode=cfg.kv_mode),
            n_position_sequences,
        )
        for i, ref in enumerate(tqdm(refs, desc=f"query error: {name}", disable=not progress)):
            ids = torch.tensor(ref.prompt_ids + ref.greedy_ids)
            se = measure_sequence(
                target,
                drafter,
                ids,
                len(ref.prompt_ids),
                n_steps,
                sequence_id(ref),
                max_anchors,
                keep_maps=i == 0,
            )
            acc.add(se)
            if i == 0:
                maps[name] = se
        for key in frames:
            frames[key].append(getattr(acc, key)())
    tables = {key: pd.concat(v, ignore_index=True) for key, v in frames.items()}
    return tables, maps


HEADLINE = ("out_err", "kl_bits", "js_bits", "recall@4", "cosine", "unavailable_mass")


def figure_tables(tables: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """The slices of the full tables the figures draw, small enough to keep beside them in git:

    * ``query_error_by_sequence.csv``: head level, per sequence and step, the headline metrics;
    * ``query_error_accepted.csv``: the drafter's and the stale query's ``out_err`` (sink kept) at the
      steps the drafter got right and wrong, per sequence."""
    keys = ["drafter", "paradigm", "estimator", "variant", "sequence", "step", "n"]
    by_step = tables["by_step"]
    by_seq = by_step[by_step["level"] == "head"][[*keys, *HEADLINE]]
    acc = tables["vs_acceptance"]
    acc = acc[(acc["variant"] == "with_sink") & acc["estimator"].isin(["drafter", "stale"])]
    return {
        "query_error_by_sequence.csv": by_seq.reset_index(drop=True),
        "query_error_accepted.csv": acc[[*keys, "accepted", "out_err"]].reset_index(drop=True),
    }
