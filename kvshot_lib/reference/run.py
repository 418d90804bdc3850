"""The reference run on one machine: regenerate the responses, train the plan's rows, evaluate them on MT-bench.

    python -m kvshot_lib.reference --profile reference --device cuda       # the whole run, on a GPU
    python -m kvshot_lib.reference --smoke --device cpu                    # the same path at smoke scale

:func:`run_reference` does the steps in order, and rewrites the run's tables and figures after each trained
row and after the evaluation (:func:`~.tables.update_run`), so a run stopped half-way keeps what it finished:

* ``regenerate``: the target's own greedy answers to the held-out, then the training ShareGPT slice
  (:func:`regenerate`; resumable, cached as JSON);
* ``train``: every row of the plan in its jobs' order (or the rows asked for), online, one held-out set and one
  draft vocabulary for all (:func:`train_row`); checkpoints go to ``runs/<profile>/drafters/<row>``, where
  notebooks 03 and 06 look for drafters;
* ``eval``: the plan's evaluation rows and the n-gram baseline on MT-bench: acceptance by step in chain and tree
  at temperature 0 by greedy replay, then a chain at temperature 1 with the engine (:func:`evaluate`).

Each piece takes what it needs as arguments, so a runner with limits of its own (the time-boxed remote jobs of
``scripts/reference/``) calls the same functions.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from ..corpus import cached_regeneration, regenerate_sharegpt, tokenize_sharegpt
from ..target import assets, load_target
from ..target.assets import REPO_ROOT
from .plan import Plan, PlanError, Row
from .tables import acceptance_tables, trained_tables, update_run

STEPS = ("regenerate", "train", "eval")


def environment(device: str) -> dict:
    """The machine and the software a run used (``reference_jobs.csv``)."""
    from ..evaluation.speedup import machine_info

    env = dict(machine_info(), device=device, started=time.strftime("%Y-%m-%d %H:%M:%S"))
    return dict(env, gpu=env["gpu"] if device.startswith("cuda") else None)


def load_reference_target(plan: Plan, device: str):
    """The plan's target on ``device``: its dtype on a GPU (TF32 matmuls for the fp32 drafters), fp32 elsewhere."""
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    dtype = plan.dtype if device.startswith("cuda") else "float32"
    return load_target(plan.target, device=device, dtype=dtype, seed=plan.seed)


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


@dataclass
class RowData:
    """What the rows of one kind of responses train and are evaluated on."""

    train: object  # TokenizedSplit
    held: object
    what: str  # which responses, for the tables
    eval_set: object  # the held-out EvalSet every row is measured on


def row_data(plan: Plan, target, row: Row) -> RowData:
    """The data of ``row``'s responses, with one held-out set for every row (a hybrid drafter's config collates
    every feature any row reads)."""
    from ..drafters import drafter_config_for
    from ..training import online_eval_set

    train, held, what = data_splits(plan, target, row.responses)
    base = row.train_config()
    superset = drafter_config_for(target, "hybrid", draft_vocab_size=base.draft_vocab_size)
    eval_set = online_eval_set(held, superset, target, base.eval_sequences, base.batch_size, base.max_tokens)
    return RowData(train, held, what, eval_set)


def draft_vocab(plan: Plan, target, size: int) -> torch.Tensor:
    """One draft vocabulary for every row: the original training slice's ``size`` most frequent tokens."""
    from ..training import build_draft_vocab

    return build_draft_vocab(data_splits(plan, target, "original")[0], target, size)


# -------------------------------------------------------------------------------------------------- train


def drafter_dir(plan: Plan, root: Path = REPO_ROOT) -> Path:
    """Where this machine's run keeps its trained rows: ``runs/<profile>/drafters/``."""
    return Path(root) / "runs" / plan.profile / "drafters"


def checkpoint_path(plan: Plan, name: str, trained_in: Path | None = None) -> Path:
    """A trained row's checkpoint: in ``trained_in`` (a runner's own folder), else ``runs/<profile>/drafters/``,
    else the committed ``checkpoints/<profile>/``."""
    places = (*([Path(trained_in) / name] if trained_in else []), drafter_dir(plan) / name)
    places += (REPO_ROOT / "checkpoints" / plan.profile / name,)
    for path in places:
        if (path / "config.json").is_file():
            return path
    raise PlanError(
        f"no checkpoint of row {name!r} in {', '.join(map(str, places))}. Train it first, carry "
        f"runs/{plan.profile}/drafters/{name} with the call (or evaluate other rows with --rows)."
    )


def init_path(plan: Plan, row: Row, trained_in: Path | None = None) -> str | None:
    """The checkpoint a row starts from (``init_from``), if any."""
    if row.init_row is None:
        return None
    try:
        return str(checkpoint_path(plan, row.init_row, trained_in))
    except PlanError as e:
        raise PlanError(f"row {row.name!r} starts from row {row.init_row!r}: {e}") from None


def train_row(
    plan: Plan,
    row: Row,
    target,
    data: RowData,
    d2t,
    out_dir: Path,
    init: str | None = None,
    progress=True,
    **overrides,
):
    """Train ``row`` into ``out_dir`` (``overrides``: TrainConfig parameters, e.g. ``train_steps``); returns the
    training result and its summary row (``reference_rows.csv``)."""
    from ..training import run_summary, train_drafter

    t0, cuda = time.perf_counter(), target.info.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    cfg = row.train_config(init_from=init, **overrides)
    result = train_drafter(
        target,
        data.train,
        data.held,
        cfg,
        out_dir,
        d2t=d2t,
        resume=False,
        progress=progress,
        eval_set=data.eval_set,
    )
    summary = run_summary(result)
    summary.update(
        max_memory_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        responses=data.what,
        row_seconds=round(time.perf_counter() - t0, 1),
        headline=row.headline,
    )
    return result, summary


# --------------------------------------------------------------------------------------------- regenerate


def regenerate_split(plan: Plan, target, split: str, max_seconds=None, conversations=None, progress=True):
    """Regenerate the ``split`` slice's responses (resumable); returns the regeneration and its cache folder.
    ``conversations``: ``{id: messages}`` to answer instead of reading ShareGPT."""
    d, r = plan.data, plan.data["regenerate"]
    n = d["n_eval_conversations"] if split == "eval" else d["n_train_conversations"]
    regen = regenerate_sharegpt(
        target, split, n, max_len=d["max_len"], seed=plan.seed, max_new_tokens=r["max_new_tokens"],
        max_turns=r["max_turns"], batch_size=r["batch_size"], shard_size=max(r["batch_size"], 64),
        progress=progress, conversations=conversations, max_seconds=max_seconds,
    )  # fmt: skip
    return regen, assets.cache_dir() / "regenerated" / regen.spec["regenerated_dir"]


# --------------------------------------------------------------------------------------------------- eval


def evaluate(
    plan: Plan,
    target,
    drafters: dict,
    keep_going: Callable[[float], bool] = lambda seconds: True,
    on_progress: Callable[[list, list], None] | None = None,
    progress: bool = True,
):
    """MT-bench acceptance of ``drafters`` (``{name: drafter}``): chain and tree at temperature 0 by greedy replay
    on greedy references decoded in batches, then a chain at temperature 1 with the engine. ``keep_going(seconds)`` is asked
    before each measurement (a runner's clock); ``on_progress(runs, done)`` after each. Returns (runs, done)."""
    from ..decoding import DecodeConfig
    from ..evaluation import acceptance

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
    refs = acceptance.greedy_references(
        target, e["n_questions"], e["max_new_tokens"], progress, batch_size=80
    )
    runs, done = [], []
    for mode in ("chain", "tree"):
        for name, d in drafters.items():
            if not keep_going(30):
                break
            runs += acceptance.run_greedy_replay(
                target, {name: d}, refs, {mode: cfgs[mode]}, progress=progress
            )
            done.append(dict(drafter=name, mode=mode, temperature=0.0))
            if on_progress is not None:
                on_progress(runs, done)
    for name, d in drafters.items():  # temperature 1: the engine, one generation at a time
        if not keep_going(120):
            break
        sampled = {"chain": dataclasses.replace(cfgs["chain"], temperature=1.0)}
        runs += acceptance.run_engine(target, {name: d}, e["n_questions_sampled"], sampled, progress=progress)
        done.append(dict(drafter=name, mode="chain", temperature=1.0))
        if on_progress is not None:
            on_progress(runs, done)
    return runs, done


# ------------------------------------------------------------------------------------------------ the run


def run_reference(
    plan: Plan,
    device: str,
    steps=STEPS,
    rows: list[str] | None = None,
    root: Path = REPO_ROOT,
    progress: bool = True,
    **train_overrides,
) -> dict:
    """The run on this machine (module docstring): ``steps`` of :data:`STEPS`, ``rows`` (default: every row in
    the order of the plan's jobs; evaluated: the eval job's). Writes ``root/runs/<profile>/``, ``root/figures/``."""
    if any(s not in STEPS for s in steps):
        raise PlanError(f"the run's steps are {list(STEPS)}, got {list(steps)}.")
    order = [r for job in plan.jobs.values() if job.kind == "train" for r in job.rows]
    names = [plan.row(r).name for r in rows] if rows else order + [r for r in plan.rows if r not in order]
    t0, env, record = time.perf_counter(), environment(device), dict(steps=list(steps))
    target, out_dir = load_reference_target(plan, device), drafter_dir(plan, root)

    def update(tables: dict, kind: str, done: list[str]) -> None:
        info = dict(job=f"{kind}@{env['host']}", kind=kind, rows=" ".join(done), gpu=env["gpu"] or device,
                    torch=env["torch"], transformers=env["transformers"], started=env["started"],
                    seconds=round(time.perf_counter() - t0, 1))  # fmt: skip
        update_run(plan, {**tables, "reference_jobs.csv": pd.DataFrame([info])}, root)

    if "regenerate" in steps and plan.data.get("responses", "regenerated") == "regenerated":
        record["regenerated"] = {
            s: len(regenerate_split(plan, target, s, progress=progress)[0]) for s in ("eval", "train")
        }
    if "train" in steps:
        data, d2t = {}, None
        for i, name in enumerate(
            names
        ):  # the tables are rewritten after each row: a stopped run keeps what it had
            row = plan.row(name)
            data[row.responses] = data.get(row.responses) or row_data(plan, target, row)
            d2t = d2t if d2t is not None else draft_vocab(plan, target, row.train_config().draft_vocab_size)
            init = init_path(plan, row, out_dir)
            result, summary = train_row(
                plan, row, target, data[row.responses], d2t, out_dir / name, init, progress, **train_overrides
            )
            update(trained_tables([result], [summary]), "train", names[: i + 1])
            del result
        record["trained"] = names
    if "eval" in steps:
        from ..drafters import NgramDrafter, load_drafter

        chosen = rows or [r for job in plan.jobs.values() if job.kind == "eval" for r in job.rows]
        drafters = {name: load_drafter(checkpoint_path(plan, name, out_dir), target) for name in chosen}
        drafters["ngram"] = NgramDrafter(target.info.vocab_size)
        runs, record["evaluated"] = evaluate(plan, target, drafters, progress=progress)
        update(acceptance_tables(runs, plan.eval.get("bootstrap", 1000)), "eval", chosen)
    return record
