"""Resumable training state: the drafter, the optimizer and the trainer's position, without pickle.

``<out_dir>/state/`` holds ``model.safetensors`` (the drafter's state dict), ``optimizer.safetensors`` (every
tensor of the optimizer's state, keyed ``<param index>.<name>``), ``early_stopping.safetensors`` (the best
parameters early stopping kept, if any) and ``trainer.json`` (the step reached, the optimizer's
hyper-parameters and non-tensor state, the early-stopping counters, the training config and the logs so
far). The folder is written under a temporary name and swapped in, so an interruption leaves the previous
state intact (killed between the swap's two renames, it is ``state.old``, which :func:`read_train_state` puts back). The data position is a function of the step (see :mod:`kvshot_lib.training.batches`) and the
learning rate schedule too, so a resumed run continues exactly where the interrupted one was: same weights,
history and stopping step (``tests/test_resume.py`` kills runs at several points and checks all three).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..drafters.trainable import TrainableDrafter

STATE_DIR = "state"


def save_train_state(
    out_dir: Path,
    drafter: TrainableDrafter,
    optimizer,
    step: int,
    config: dict,
    logs: dict,
    early_stopping=None,
) -> Path:
    """Write the resumable state of a run that has finished ``step`` steps (``early_stopping``: the
    :class:`~.convergence.EarlyStopping` of the run, whose best parameters and counters are kept too)."""
    out_dir = Path(out_dir)
    final, tmp = out_dir / STATE_DIR, out_dir / (STATE_DIR + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()},
        str(tmp / "model.safetensors"),
    )
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for name, value in st.items():
            if torch.is_tensor(value):
                tensors[f"{idx}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{name}"] = value
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    meta = dict(
        step=step, config=config, param_groups=sd["param_groups"], optimizer_scalars=scalars, logs=logs
    )
    if early_stopping is not None:
        meta["early_stopping"], best = early_stopping.state_dict()
        save_file(best, str(tmp / "early_stopping.safetensors"))
    (tmp / "trainer.json").write_text(json.dumps(meta))
    old = out_dir / (STATE_DIR + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def read_train_state(out_dir: Path) -> dict | None:
    """The saved trainer metadata, or None if there is no complete state."""
    final, old = Path(out_dir) / STATE_DIR, Path(out_dir) / (STATE_DIR + ".old")
    if not final.exists() and (old / "trainer.json").is_file():  # a save killed mid-swap: the previous state
        old.rename(final)
    path = final / "trainer.json"
    return json.loads(path.read_text()) if path.is_file() else None


def load_train_state(out_dir: Path, drafter: TrainableDrafter, optimizer, early_stopping=None) -> dict:
    """Restore the drafter, the optimizer and ``early_stopping`` in place (strict); returns the trainer
    metadata."""
    state_dir = Path(out_dir) / STATE_DIR
    meta = json.loads((state_dir / "trainer.json").read_text())
    device = drafter.head.device
    drafter.load_state_dict(
        {k: v.to(device) for k, v in load_file(str(state_dir / "model.safetensors")).items()}, strict=True
    )
    tensors = load_file(str(state_dir / "optimizer.safetensors"))
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value.to(device) if value.dim() else value
    for key, value in meta["optimizer_scalars"].items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    if early_stopping is not None:
        if "early_stopping" not in meta:
            raise ValueError(
                f"the training state in {state_dir} has no early-stopping state (written by an older "
                "version); resume with resume=False (kvshot train --no-resume) to start over."
            )
        best = load_file(str(state_dir / "early_stopping.safetensors"))
        early_stopping.load_state_dict(meta["early_stopping"], best)
    return meta
