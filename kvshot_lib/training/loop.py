"""Train a drafter (hidden / KV / hybrid) under a regime (teacher forcing / TTT / TTT-dense / parallel).

``train_drafter(target, train_store, eval_store, config, out_dir)`` trains on the feature store, logs the
training loss, the per-step held-out accuracy and the gradient probes, and writes into ``out_dir``:

* ``config.json`` + ``model.safetensors``: the checkpoint (see :mod:`kvshot_lib.drafters.checkpoint`);
* ``history.csv`` (training rows), ``eval.csv`` (per-step held-out accuracy over training),
  ``grad_probes.csv``, ``kv_positions.csv``, ``attention_mass.csv``, ``kv_position_samples.csv``;
* ``state/``: the resumable state while training runs (removed when it finishes).

Calling it again with the same config returns the finished run from disk; after an interruption it resumes.
A run whose ``state/`` is gone (another machine, a new session) resumes from a ``carried`` folder that an
``on_save`` callback kept (:mod:`.carry`: the weights and the position, without the optimizer).
The data comes from :func:`~.data.data_source` (feature stores or online), the learning rate from
:mod:`.schedule`, when to stop from :class:`~.convergence.Stopping`; the objectives are in :mod:`.losses`, the
probes in :mod:`.grad_probes`.

The loop uses ``accelerate``'s :class:`Accelerator`, so the same code runs on one CPU, one GPU, or several
GPUs under ``accelerate launch -m kvshot_lib.cli train ...`` (data-parallel; see README).
"""

from __future__ import annotations

import copy
import json
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from ..drafters import build_drafter, drafter_config_for, init_attention_from_target, load_drafter
from ..drafters.checkpoint import CONFIG_FILE, save_drafter
from ..drafters.trainable import TrainableDrafter
from ..drafters.vocab import count_tokens, draft_vocab_from_counts
from ..target import Target
from ..target.precision import autocast, machine_record, resolve_precision
from .carry import rewarm_factor
from .config import TrainConfig
from .convergence import Stopping, plateau
from .data import data_source, describe_data, init_from_checkpoint
from .grad_probes import GradProbe, grouped_parameters
from .heldout import EvalSet, evaluate_per_step, gate_summary
from .losses import branch_valid, regime_loss, sample_anchors, sample_branches, step_mask
from .resume import LOG_TABLES, kept_init, resume_point, resume_source
from .schedule import curve_steps, decay_length, decay_start, linear_decay, lr_factor
from .state import STATE_DIR, save_train_state


@dataclass
class TrainResult:
    drafter: TrainableDrafter
    out_dir: Path
    config: TrainConfig
    logs: dict = field(default_factory=dict)  # table name -> list of row dicts
    train_seconds: float = 0.0
    # a carried run's stretches from an earlier table (figures/<run>/data/partial/<row>_curve_progress.csv): the
    # machines of those its restarts log does not name (heldout.run_stretches)
    known_stretches: pd.DataFrame | None = None

    def table(self, name: str) -> pd.DataFrame:
        return pd.DataFrame(self.logs.get(name, []))

    def final_eval(self) -> dict:
        return self.logs["eval"][-1] if self.logs.get("eval") else {}


class Objective(nn.Module):
    """The drafter plus its regime's loss, so that ``accelerate``/DDP sees one forward. It runs under
    ``precision`` (a resolved one: ``"no"`` = float32, ``"bf16"``: autocast, see target/precision.py)."""

    def __init__(self, drafter: TrainableDrafter, cfg: TrainConfig, precision: str = "no"):
        super().__init__()
        self.drafter, self.cfg, self.precision = drafter, cfg, precision

    def forward(self, batch, recorder=None, branches=None):
        c = self.cfg
        with autocast(self.precision, self.drafter.head.device):
            un = self.drafter(
                batch, c.n_train_steps, detach_chain=c.detach_chain, recorder=recorder, branches=branches
            )
            return regime_loss(
                self.drafter,
                batch,
                un,
                c.regime,
                c.step_decay,
                c.feature_loss_weight,
                c.kv_align_weight,
                (c.answer_start_tokens, c.answer_start_weight),
            )


def build_draft_vocab(store, target: Target, size: int) -> torch.Tensor:
    """The draft vocabulary (``d2t``) of a training store: its ``size`` most frequent assistant tokens."""
    counts = count_tokens(store, target.info.vocab_size)
    return draft_vocab_from_counts(counts, size, always=tuple(target.info.eos_token_ids))


def make_accelerator(cfg: TrainConfig, device: str):
    """An ``Accelerator`` for ``device``. bf16 runs through the :class:`Objective`'s own autocast (accelerate's
    mixed precision is fixed once per process, and one process may train float32 and bf16 drafters); only
    CUDA fp16 needs accelerate's, for its gradient scaler."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    ddp = DistributedDataParallelKwargs(broadcast_buffers=False)
    mp = "fp16" if resolve_precision(cfg.mixed_precision, device) == "fp16" else None
    return Accelerator(cpu=str(device) == "cpu", mixed_precision=mp, kwargs_handlers=[ddp])


def build_optimizer(drafter: TrainableDrafter, cfg: TrainConfig) -> torch.optim.Optimizer:
    groups = []
    for group, params in sorted(grouped_parameters(drafter).items()):
        lr = cfg.lr * cfg.lr_scale.get(group, 1.0)
        groups.append(dict(params=[p for _, p in params], lr=lr, name=group))
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.adam_betas, weight_decay=cfg.weight_decay)


def finished_extra(out_dir: str | Path) -> dict | None:
    """The ``extra`` record (training config, machine, ...) of the finished run in ``out_dir``; None if none
    finished there."""
    path = Path(out_dir) / CONFIG_FILE
    extra = json.loads(path.read_text()).get("extra", {}) if path.is_file() else {}
    return extra if extra.get("completed") and extra.get("train_config") else None


def finished_config(out_dir: str | Path) -> dict | None:
    """The training config (``TrainConfig.as_dict()``) of the finished run in ``out_dir``; None if none finished there."""
    extra = finished_extra(out_dir)
    return extra["train_config"] if extra else None


def _finished(out: Path, cfg: TrainConfig) -> bool:
    return finished_config(out) == cfg.as_dict()


def _write_logs(out: Path, logs: dict) -> None:
    # the first write into the run's folder when no state was saved (a few steps, no decay branch)
    out.mkdir(parents=True, exist_ok=True)
    for name in LOG_TABLES:  # each written beside and renamed in: never half a table
        tmp = out / f"{name}.csv.tmp"
        pd.DataFrame(logs.get(name, [])).to_csv(tmp, index=False)
        tmp.replace(out / f"{name}.csv")


def read_logs(out_dir: str | Path) -> dict:
    """The log tables of a finished run, as lists of row dicts (missing tables are empty)."""
    out = Path(out_dir)
    logs = {}
    for name in LOG_TABLES:
        path = out / f"{name}.csv"
        try:
            logs[name] = pd.read_csv(path).to_dict("records") if path.is_file() else []
        except pd.errors.EmptyDataError:
            logs[name] = []
    return logs


def train_drafter(
    target: Target,
    train_store,
    eval_store,
    config: TrainConfig | dict,
    out_dir: str | Path,
    d2t: torch.Tensor | None = None,
    resume: bool = True,
    progress: bool = True,
    accelerator=None,
    eval_set: EvalSet | None = None,
    carried: str | Path | None = None,
    on_save=None,
) -> TrainResult:
    """Train one drafter; see the module docstring. ``config`` may be a parameter dict (validated).
    ``on_save(drafter, step, config, logs, early_stopping_counters)`` is called after each saved state (to keep a
    :mod:`.carry` folder); ``carried`` is such a folder, resumed from when it is further along than ``state/``."""
    cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_params(config)
    if (carried or on_save) and cfg.early_stop_patience:
        raise ValueError(
            f"{cfg.name}: a carried training state keeps no copy of early stopping's best weights; "
            "set early_stop_patience=0 to carry this run between machines."
        )
    precision = resolve_precision(cfg.mixed_precision, target.info.device)  # refused here if impossible
    out = Path(out_dir)
    if resume and _finished(out, cfg):
        drafter = load_drafter(out, target)
        extra = drafter.cfg.extra
        return TrainResult(drafter, out, cfg, read_logs(out), extra.get("train_seconds", 0.0))
    data = data_source(cfg, target, train_store, eval_store)
    data.check()
    source = resume_source(out, cfg, resume, carried)
    # a resumed run keeps its carried record of where it started, and does not read that checkpoint again (it may be gone)
    record = kept_init(source, cfg, carried)
    drafter = new_drafter(target, train_store, eval_store, cfg, d2t, init=record is None)
    if record is not None:
        drafter.cfg.extra["init_from"] = record
    acc = accelerator or make_accelerator(cfg, target.info.device)
    optimizer = build_optimizer(drafter, cfg)
    stopping = Stopping(cfg)
    start, logs, seconds = resume_point(source, drafter, optimizer, stopping.early, target, precision)
    for group in optimizer.param_groups:
        group.setdefault("base_lr", group["lr"])
    objective, optimizer = acc.prepare(Objective(drafter, cfg, precision), optimizer)
    ctx = StepContext(drafter, objective, optimizer, acc, cfg)
    loader = data.loader(drafter.cfg, acc.process_index, acc.num_processes)
    evals = eval_set or data.eval_set(drafter.cfg)
    budgets = curve_steps(cfg.train_steps, cfg.curve_points)
    stopping.follow_plateau(logs["eval"])  # a resumed run's decision so far
    stopping.follow_curve(logs["curve"])

    def evaluate(step: int) -> dict:
        drafter.eval()
        with autocast(precision, drafter.head.device):
            ev = evaluate_per_step(drafter, evals, cfg.eval_steps, acc, cfg.eval_branch_fraction)
        return dict(ev, step=step, seconds=time.perf_counter() - t_start, **gate_summary(drafter))

    bar = tqdm(
        total=cfg.train_steps,
        initial=start,
        desc=f"training {cfg.name}",
        disable=not (progress and acc.is_main_process),
    )
    t_start = time.perf_counter() - seconds
    if cfg.tokens_before and budgets and not logs["curve"]:  # the continued run's starting point
        logs["curve"].append(dict(evaluate(0), budget_step=0, branch_steps=0, tokens=cfg.tokens_before))
    for step in range(start, cfg.train_steps):
        batch = loader.batch(step).to(acc.device)
        end, decay_from = stopping.end, stopping.decay_from
        factor = lr_factor(cfg, step, decay_from) * rewarm_factor(cfg, step, logs["restarts"])
        row, acc0 = _train_step(ctx, batch, step, logs, t_start, factor)
        row["epoch"] = loader.epoch_of(step + 1)
        logs["history"].append(row)
        stable = decay_from is None or step + 1 <= decay_from
        branched = step + 1 in budgets and step + 1 < end and stable  # a learning-curve point (schedule.py)
        if branched:
            seen = cfg.tokens_before + sum(r["tokens"] for r in logs["history"])
            logs["curve"].append(_decay_branch(ctx, loader, step, evaluate, seen))
            stopping.follow_curve(logs["curve"])
        bar.set_postfix(loss=f"{row['loss']:.3f}", acc0=f"{acc0:.2f}")
        bar.update()
        last = stopping.is_last(step, t_start, acc)
        if (cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or last or step == 0)) or (budgets and last):
            ev = evaluate(step + 1)
            logs["eval"].append(ev)
            if budgets and step + 1 == end:  # the curve's last point is the run's own end
                tokens = cfg.tokens_before + sum(r["tokens"] for r in logs["history"])
                branch = end - decay_start(cfg, decay_from)
                logs["curve"].append(dict(ev, budget_step=step + 1, branch_steps=branch, tokens=tokens))
            last = stopping.evaluated(logs["eval"], drafter, last)
        if last:
            break
        # saved after each decay branch too, so that a run killed later does not train the branch again
        if acc.is_main_process and cfg.save_every and ((step + 1) % cfg.save_every == 0 or branched):
            seconds = time.perf_counter() - t_start
            state_logs = {**logs, "_seconds": seconds}
            save_train_state(out, drafter, optimizer, step + 1, cfg.as_dict(), state_logs, stopping.early)
            if on_save is not None:
                on_save(drafter, step + 1, cfg.as_dict(), state_logs, stopping.early.state_dict()[0])
        acc.wait_for_everyone()
    bar.close()
    seconds = time.perf_counter() - t_start
    drafter.eval()
    record = stopping.finish(drafter, logs["eval"], len(logs["history"]))
    if acc.is_main_process:
        final = acc.unwrap_model(objective).drafter
        _save_finished(out, final, cfg, logs, seconds, data, record, precision)
    acc.wait_for_everyone()
    return TrainResult(drafter, out, cfg, logs, seconds)


def new_drafter(
    target: Target, train_store, eval_store, cfg: TrainConfig, d2t: torch.Tensor | None, init: bool = True
) -> TrainableDrafter:
    """A freshly initialized drafter for ``cfg``, after checking that both feature stores fit it; ``init``: copy
    ``cfg.init_from`` in (False for a run about to load weights of its own from a resumed state)."""
    dcfg = drafter_config_for(
        target,
        cfg.paradigm,
        cfg.n_layers,
        cfg.kv_mode,
        cfg.hidden_layers,
        cfg.kv_layers,
        cfg.draft_vocab_size,
        cfg.query_group,
        name=cfg.name,
        regime=cfg.regime,
        kv_recency=cfg.kv_recency,
        target_kv=cfg.target_kv,
        kv_softmax=cfg.kv_softmax,
        context=cfg.context,
        block_size=cfg.ttt_steps if cfg.paradigm == "block" else 0,
        fc_norm=cfg.fc_norm,
        norm_output=cfg.norm_output,
    )
    data_source(cfg, target, train_store, eval_store).check_compatible(dcfg)
    d2t = build_draft_vocab(train_store, target, dcfg.draft_vocab_size) if d2t is None else d2t
    drafter = build_drafter(dcfg, target, d2t.cpu(), seed=cfg.seed)
    if not init:
        return drafter
    if cfg.init_from == "target":  # the KV drafter's attention from the target layers it reads
        drafter.cfg.extra["init_from"] = init_attention_from_target(drafter, target)
    elif cfg.init_from:
        drafter.cfg.extra["init_from"] = init_from_checkpoint(drafter, cfg.init_from, target)
    return drafter


@dataclass
class StepContext:
    """What an optimizer step works with: the drafter, its :class:`Objective` and optimizer (both prepared by
    ``accelerate``), the accelerator and the config."""

    drafter: TrainableDrafter
    objective: nn.Module
    optimizer: torch.optim.Optimizer
    acc: object
    cfg: TrainConfig


def _train_step(
    ctx: StepContext, batch, step: int, logs: dict, t_start: float, factor: float, branch: bool = False
):
    """One optimizer step at learning-rate multiplier ``factor`` (with the gradient probe on probing steps; a
    decay ``branch`` never probes); returns its history row and acc_0."""
    drafter, optimizer, acc, cfg = ctx.drafter, ctx.optimizer, ctx.acc, ctx.cfg
    base = dict(drafter=cfg.name, paradigm=cfg.paradigm, regime=cfg.regime)
    last = step == cfg.train_steps - 1
    probing = not branch and cfg.probe_every > 0 and (step % cfg.probe_every == 0 or last)
    branches = sample_branches(batch.ids.shape[1] - 1, cfg.branch_fraction, seed=cfg.seed * 1_000_003 + step)
    if cfg.regime == "parallel":  # the block drafter: random anchors per sequence (training/losses.py)
        branches = sample_anchors(
            step_mask(batch, 0), cfg.branch_fraction, cfg.seed * 1_000_003 + step, cfg.ttt_steps + 1
        )
    branches = None if branches is None else branches.to(acc.device)
    probe = None
    if probing:
        samples = cfg.probe_samples if last else 0
        probe = GradProbe(drafter, branch_valid(batch), cfg.probe_rel_threshold, samples, branches)
    drafter.train()
    with probe or nullcontext():
        loss, parts = ctx.objective(batch, probe, branches)
        acc.backward(loss)
    if probe is not None:
        _log_probe(logs, probe, step, base)
    for group in optimizer.param_groups:  # the "50x" remedy: scale one group's gradient
        scale = cfg.grad_scale.get(group["name"], 1.0)
        if scale != 1.0:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(scale)
    clip = cfg.grad_clip
    grad_norm = acc.clip_grad_norm_(drafter.parameters(), clip) if clip else torch.tensor(0.0)
    for group in optimizer.param_groups:  # the schedule is a function of the step (exact on resume)
        group["lr"] = group["base_lr"] * factor
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    row = dict(
        step=step + 1,
        loss=float(loss.detach()),
        lr=cfg.lr * factor,
        grad_norm=float(grad_norm),
        tokens=int(batch.lengths.sum()) * acc.num_processes,
        seconds=time.perf_counter() - t_start,
        epoch=None,  # filled in by the loop, which knows the data position
    )
    row.update({f"ce_{k}": v for k, v in enumerate(parts["ce"])})
    row.update({f"acc_{k}": v for k, v in enumerate(parts["acc"])})
    row.update({k: parts[k] for k in ("feature", "kv_align") if k in parts})
    return row, parts["acc"][0]


def _decay_branch(ctx: StepContext, loader, step: int, evaluate, seen: int) -> dict:
    """A learning-curve point after ``step + 1`` steps: from a copy, ``decay_fraction`` of them more on the next
    batches with the learning rate decaying linearly to ``min_lr_ratio``, a held-out evaluation, and back."""
    drafter, optimizer, cfg = ctx.drafter, ctx.optimizer, ctx.cfg
    params = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
    optim = copy.deepcopy(optimizer.state_dict())
    length = decay_length(step + 1, cfg.decay_fraction)
    start = lr_factor(cfg, step + 1)
    for i in range(length):
        batch = loader.batch(step + 1 + i).to(ctx.acc.device)
        factor = linear_decay(cfg, i, length, start)
        row, _ = _train_step(ctx, batch, step + 1 + i, {}, 0.0, factor, True)
        seen += row["tokens"]
    ev = evaluate(step + 1 + length)
    with torch.no_grad():
        drafter.load_state_dict(params, strict=True)
    optimizer.load_state_dict(optim)
    return dict(ev, budget_step=step + 1, branch_steps=length, tokens=seen)


def _save_finished(
    out: Path, drafter: TrainableDrafter, cfg: TrainConfig, logs, seconds: float, data, stopping, precision
):
    """Write the log tables, then the checkpoint (with the training metadata in its config, written last: the
    commit that marks the run finished), then drop the state. Killed before the commit, the run resumes."""
    n_tokens = sum(r["tokens"] for r in logs["history"])
    drafter.cfg.extra = dict(
        drafter.cfg.extra,
        train_config=cfg.as_dict(),
        completed=True,
        train_seconds=seconds,
        train_tokens=n_tokens,
        tokens_per_second=n_tokens / max(seconds, 1e-9),
        steps_trained=len(logs["history"]),
        train_store=describe_data(data.train),
        eval_store=describe_data(data.held),
        final_eval=logs["eval"][-1] if logs["eval"] else {},
        machine=machine_record(precision, drafter.head.device, cfg.mixed_precision),  # + auto's timings
        plateau=plateau(logs["eval"]),
        **stopping,
    )
    _write_logs(out, logs)
    save_drafter(drafter, out)
    shutil.rmtree(out / STATE_DIR, ignore_errors=True)


def _log_probe(logs: dict, probe: GradProbe, step: int, base: dict) -> None:
    for r in probe.group_rows():
        logs["grad_probes"].append(dict(**base, step=step, **r))
    kv, samples = probe.kv_rows()
    logs["kv_positions"] += [dict(**base, step=step, **r) for r in kv]
    logs["kv_position_samples"] += [dict(**base, step=step, **r) for r in samples]
    logs["attention_mass"] += [dict(**base, step=step, **r) for r in probe.mass_rows()]
