"""Where a run goes on from: its saved state (``state/``, optimizer and all), a carried folder further along
(:mod:`.carry`: the weights and the position, a fresh optimizer), or a fresh start.

:func:`resume_source` decides once, before the drafter is built, so that a resumed run does not read its starting
checkpoint (``init_from``) again: that checkpoint may have left the repository once the run carried its own
weights (``tests/test_carry.py::test_a_carried_run_goes_on_after_its_starting_checkpoint_is_retired``).
:func:`resume_point` then restores what the source holds into the drafter, the optimizer and early stopping.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..drafters.checkpoint import read_config
from ..drafters.trainable import TrainableDrafter
from ..target import Target
from ..target.precision import machine_record
from .carry import TRAINER_FILE, carried_ahead, carried_step, load_carried_weights, read_carried
from .config import TrainConfig
from .convergence import EarlyStopping, portable_init
from .grad_probes import PROBE_TABLES
from .state import STATE_DIR, load_train_state, read_train_state

LOG_TABLES = ("history", "eval", "curve", "restarts", *PROBE_TABLES)  # restarts: resumed from a carried state
# where the target's features come from, not what they are: a store's batches equal online ones (online.py), so a
# run may resume from the other source (e.g. online until a store is extracted)
SOURCE_KEYS = ("data_source",)


@dataclass
class ResumeSource:
    """What a run goes on from: ``kind`` "state" (``out/state/``) or "carried" (``folder``), with the metadata
    read there (``meta``)."""

    kind: str
    folder: Path
    meta: dict


def trained_alike(config: dict) -> dict:
    """A run's config without :data:`SOURCE_KEYS`, its ``init_from`` as committed files show it (a carried state's
    is relative to the checkout): a saved state resumes when these are equal."""
    alike = {k: v for k, v in config.items() if k not in SOURCE_KEYS}
    return dict(alike, init_from=portable_init(alike.get("init_from")))


def _alike(saved: dict, cfg: TrainConfig, where: Path) -> bool:
    """Whether a state saved under config ``saved`` resumes under ``cfg``; said, not silent, when not: hours of
    training may be behind that state."""
    old, new = trained_alike(saved), trained_alike(cfg.as_dict())
    if old != new:
        changed = ", ".join(sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k)))
        warnings.warn(f"{where} was saved under another config ({changed}): starting over", stacklevel=4)
    return old == new


def resume_source(
    out: Path, cfg: TrainConfig, resume: bool, carried: str | Path | None = None
) -> ResumeSource | None:
    """The saved state of the same config, or the ``carried`` folder when that is further along, or None (a fresh
    start)."""
    if not resume:
        return None
    meta = read_train_state(out)
    if carried_ahead(carried, meta):
        moved = read_carried(carried)
        if _alike(moved["config"], cfg, Path(carried)):
            return ResumeSource("carried", Path(carried), moved)
    if meta is not None and _alike(meta["config"], cfg, out / STATE_DIR):
        return ResumeSource("state", out / STATE_DIR, meta)
    return None


def kept_init(source: ResumeSource | None, cfg: TrainConfig, carried: str | Path | None) -> dict | None:
    """The record of where a resumed run started (the drafter config's ``extra["init_from"]``), kept by its carried
    folder of the same config; None when the run must copy its starting checkpoint (a fresh start, or no such
    record)."""
    if source is None or carried_step(carried) is None:  # trainer.json is written last: the folder is whole
        return None
    saved = json.loads((Path(carried) / TRAINER_FILE).read_text())["config"]
    if trained_alike(saved) != trained_alike(cfg.as_dict()):
        return None
    return read_config(carried).extra.get("init_from")


def resume_point(
    source: ResumeSource | None,
    drafter: TrainableDrafter,
    optimizer,
    stopper: EarlyStopping,
    target: Target,
    precision: str,
) -> tuple[int, dict, float]:
    """(first step, logs so far, seconds so far) from ``source`` (:func:`resume_source`), the drafter, the optimizer
    and the early-stopping state restored in place; a carried source is a restart (fresh optimizer, the learning
    rate warmed up again), logged at its step with the machine that goes on (in the run's resolved ``precision``)."""
    if source is None:
        return 0, {name: [] for name in LOG_TABLES}, 0.0
    if source.kind == "carried":
        load_carried_weights(source.folder, drafter, target.info)
        stopper.load_state_dict(source.meta["early_stopping"], {})
        logs = {name: source.meta["logs"].get(name, []) for name in LOG_TABLES}
        seconds = source.meta["logs"].get("_seconds", 0.0)
        machine = machine_record(precision, target.info.device)
        here = {k: machine[k] for k in ("precision", "cpu", "bf16_isa", "threads")}
        logs["restarts"].append(
            dict(step=source.meta["step"], seconds=seconds, source=source.folder.name, **here)
        )
        return source.meta["step"], logs, seconds
    meta = load_train_state(source.folder.parent, drafter, optimizer, stopper)
    logs = meta["logs"]
    for name in LOG_TABLES:  # a state saved before a table existed
        logs.setdefault(name, [])
    return meta["step"], logs, logs.pop("_seconds", 0.0)
