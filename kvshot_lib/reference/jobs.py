"""The reference run's jobs: each one device command that trains, regenerates or evaluates within its minutes.

* :func:`train_job` trains its rows one after the other, online, each within an equal share of the time left:
  a short calibration (a few timed steps and one held-out evaluation) sets ``train_steps`` so that warmup and
  cosine decay end inside the share, ``max_seconds`` caps it, and early stopping on held-out acceptance may end
  it sooner. After each row it rewrites the job's tables and adds the row's bf16 checkpoint (headline rows).
* :func:`regenerate_job` regenerates the held-out slice, then as much of the training slice as time allows.
* :func:`eval_job` measures its rows and the n-gram baseline on MT-bench (acceptance by step, chain and tree
  at temperature 0 by greedy replay, then temperature 1 with the engine while time is left).

Everything a job writes goes to ``<out>/<job>/`` (see :mod:`.outputs` for the device's limits); its trained
drafters also stay in ``<cache>/reference-runs/`` so a later job on the same warm machine can start from them.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import torch

from ..corpus import cached_regeneration, regenerate_sharegpt, tokenize_sharegpt
from ..target import assets, load_target
from ..target.assets import REPO_ROOT
from . import outputs
from .plan import Job, Plan, PlanError

MARGIN_S = (
    25.0  # kept free at the end of a job (10% of short ones): the last tables, checkpoints, the copy back
)


def runs_dir() -> Path:
    return assets.cache_dir() / "reference-runs"


def environment(device: str) -> dict:
    import platform

    import transformers

    env = dict(
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        device=device,
        host=platform.node(),
        started=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    if device.startswith("cuda") and torch.cuda.is_available():
        env.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
    return env


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


# --------------------------------------------------------------------------------------------------- data


def data_splits(plan: Plan, target, responses: str):
    """(training, held-out) TokenizedSplits and what they are: regenerated where the regeneration has reached."""
    d = plan.data
    train = tokenize_sharegpt(
        target.tokenizer, "train", d["n_train_conversations"], d["max_len"], seed=plan.seed
    )
    held = tokenize_sharegpt(
        target.tokenizer, "eval", d["n_eval_conversations"], d["max_len"], seed=plan.seed
    )
    if responses == "original":
        return train, held, "original"
    r = plan.data["regenerate"]
    out = [cached_regeneration(target, split, r["max_new_tokens"], r["max_turns"]) for split in (train, held)]
    if out[0] is None:  # nothing regenerated yet: say so in every table
        return train, held, "original (no regenerated responses yet)"
    what = f"regenerated ({len(out[0])} of {len(train)} training conversations)"
    return out[0], out[1] if out[1] is not None else held, what


def load_reference_target(plan: Plan, device: str):
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True  # the drafters train in fp32: TF32 matmuls on the GPU
        torch.backends.cudnn.allow_tf32 = True
    dtype = plan.dtype if device.startswith("cuda") else "float32"
    return load_target(plan.target, device=device, dtype=dtype, seed=plan.seed)


# -------------------------------------------------------------------------------------------------- train


def checkpoint_path(plan: Plan, name: str) -> Path:
    """A trained row's checkpoint: this machine's run of it (an earlier job of the same lease), else one carried in
    ``runs/<profile>/drafters/<row>`` (merge puts it there), else the committed ``checkpoints/<profile>/<row>``."""
    places = (
        runs_dir() / name,
        REPO_ROOT / "runs" / plan.profile / "drafters" / name,
        REPO_ROOT / "checkpoints" / plan.profile / name,
    )
    for path in places:
        if (path / "config.json").is_file():
            return path
    raise PlanError(
        f"no checkpoint of row {name!r} in {', '.join(map(str, places))}. Train it first, carry "
        f"runs/{plan.profile}/drafters/{name} with the call (or evaluate other rows with --rows)."
    )


def init_path(plan: Plan, row) -> str | None:
    """The checkpoint a row starts from: the same warm machine's run, else the committed headline checkpoint."""
    if row.init_row is None:
        return None
    try:
        return str(checkpoint_path(plan, row.init_row))
    except PlanError as e:
        raise PlanError(f"row {row.name!r} starts from row {row.init_row!r}: {e}") from None


def calibrate(target, train, held_set, cfg, d2t) -> tuple[float, float]:
    """Seconds per optimizer step and per held-out evaluation, from a throwaway copy of the row's drafter."""
    from ..training import Objective, OnlineBatches, build_optimizer, evaluate_per_step
    from ..training.loop import new_drafter

    drafter = new_drafter(target, train, held_set, cfg, d2t)
    objective, opt = Objective(drafter, cfg), build_optimizer(drafter, cfg)
    loader = OnlineBatches(target, train, drafter.cfg, cfg.batch_size, cfg.seed, max_tokens=cfg.max_tokens)
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
    evaluate_per_step(drafter.eval(), held_set, cfg.eval_steps, None, cfg.eval_branch_fraction)
    sync()
    return sum(times[1:]) / 3, time.perf_counter() - t


def train_job(
    plan: Plan, job: Job, out: Path, device: str, clock: Clock, progress: bool = True
) -> list[dict]:
    from ..drafters import drafter_config_for
    from ..training import build_draft_vocab, online_eval_set, run_summary, train_drafter

    rows = [plan.row(r) for r in job.rows]
    inits = {r.name: init_path(plan, r) for r in rows if r.init_row and r.init_row not in job.rows}
    target = load_reference_target(plan, device)
    env = environment(device)
    outputs.write_json(out, "environment.json", dict(env, job=job.name, rows=job.rows, kind=job.kind))
    data, d2t, summaries = {}, None, []
    for i, row in enumerate(rows):
        if row.responses not in data:
            train, held, what = data_splits(plan, target, row.responses)
            base = row.train_config()
            # one held-out set for every row: a hybrid drafter's config collates every feature any row reads
            superset = drafter_config_for(target, "hybrid", draft_vocab_size=base.draft_vocab_size)
            eval_set = online_eval_set(
                held, superset, target, base.eval_sequences, base.batch_size, base.max_tokens
            )
            data[row.responses] = (train, held, what, eval_set)
        train, held, what, eval_set = data[row.responses]
        if (
            d2t is None
        ):  # one draft vocabulary for every row: the original training slice's most frequent tokens
            original = data_splits(plan, target, "original")[0]
            d2t = build_draft_vocab(original, target, row.train_config().draft_vocab_size)
        floor = min(20.0, 0.1 * (clock.deadline - clock.t0))  # the least a row is worth starting for
        if clock.left() < floor:  # rows run in priority order: the last ones give way
            summaries.append(dict(drafter=row.name, skipped=f"no time left ({clock.left():.0f} s)"))
            continue
        share = max(floor, clock.left() / (len(rows) - i))
        init = inits.get(row.name) or (str(runs_dir() / row.init_row) if row.init_row else None)
        t_row = time.perf_counter()
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        cfg0 = row.train_config(init_from=init)
        step_s, eval_s = calibrate(target, train, eval_set, cfg0, d2t)
        budget = share - (time.perf_counter() - t_row) - 5.0
        steps = max(1, int((budget - 2 * eval_s) / (step_s + eval_s / max(1, cfg0.eval_every))))
        cfg = row.train_config(init_from=init, train_steps=steps, max_seconds=max(1.0, budget - 2 * eval_s))
        result = train_drafter(
            target,
            train,
            held,
            cfg,
            runs_dir() / row.name,
            d2t=d2t,
            resume=False,
            progress=progress,
            eval_set=eval_set,
        )
        summary = run_summary(result)
        summary.update(
            max_memory_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if device.startswith("cuda")
            else None,
            responses=what,
            calibration_step_s=round(step_s, 4),
            calibration_eval_s=round(eval_s, 3),
            planned_steps=steps,
            row_seconds=round(time.perf_counter() - t_row, 1),
            headline=row.headline,
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


# --------------------------------------------------------------------------------------------- regenerate


def regenerate_job(plan: Plan, job: Job, out: Path, device: str, clock: Clock, progress: bool = True) -> dict:
    target = load_reference_target(plan, device)
    outputs.write_json(out, "environment.json", dict(environment(device), job=job.name, kind=job.kind))
    d, r = plan.data, plan.data["regenerate"]
    kw = dict(
        max_len=d["max_len"], seed=plan.seed, max_new_tokens=r["max_new_tokens"], max_turns=r["max_turns"]
    )
    kw.update(batch_size=r["batch_size"], shard_size=max(r["batch_size"], 64), progress=progress)
    from .payload import staged_prompts

    kw["conversations"] = staged_prompts()  # None off the device: read ShareGPT itself
    done = {}
    for split, n in (("eval", d["n_eval_conversations"]), ("train", d["n_train_conversations"])):
        t = time.perf_counter()
        stop_at = clock.left() - min(60.0, 0.1 * (clock.deadline - clock.t0))  # one shard may run past it
        regen = regenerate_sharegpt(target, split, n, max_seconds=max(1.0, stop_at), **kw)
        folder = assets.cache_dir() / "regenerated" / regen.spec["regenerated_dir"]
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


# --------------------------------------------------------------------------------------------------- eval


def eval_job(plan: Plan, job: Job, out: Path, device: str, clock: Clock, progress: bool = True) -> dict:
    from ..decoding import DecodeConfig
    from ..drafters import NgramDrafter, load_drafter
    from ..evaluation import acceptance

    target = load_reference_target(plan, device)
    outputs.write_json(
        out, "environment.json", dict(environment(device), job=job.name, kind=job.kind, rows=job.rows)
    )
    drafters = {name: load_drafter(checkpoint_path(plan, name), target) for name in job.rows}
    drafters["ngram"] = NgramDrafter(target.info.vocab_size)
    e, tree = plan.eval, plan.eval["tree"]
    base = DecodeConfig(
        max_new_tokens=e["max_new_tokens"],
        seed=plan.seed,
        chain_depth=e["chain_depth"],
        tree_depth=tree["depth"],
        tree_top_k=tree["top_k"],
        tree_budget=tree["budget"],
    )
    cfgs = acceptance.mode_configs(base, ["chain", "tree"])
    refs = batched_references(target, e["n_questions"], e["max_new_tokens"])
    runs, done = [], []
    for mode in ("chain", "tree"):
        for name, d in drafters.items():
            if not clock.enough(30):
                break
            runs += acceptance.run_greedy_replay(
                target, {name: d}, refs, {mode: cfgs[mode]}, progress=progress
            )
            done.append(dict(drafter=name, mode=mode, temperature=0.0))
            outputs.write_acceptance(out, runs, e.get("bootstrap", 1000), done)
    for (
        name,
        d,
    ) in drafters.items():  # temperature 1: the engine, one generation at a time, while time is left
        if not clock.enough(120):
            break
        sampled = {"chain": dataclasses.replace(cfgs["chain"], temperature=1.0)}
        runs += acceptance.run_engine(target, {name: d}, e["n_questions_sampled"], sampled, progress=progress)
        done.append(dict(drafter=name, mode="chain", temperature=1.0))
        outputs.write_acceptance(out, runs, e.get("bootstrap", 1000), done)
    return dict(done=done)


def batched_references(target, n_questions: int, max_new_tokens: int, batch_size: int = 80):
    """MT-bench greedy references for the replay, both turns, decoded in batches (turn 2 sees turn 1's answer).

    Batched greedy decoding equals one-at-a-time decoding up to float rounding (``tests/test_regenerate.py``);
    the replay then scores every drafter against these tokens with the target's states over them."""
    from ..corpus import answer_text, batched_greedy, chat_prompt_ids, load_mtbench, mtbench_messages
    from ..evaluation.acceptance import Reference

    stops = set(target.info.eos_token_ids)
    questions = load_mtbench(n_questions)
    refs, firsts = [], [None] * len(questions)
    for turn in (0, 1):
        prompts = [
            chat_prompt_ids(target.tokenizer, mtbench_messages(q, turn, firsts[i]))
            for i, q in enumerate(questions)
        ]
        outs = []
        for a in range(0, len(prompts), batch_size):
            outs += batched_greedy(target, prompts[a : a + batch_size], max_new_tokens, stop=False)
        for i, (q, p, ids) in enumerate(zip(questions, prompts, outs)):
            refs.append(Reference(q.question_id, turn, p, ids))
            firsts[i] = answer_text(target.tokenizer, ids, stops)
    return refs


def run(
    plan: Plan,
    job: Job,
    out_root: Path,
    device: str,
    t0: float,
    minutes: float | None = None,
    progress: bool = True,
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


def _json(x) -> str:
    return json.dumps(x, indent=1, default=str)
