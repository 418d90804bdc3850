"""A run's position carried between machines: what a committed folder keeps so that a long run goes on in the next
session, on another machine, when ``runs/`` (and the saved state with its optimizer) is gone.

The folder is a drafter checkpoint (``config.json``, the weights in bf16: ``reference.commit_checkpoint`` writes it,
within the committed checkpoints' limits) plus
``history.safetensors`` (the per-step history, a float32 column per key) and ``trainer.json`` (the step reached, the
training config, the other logs and the early-stopping counters). No optimizer state: it is about twice the
weights in float32, too big to commit. So a run resumed from here starts a fresh optimizer and warms the
learning rate up again over ``warmup_steps`` from the step it resumes at (:func:`rewarm_factor`; each such
restart is a row of the run's ``restarts`` log). The data position and the schedule are functions of the step, so
the rest of the run is the planned one; the weights differ from the saved state's by bf16 rounding (a relative
2^-9) and the optimizer's moments start again, which is why a carried run is not bit-identical to an
uninterrupted one (``tests/test_carry.py`` holds it to the same loss curve within a tolerance instead).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..drafters.checkpoint import read_config, read_weights
from ..drafters.trainable import TrainableDrafter
from .convergence import portable_init

TRAINER_FILE = "trainer.json"
HISTORY_FILE = "history.safetensors"
# exact as int64; every other column is float32 (NaN where a row has no value)
INT_COLUMNS = ("step", "tokens")


def carried_step(folder: str | Path | None) -> int | None:
    """The step a carried folder reached, or None when there is none (no folder, or no complete one)."""
    path = Path(folder) / TRAINER_FILE if folder else None
    return json.loads(path.read_text())["step"] if path is not None and path.is_file() else None


def carried_ahead(folder: str | Path | None, saved: dict | None) -> bool:
    """Whether the carried folder is further along than the saved state ``saved`` (its metadata, or None)."""
    return (carried_step(folder) or 0) > (saved["step"] if saved else 0)


def write_carried(folder: str | Path, step: int, config: dict, logs: dict, early_stopping: dict) -> None:
    """Write the run's position beside a checkpoint already in ``folder`` (``trainer.json`` last: a folder without
    it is not a carried state). ``logs``: the run's log tables so far (``seconds`` under ``_seconds``)."""
    folder = Path(folder)
    history = logs.get("history", [])
    keys = list(dict.fromkeys(k for row in history for k in row))
    columns = {}
    for key in keys:
        values = [row.get(key) for row in history]
        if key in INT_COLUMNS:
            columns[key] = torch.tensor(values, dtype=torch.int64)
        else:
            columns[key] = torch.tensor(
                [float("nan") if v is None else v for v in values], dtype=torch.float32
            )
    save_file(columns, str(folder / HISTORY_FILE), metadata={"columns": json.dumps(keys)})
    rest = {k: v for k, v in logs.items() if k != "history"}
    config = dict(config, init_from=portable_init(config.get("init_from")) or None)  # no machine's path
    meta = dict(step=step, config=config, logs=rest, early_stopping=early_stopping)
    (folder / TRAINER_FILE).write_text(json.dumps(meta))


def read_carried(folder: str | Path) -> dict:
    """``trainer.json`` of a carried folder with the history put back as rows (as :func:`write_carried` got them,
    float columns to float32 precision)."""
    folder = Path(folder)
    meta = json.loads((folder / TRAINER_FILE).read_text())
    with safe_open(str(folder / HISTORY_FILE), "pt") as f:
        keys = json.loads(f.metadata()["columns"])  # the rows' key order (the file keeps its own)
    columns = load_file(str(folder / HISTORY_FILE))
    n = len(columns[keys[0]]) if keys else 0
    lists = {k: columns[k].tolist() for k in keys}
    history = []
    for i in range(n):
        row = {}
        for key, values in lists.items():
            v = values[i]
            row[key] = None if isinstance(v, float) and v != v else v
        history.append(row)
    meta["logs"]["history"] = history
    return meta


def load_carried_weights(folder: str | Path, drafter: TrainableDrafter, target_info) -> None:
    """Put the carried weights into ``drafter`` (every tensor, strictly), after checking that the folder's drafter
    is for this target and has this drafter's draft vocabulary."""
    folder = Path(folder)
    src = read_config(folder)
    src.check_target(target_info, where=f"the carried training state {folder}")
    if src.vocab_hash != drafter.cfg.vocab_hash:
        raise ValueError(
            f"the carried training state {folder} has draft vocabulary {src.vocab_hash}, this run "
            f"{drafter.cfg.vocab_hash}: it belongs to another run; move it aside to start this one afresh."
        )
    own = drafter.state_dict()
    weights = {k: v.to(own[k].dtype) if k in own else v for k, v in read_weights(folder).items()}
    with torch.no_grad():
        drafter.load_state_dict(weights, strict=True)


def rewarm_factor(cfg, step: int, restarts: list[dict]) -> float:
    """The learning-rate multiplier of step ``step`` (0-based) after the last restart at or before it: linear from
    1/``warmup_steps`` up to 1 over ``warmup_steps`` steps (1 where there was no restart)."""
    last = max((r["step"] for r in restarts if r["step"] <= step), default=None)
    if last is None or not cfg.warmup_steps:
        return 1.0
    return min(1.0, (step - last + 1) / cfg.warmup_steps)
