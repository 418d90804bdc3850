"""Both held-out sets: every drafter of a run and of its ``baseline`` run on each run's held-out conversations.

Each run measures its rows on its own held-out set (the on-policy run on the target's own answers, the reference
run on ShareGPT's original ones), so their held-out curves cannot be set side by side. :func:`cross_heldout`
measures the run's trained rows and the baseline run's committed checkpoints (``<row>@<run>``, the plan's
``baseline`` pairs) on *both* sets (and on the regenerated set's loop-free view), with each drafter's own draft vocabulary and the plans' held-out settings,
into ``heldout_cross.csv``: one row per (drafter, held-out set, draft step) with the accuracy, its count ``n``,
the draft vocabulary's ``ceiling`` on that set, the answers the drafter trained on and its token-passes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

from ..corpus import cut_looping, extract_features
from .data import data_splits
from .plan import Plan, PlanError, load_plan


def first_row(plan: Plan):
    """The plan's first row: it carries what every row shares (the training settings, the answers trained on)."""
    return plan.row(plan.training_order()[0])


def baseline_plan(plan: Plan) -> Plan | None:
    """The plan of the run that ``plan``'s ``baseline`` names (its smoke plan for a smoke plan), if any."""
    return load_plan(plan.baseline["run"], smoke=plan.smoke) if plan.baseline else None


LOOP_FREE = "regenerated, loops cut"


def heldout_sets(plan: Plan, target) -> dict:
    """``{answers: held-out feature store}`` of the plan and of its baseline run (extracted once, cached), keyed by
    the answers each holds: ``original`` or ``regenerated``, and for regenerated answers also their loop-free view
    (:data:`LOOP_FREE`: each loop cut after its first repetition, ``corpus.cut_looping``), where a drafter's
    accuracy is not inflated by predicting a repetition."""
    plans = [p for p in (plan, baseline_plan(plan)) if p is not None]
    out = {}
    for p in plans:
        precision = first_row(p).train_config().mixed_precision
        _, held, what = data_splits(p, target, first_row(p).responses)
        answers = what.split(" ")[0]  # "regenerated (...)", or "original" where nothing is regenerated yet
        if answers in out:
            raise PlanError(
                f"the held-out sets of {plans[0].run_name!r} and {p.run_name!r} both hold {answers} answers: "
                "regenerate the on-policy run's first (--steps regenerate)."
            )
        out[answers] = extract_features(target, held, precision=precision)
        if answers == "regenerated":
            free = cut_looping(held, target.info.eos_token_ids)
            out[LOOP_FREE] = extract_features(target, free, precision=precision)
    return out


def cross_heldout(plan: Plan, target, checkpoints: dict, progress: bool = True) -> pd.DataFrame:
    """Per-step held-out accuracy of ``checkpoints`` (``{label: folder}``; ``<row>@<run>``: the baseline run's) on
    both held-out sets (module docstring), with the plan's held-out settings (sequences, batch, crop, steps,
    branch share, precision)."""
    from ..drafters import load_drafter
    from ..target.precision import autocast, resolve_precision
    from ..training import EvalSet, evaluate_per_step

    c = first_row(plan).train_config()
    device = target.info.device
    precision = resolve_precision(c.mixed_precision, device)  # as the training loop's held-out evaluation
    sets = heldout_sets(plan, target)
    own, other = first_row(plan).responses, baseline_plan(plan)
    baseline = first_row(other).responses if other else None
    rows = []
    for label, folder in tqdm(checkpoints.items(), desc="both held-out sets", disable=not progress):
        d = load_drafter(folder, target)
        extra = json.loads((Path(folder) / "config.json").read_text()).get("extra", {})
        for held, store in sets.items():
            evals = EvalSet.build(store, d.cfg, target, c.eval_sequences, c.batch_size, c.max_tokens)
            with autocast(precision, device):
                acc = evaluate_per_step(d, evals, c.eval_steps, None, c.eval_branch_fraction)
            rows += [
                dict(
                    drafter=label,
                    paradigm=d.cfg.paradigm,
                    heldout=held,
                    trained_on=baseline if "@" in label else own,
                    token_passes=extra.get("train_tokens"),
                    draft_step=k,
                    accuracy=acc[f"acc_{k}"],
                    n=acc[f"n_{k}"],
                    ceiling=acc["ceiling"],
                    precision=precision,
                )
                for k in range(c.eval_steps)
            ]
    return pd.DataFrame(rows)
