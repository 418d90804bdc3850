"""The reference run as time-boxed jobs, one per remote device command (the run itself is kvshot_lib.reference).

* :func:`train_job` trains its rows one after the other, online, each within an equal share of the time left:
  a short calibration (a few timed steps and one held-out evaluation) sets ``train_steps`` so that warmup and
  cosine decay end inside the share, ``max_seconds`` caps it, and early stopping on held-out acceptance may end
  it sooner. After each row it rewrites the job's tables and adds the row's bf16 checkpoint (headline rows).
* :func:`regenerate_job` regenerates the held-out slice, then as much of the training slice as time allows.
* :func:`eval_job` measures its rows and the n-gram baseline on MT-bench (:func:`kvshot_lib.reference.evaluate`,
  asked before each measurement whether the clock has room).

Everything a job writes goes to ``<out>/<job>/`` (see :mod:`.outputs` for the device's limits); its trained
drafters also stay in ``<cache>/reference-runs/`` so a later job on the same warm machine can start from them.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from kvshot_lib.reference import Job, Plan
from kvshot_lib.reference import run as reference

from . import outputs
from .payload import staged_prompts

MARGIN_S = (
    25.0  # kept free at the end of a job (10% of short ones): the last tables, checkpoints, the copy back
)


class Clock:
    """The job's deadline, counted from the process start."""

    def __init__(self, minutes: float, t0: float):
        self.t0, self.deadline = t0, t0 + 60.0 * minutes - min(MARGIN_S, 6.0 * minutes)

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def enough(self, seconds: float) -> bool:
        """Whether ``seconds`` are left (scaled down for short jobs: at most a tenth of the job per check)."""
        total = self.deadline - self.t0
        return self.left() > min(seconds, 0.1 * total)


def calibrate(target, data: reference.RowData, cfg, d2t) -> tuple[float, float]:
    """Seconds per optimizer step and per held-out evaluation, from a throwaway copy of the row's drafter."""
    from kvshot_lib.training import Objective, OnlineBatches, build_optimizer, evaluate_per_step, new_drafter

    drafter = new_drafter(target, data.train, data.eval_set, cfg, d2t)
    objective, opt = Objective(drafter, cfg), build_optimizer(drafter, cfg)
    loader = OnlineBatches(
        target, data.train, drafter.cfg, cfg.batch_size, cfg.seed, max_tokens=cfg.max_tokens
    )
    sync = torch.cuda.synchronize if target.info.device.startswith("cuda") else (lambda: None)
    times = []
    for step in range(4):
        sync()
        t = time.perf_counter()
        loss, _ = objective(loader.batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    evaluate_per_step(drafter.eval(), data.eval_set, cfg.eval_steps, None, cfg.eval_branch_fraction)
    sync()
    return sum(times[1:]) / 3, time.perf_counter() - t


def train_job(
    plan: Plan, job: Job, out: Path, device: str, clock: Clock, progress: bool = True
) -> list[dict]:
    runs = outputs.runs_dir()
    rows = [plan.row(r) for r in job.rows]
    inits = {
        r.name: reference.init_path(plan, r, runs) for r in rows if r.init_row and r.init_row not in job.rows
    }
    target = reference.load_reference_target(plan, device)
    env = reference.environment(device)
    outputs.write_json(out, "environment.json", dict(env, job=job.name, rows=job.rows, kind=job.kind))
    data, d2t, summaries = {}, None, []
    for i, row in enumerate(rows):
        if row.responses not in data:
            data[row.responses] = reference.row_data(plan, target, row)
        if d2t is None:
            d2t = reference.draft_vocab(plan, target, row.train_config().draft_vocab_size)
        floor = min(20.0, 0.1 * (clock.deadline - clock.t0))  # the least a row is worth starting for
        if clock.left() < floor:  # rows run in priority order: the last ones give way
            summaries.append(dict(drafter=row.name, skipped=f"no time left ({clock.left():.0f} s)"))
            continue
        share = max(floor, clock.left() / (len(rows) - i))
        init = inits.get(row.name) or (str(runs / row.init_row) if row.init_row else None)
        t_row = time.perf_counter()
        step_s, eval_s = calibrate(target, data[row.responses], row.train_config(init_from=init), d2t)
        budget = share - (time.perf_counter() - t_row) - 5.0
        cfg0 = row.train_config(init_from=init)
        steps = max(1, int((budget - 2 * eval_s) / (step_s + eval_s / max(1, cfg0.eval_every))))
        result, summary = reference.train_row(
            plan, row, target, data[row.responses], d2t, runs / row.name, init, progress,
            train_steps=steps, max_seconds=max(1.0, budget - 2 * eval_s),
        )  # fmt: skip
        summary.update(
            calibration_step_s=round(step_s, 4),
            calibration_eval_s=round(eval_s, 3),
            planned_steps=steps,
            row_seconds=round(time.perf_counter() - t_row, 1),
            job=job.name,
        )
        summaries.append(summary)
        outputs.add_run(out, result, summary, checkpoint=row.headline)
        outputs.write_tables(out, summaries)
        del result
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    outputs.write_tables(out, summaries)
    return summaries


def regenerate_job(plan: Plan, job: Job, out: Path, device: str, clock: Clock, progress: bool = True) -> dict:
    target = reference.load_reference_target(plan, device)
    outputs.write_json(
        out, "environment.json", dict(reference.environment(device), job=job.name, kind=job.kind)
    )
    conversations = staged_prompts()  # None off the device: read ShareGPT itself
    done = {}
    for split in ("eval", "train"):
        t = time.perf_counter()
        stop_at = clock.left() - min(60.0, 0.1 * (clock.deadline - clock.t0))  # one shard may run past it
        regen, folder = reference.regenerate_split(
            plan, target, split, max(1.0, stop_at), conversations, progress
        )
        done[split] = dict(
            conversations=len(regen),
            missing=regen.counts.get("not_regenerated", 0),
            seconds=round(time.perf_counter() - t, 1),
        )
        outputs.add_regenerated(out, folder)
        outputs.write_json(out, "regenerated.json", done)
        if not clock.enough(90):
            break
    return done


def eval_job(plan: Plan, job: Job, out: Path, device: str, clock: Clock, progress: bool = True) -> dict:
    from kvshot_lib.drafters import NgramDrafter, load_drafter

    target = reference.load_reference_target(plan, device)
    env = dict(reference.environment(device), job=job.name, kind=job.kind, rows=job.rows)
    outputs.write_json(out, "environment.json", env)
    drafters = {
        name: load_drafter(reference.checkpoint_path(plan, name, outputs.runs_dir()), target)
        for name in job.rows
    }
    drafters["ngram"] = NgramDrafter(target.info.vocab_size)
    n_boot = plan.eval.get("bootstrap", 1000)
    _, done = reference.evaluate(
        plan, target, drafters, keep_going=clock.enough, progress=progress,
        on_progress=lambda runs, done: outputs.write_acceptance(out, runs, n_boot, done),
    )  # fmt: skip
    return dict(done=done)


def run(
    plan: Plan, job: Job, out_root: Path, device: str, t0: float, minutes: float | None = None, progress=True
):
    """Run ``job`` into ``out_root/<job>/`` within ``minutes`` (the job's own by default) of ``t0``."""
    clock = Clock(minutes or job.minutes, t0)
    out = Path(out_root) / job.name
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(
        outputs.scratch(out), ignore_errors=True
    )  # a rerun of the job on the same machine starts clean
    fn = {"train": train_job, "regenerate": regenerate_job, "eval": eval_job}[job.kind]
    result = fn(plan, job, out, device, clock, progress)
    outputs.write_json(
        out,
        "job.json",
        dict(job=job.name, kind=job.kind, seconds=round(time.perf_counter() - t0, 1), result=result),
    )
    outputs.check_limits(Path(out_root))
    return result
