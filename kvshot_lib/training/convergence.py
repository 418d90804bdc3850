"""When to stop training, and whether it had converged: early stopping on held-out acceptance, the plateau.

* :func:`heldout_acceptance` turns a held-out evaluation (per-step accuracies ``acc_k`` with the ground-truth
  prefix, a proxy for the conditional acceptance alpha_k) into the expected accepted tokens per cycle of a
  chain as deep as the evaluation, ``1 + sum_k prod_{j<=k} acc_j`` (the MAT formula of the paper's Table 5).
* :class:`EarlyStopping` stops after ``patience`` evaluations without a better acceptance and remembers the
  best state: acceptance, not loss, decides (DeepSpec saw acceptance peak while the loss kept falling).
* :class:`Stopping` is what the loop asks at every step: where the WSD decay starts (the plateau rule), whether
  this step is the last (the run's end, early stopping, the ``max_seconds`` cap) and why the run stopped.
* :func:`plateau` says whether the last ``fraction`` of training moved held-out ``acc_0`` by under ``tol``
  (the reference run's convergence criterion: the last 20% moves it by under 1 point).
* :func:`annealed_plateau` is what "converged" means here: over the last doubling of token-passes, the
  *annealed* held-out curve (the decay branches' points, ``schedule.py``) gained less than ``z`` standard errors
  in acc_0 *and* in cross-entropy. :func:`plateau` reads acc_0 in the stable phase, where the learning rate is
  high and a flat stretch is noise around a still-falling loss; it is kept as the record of the old rule, and
  ``converge_z`` makes the new one end a run (:class:`Stopping`). :func:`convergence_table` judges saved curves.
* :func:`run_summary` is the per-row report: tokens seen, wall time, final accuracies, plateau, stopping.

``tests/test_reference.py`` checks these on hand-made evaluation logs, ``tests/test_convergence.py`` the
annealed rule on hand-made curves (one still falling in cross-entropy, one flat, one noisy).
"""

from __future__ import annotations

import math
import time

import pandas as pd
import torch

from ..drafters.trainable import TrainableDrafter
from ..target import repo_relative
from .schedule import decay_start, run_end


def heldout_acceptance(ev: dict, metric: str = "mat") -> float:
    """``acc_0``, or ``1 + sum_k prod_{j<=k} acc_j`` over the evaluated steps (``metric="mat"``)."""
    if metric == "acc_0":
        return float(ev["acc_0"])
    steps = sorted(int(k[4:]) for k in ev if k.startswith("acc_") and k[4:].isdigit())
    total, reach = 1.0, 1.0
    for k in steps:
        reach *= float(ev[f"acc_{k}"])
        total += reach
    return total


class EarlyStopping:
    """Tracks the best held-out acceptance; ``update`` returns True when ``patience`` evaluations in a row did
    not improve on it (by more than ``min_delta``). ``best_state`` is a CPU copy of the best parameters."""

    def __init__(self, patience: int, metric: str = "mat", min_delta: float = 0.0):
        self.patience, self.metric, self.min_delta = patience, metric, min_delta
        self.best_value = float("-inf")
        self.best_step = 0
        self.best_state: dict | None = None
        self.best_eval: dict = {}
        self.bad_evals = 0

    def update(self, step: int, ev: dict, drafter: TrainableDrafter | None = None) -> bool:
        value = heldout_acceptance(ev, self.metric)
        if value > self.best_value + self.min_delta:
            self.best_value, self.best_step, self.bad_evals, self.best_eval = value, step, 0, dict(ev)
            if drafter is not None and self.patience:
                self.best_state = {
                    k: v.detach().to("cpu", copy=True) for k, v in drafter.state_dict().items()
                }
            return False
        self.bad_evals += 1
        return bool(self.patience) and self.bad_evals >= self.patience

    def state_dict(self) -> tuple[dict, dict]:
        """What a resumed run needs to take the same decisions: (the counters and the best evaluation, JSON;
        the best parameters, tensors). Saved with the training state (:mod:`.state`)."""
        meta = dict(
            best_value=self.best_value,
            best_step=self.best_step,
            best_eval=self.best_eval,
            bad_evals=self.bad_evals,
            has_best_state=self.best_state is not None,
        )
        return meta, dict(self.best_state or {})

    def load_state_dict(self, meta: dict, best_state: dict) -> None:
        """Restore what :meth:`state_dict` gave (patience, metric and min_delta come from the config)."""
        self.best_value, self.best_step = float(meta["best_value"]), int(meta["best_step"])
        self.best_eval, self.bad_evals = dict(meta["best_eval"]), int(meta["bad_evals"])
        self.best_state = {k: v.cpu() for k, v in best_state.items()} if meta["has_best_state"] else None

    def restore(self, drafter: TrainableDrafter) -> bool:
        """Load the best state into ``drafter`` (True if there was one to load)."""
        if self.best_state is None:
            return False
        device = next(iter(drafter.state_dict().values())).device
        with torch.no_grad():
            drafter.load_state_dict({k: v.to(device) for k, v in self.best_state.items()}, strict=True)
        return True


class Stopping:
    """When a run stops, as the loop asks it: the plateau rule (``plateau_stop``) ends the stable phase at
    :attr:`decay_from` (a function of the evaluation log, so a resumed run decides at the same step), early
    stopping (:attr:`early`, saved with the training state) ends the run, and so does ``max_seconds``."""

    def __init__(self, cfg):
        self.cfg, self.early = cfg, EarlyStopping(cfg.early_stop_patience, cfg.early_stop_metric)
        self.decay_from: int | None = None
        self.early_stopped = self.out_of_time = self.converged = False

    @property
    def end(self) -> int:
        return run_end(self.cfg, self.decay_from)

    def follow_plateau(self, evals: list[dict]) -> None:
        """End the stable phase at the first evaluation where the plateau rule holds."""
        if self.cfg.plateau_stop and self.decay_from is None:
            self.decay_from = plateau_step(evals, self.cfg.plateau_stop, min_step=self.cfg.plateau_min_steps)

    def follow_curve(self, curve: list[dict]) -> None:
        """End the stable phase at the first decay branch whose annealed point has converged (``converge_z``)."""
        if self.cfg.converge_z and self.decay_from is None:
            self.decay_from = converged_budget(curve, self.cfg.converge_z)
            self.converged = self.decay_from is not None

    def is_last(self, step: int, t_start: float, acc) -> bool:
        """Whether step ``step`` (0-based) ends the run: its end, or the time cap (the same on every process)."""
        if self.cfg.max_seconds is not None:
            late = time.perf_counter() - t_start > self.cfg.max_seconds
            if acc.num_processes > 1:
                late = bool(acc.reduce(torch.tensor([float(late)], device=acc.device), "max").item())
            self.out_of_time = late
        return step == self.end - 1 or self.out_of_time

    def evaluated(self, evals: list[dict], drafter: TrainableDrafter, last: bool) -> bool:
        """After the held-out evaluation ``evals[-1]``: the plateau rule, then early stopping (which keeps the
        best drafter); whether the run ends at this step."""
        if not last:
            self.follow_plateau(evals)
        self.early_stopped = self.early.update(evals[-1]["step"], evals[-1], drafter) and not last
        return last or self.early_stopped

    def finish(self, drafter: TrainableDrafter, evals: list[dict], steps: int) -> dict:
        """Why the run stopped, for its checkpoint; under early stopping, the best drafter is put back and its
        evaluation appended to ``evals`` as that of step ``steps``."""
        c, early, reason = self.cfg, self.early, ""
        if self.early_stopped:
            reason = f"no better held-out {c.early_stop_metric} in {c.early_stop_patience} evaluations"
        elif self.out_of_time:
            reason = f"max_seconds={c.max_seconds} reached"
        elif self.converged:
            reason = (
                f"converged: the annealed held-out acc_0 and cross-entropy gained < {c.converge_z} standard errors "
                f"over a doubling of token-passes, at the branch of step {self.decay_from}"
            )
        elif self.decay_from is not None:
            reason = f"plateau: held-out acc_0 moved < {c.plateau_stop} over the last quarter by step {self.decay_from}"
        record = dict(stopped_early=bool(reason), stop_reason=reason, best_step=early.best_step or None)
        if c.early_stop_patience and early.best_step != evals[-1]["step"] and early.restore(drafter):
            evals.append(dict(early.best_eval, step=steps, restored_from_step=early.best_step))
        return record


def plateau(evals: list[dict], fraction: float = 0.2, tol: float = 0.01, metric: str = "acc_0") -> dict:
    """How much held-out ``metric`` moved over the last ``fraction`` of the steps trained.

    Compares the last evaluation with the latest one at or before ``(1 - fraction)`` of the last step.
    ``plateaued`` is None when no evaluation lies that early (too few evaluations to tell)."""
    rows = [r for r in evals if metric in r and r.get("step") is not None and not _restored(r)]
    rows = sorted(rows, key=lambda r: r["step"])
    if not rows:
        return dict(plateau_delta=None, plateaued=None, plateau_from_step=None, plateau_to_step=None)
    last = rows[-1]
    cut = (1 - fraction) * last["step"]
    early = [r for r in rows[:-1] if r["step"] <= cut]
    if not early:
        return dict(plateau_delta=None, plateaued=None, plateau_from_step=None, plateau_to_step=last["step"])
    delta = float(last[metric]) - float(early[-1][metric])
    return dict(
        plateau_delta=delta,
        plateaued=abs(delta) < tol,
        plateau_from_step=early[-1]["step"],
        plateau_to_step=last["step"],
    )


def plateau_step(
    evals: list[dict], tol: float, fraction: float = 0.25, min_evals: int = 4, min_step: int = 0
) -> int | None:
    """The step of the first held-out evaluation at which acc_0 had moved by less than ``tol`` over the last
    ``fraction`` of the steps (:func:`plateau`), among runs of at least ``min_evals`` evaluations and at steps
    from ``min_step`` on; None if none has. Training to a plateau ends its stable phase there
    (``training/schedule.py``)."""
    rows = sorted((r for r in evals if "acc_0" in r and not _restored(r)), key=lambda r: r["step"])
    for i in range(min_evals - 1, len(rows)):
        if rows[i]["step"] >= min_step and plateau(rows[: i + 1], fraction, tol)["plateaued"]:
            return int(rows[i]["step"])
    return None


def _restored(row: dict) -> bool:
    """A row the loop appended after restoring the best state (a copy of an earlier evaluation)."""
    v = row.get("restored_from_step")
    return v is not None and v == v  # not None, not NaN (CSV round trip)


def portable_init(init_from: str | None) -> str:
    """A config's ``init_from`` as committed files show it: a checkpoint folder relative to the checkout."""
    return repo_relative(init_from) if init_from and init_from != "target" else init_from or ""


def run_summary(result) -> dict:
    """One row per finished run: what it saw, how long it took, where it ended and whether it had converged."""
    cfg, logs = result.config, result.logs
    history, evals = logs.get("history", []), logs.get("eval", [])
    final = result.final_eval()
    extra = getattr(getattr(result.drafter, "cfg", None), "extra", {}) or {}
    row = dict(
        drafter=cfg.name,
        paradigm=cfg.paradigm,
        regime=cfg.regime,
        n_layers=cfg.n_layers,
        kv_mode=cfg.kv_mode,
        seed=cfg.seed,
        data_source=cfg.data_source,
        init_from=portable_init(cfg.init_from),
        steps_trained=len(history),
        train_steps=cfg.train_steps,
        train_tokens=sum(h["tokens"] for h in history),
        seconds=round(result.train_seconds, 1),
        tokens_per_s=round(sum(h["tokens"] for h in history) / max(result.train_seconds, 1e-9), 1),
        best_step=extra.get("best_step"),
        stopped_early=bool(extra.get("stopped_early", False)),
        stop_reason=extra.get("stop_reason", ""),
        heldout_mat=heldout_acceptance(final) if final else None,
    )
    row.update({k: final[k] for k in sorted(final) if k.startswith("acc_") or k == "ceiling"})
    row.update(stable_plateau(cfg, evals) if cfg.plateau_stop else plateau(evals))
    row.update({f"annealed_{k}": v for k, v in annealed_plateau(logs.get("curve", [])).items()})
    return row


def stable_plateau(cfg, evals: list[dict]) -> dict:
    """The plateau rule's own judgement of a run trained to a plateau (``plateau_stop``): over the evaluations of
    its stable phase, up to the step where the rule ended it (``decay_from``) or, at the cap, where the planned
    decay began. The annealed final evaluation is left out: its jump is the decay's, not training's."""
    decay_from = plateau_step(evals, cfg.plateau_stop, min_step=cfg.plateau_min_steps)
    end = decay_start(cfg, decay_from)
    stable = [r for r in evals if r.get("step") is not None and r["step"] <= end]
    return dict(plateau(stable, 0.25, cfg.plateau_stop), decay_from=decay_from)


# ------------------------------------------------------------------------- the annealed rule: converged

# Per-token cross-entropy spread, as a multiple of its mean, where an evaluation did not record ``ce_sd_0``
# (every run before the rule): 1.07-1.16 for the on-policy headline drafters on their held-out set
# (``figures/onpolicy/data/ce_spread.json``, written by ``scripts/reference/mtbench_gap.py``); the larger is kept.
CE_SD_PER_MEAN = 1.16
HALF = (
    0.55  # the reference point of a doubling: the latest point at or below 55% of the last one's token-passes
)


def se_acc(p: dict) -> float:
    """The binomial standard error of an evaluation's held-out acc_0."""
    a, n = float(p["acc_0"]), max(float(p["n_0"]), 1.0)
    return math.sqrt(max(a * (1 - a), 1e-12) / n)


def se_ce(p: dict) -> float:
    """The standard error of an evaluation's held-out cross-entropy (``ce_sd_0``, else :data:`CE_SD_PER_MEAN`)."""
    sd = p.get("ce_sd_0")
    sd = float(sd) if sd is not None and sd == sd else CE_SD_PER_MEAN * float(p["ce_0"])
    return sd / math.sqrt(max(float(p["n_0"]), 1.0))


def annealed_plateau(points: list[dict], z: float = 2.0) -> dict:
    """Whether an annealed held-out curve stopped improving: the last point against the latest one at or below
    half its token-passes (``HALF``). ``converged`` when acc_0 gained less than ``z`` standard errors of the
    difference *and* cross-entropy fell by less than ``z`` of its own (binomial for acc_0; ``ce_sd_0 / sqrt(n_0)``
    for cross-entropy; the two evaluations taken as independent). A point without ``ce_0`` is judged on acc_0
    alone (``ce_judged`` False). ``verdict``: ``converged``, ``compute-limited``, or ``undetermined`` where no
    point lies a doubling back."""
    pts = [p for p in points if p.get("tokens") is not None and p.get("acc_0") == p.get("acc_0")]
    pts = sorted(pts, key=lambda p: float(p["tokens"]))
    out = dict(verdict="undetermined", converged=None, from_tokens=None, to_tokens=None)
    out.update(acc_gain=None, acc_noise=None, ce_gain=None, ce_noise=None, ce_judged=None)
    if not pts:
        return out
    last = pts[-1]
    back = [p for p in pts[:-1] if float(p["tokens"]) <= HALF * float(last["tokens"])]
    out["to_tokens"] = int(last["tokens"])
    if not back:
        return out
    ref = back[-1]
    acc_gain = float(last["acc_0"]) - float(ref["acc_0"])
    acc_noise = z * math.hypot(se_acc(last), se_acc(ref))
    has_ce = all(p.get("ce_0") is not None and p.get("ce_0") == p.get("ce_0") for p in (last, ref))
    ce_gain = float(ref["ce_0"]) - float(last["ce_0"]) if has_ce else None
    ce_noise = z * math.hypot(se_ce(last), se_ce(ref)) if has_ce else None
    done = acc_gain < acc_noise and (not has_ce or ce_gain < ce_noise)
    out.update(
        verdict="converged" if done else "compute-limited",
        converged=done,
        from_tokens=int(ref["tokens"]),
        acc_gain=acc_gain,
        acc_noise=acc_noise,
        ce_gain=ce_gain,
        ce_noise=ce_noise,
        ce_judged=has_ce,
    )
    return out


def converged_budget(curve: list[dict], z: float) -> int | None:
    """The budget step of the first decay branch at which :func:`annealed_plateau` holds over the points so far
    (a run's starting point, ``budget_step`` 0, counts as a point but cannot end it); None if none has."""
    pts = sorted(curve, key=lambda p: float(p["tokens"]))
    for i, p in enumerate(pts):
        if int(p.get("budget_step") or 0) > 0 and annealed_plateau(pts[: i + 1], z)["converged"]:
            return int(p["budget_step"])
    return None


def convergence_table(curve: pd.DataFrame, z: float = 2.0) -> pd.DataFrame:
    """One row per drafter of a saved annealed curve: :func:`annealed_plateau` over its points. ``curve`` is a
    ``curve_points.csv`` (one row per point: ``acc_0``, ``ce_0``, ``n_0``, ``tokens``) or a
    ``learning_curves.csv`` (long: ``metric``, ``value``, ``n``; acc_0 only, so cross-entropy is not judged)."""
    if "metric" in curve.columns:
        acc = curve[curve["metric"] == "acc_0"]
        curve = acc.assign(acc_0=acc["value"], n_0=acc["n"])
    rows = []
    for drafter, g in curve.groupby("drafter", sort=False):
        pts = [{k: (None if v != v else v) for k, v in r.items()} for r in g.to_dict("records")]
        rows.append(dict(drafter=drafter, points=len(pts), **annealed_plateau(pts, z)))
    return pd.DataFrame(rows)
