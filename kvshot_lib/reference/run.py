"""The reference run on one machine: the plan's rows trained one after the other, evaluated, tabled and drawn.

    python -m kvshot_lib.reference                                         # the whole run, resumable
    python -m kvshot_lib.reference --smoke                                 # the same path at smoke scale

:func:`run_reference` does the steps in order, and rewrites the run's tables and figures after each trained
row and after the evaluation (:func:`~.tables.update_run`), so a run stopped half-way keeps what it finished:

* ``regenerate`` (plans with ``responses: regenerated``, best on a GPU): the target's own greedy answers to the
  held-out, then the training ShareGPT slice (:func:`regenerate_split`; resumable, cached as JSON), and what each
  slice the rows read yields after loop handling (``corpus_tokens.csv``);
* ``train``: every row of the plan in order (or the rows asked for), on one held-out set and one draft vocabulary
  (:mod:`.data`): each row trains to the plan's plateau rule or its token-pass cap (:func:`train_row`), resumes
  where a killed run last saved (bit-identical, :func:`~kvshot_lib.training.train_drafter`), and a finished row
  is read back, not retrained. After each row: its KV ablation (real / zeroed / shuffled target KV, KV readers),
  its wall time and machine, and, for the plan's headline rows, its committed checkpoint
  (:mod:`.checkpoints`). Trained drafters go to ``runs/<run>/drafters/<row>``, where notebooks 03, 04 and 06 look;
* ``heldout`` (plans with a ``baseline`` run): the trained rows and the baseline run's checkpoints on both runs'
  held-out sets (:mod:`.heldout`);
* ``eval``: the trained rows and the n-gram baseline on MT-bench: acceptance by step in chain and tree at
  temperature 0 by greedy replay, then a chain at temperature 1 with the engine on a subset (:func:`evaluate`);
* ``notebooks``: the profile's notebooks (notebook 04: query-estimation error and the causal check of the KV
  readers) through the runner, on the same ``runs/<run>/`` and ``figures/<run>/``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import pandas as pd
import torch

from ..corpus import regenerate_sharegpt
from ..target import load_target
from ..target.assets import REPO_ROOT
from ..training import read_train_state
from ..training.carry import carried_step
from .checkpoints import carried_folder, carry_saver, commit_checkpoint, stretch_table
from .data import (
    RowData,
    corpus_tokens,
    data_splits,
    draft_vocab,
    regeneration_root,
    row_data,
    train_steps_for,
)
from .heldout import cross_heldout
from .plan import Plan, PlanError, Row
from .tables import acceptance_tables, trained_tables, update_run

STEPS = ("regenerate", "train", "heldout", "eval", "notebooks")
__all__ = ["RowData", "data_splits", "draft_vocab", "row_data", "run_reference", "train_row"]


def environment(device: str) -> dict:
    """The machine and the software a run used (``reference_jobs.csv``)."""
    from ..evaluation.speedup import machine_info

    env = dict(machine_info(), device=device, started=time.strftime("%Y-%m-%d %H:%M:%S"))
    return dict(env, gpu=env["gpu"] if device.startswith("cuda") else None)


def resolve_device(device: str) -> str:
    """``auto``: CUDA when there is one, else the CPU (as ``load_target`` picks)."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def load_reference_target(plan: Plan, device: str):
    """The plan's target on ``device``: its dtype on a GPU (TF32 matmuls for the fp32 drafters), fp32 elsewhere
    (the drafters and the extraction then run under bf16 autocast where the CPU has it: ``mixed_precision``)."""
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    dtype = plan.dtype if device.startswith("cuda") else "float32"
    return load_target(plan.target, device=device, dtype=dtype, seed=plan.seed)


# -------------------------------------------------------------------------------------------------- train


def drafter_dir(plan: Plan, root: Path = REPO_ROOT) -> Path:
    """Where this machine's run keeps its trained rows: ``runs/<run>/drafters/``."""
    return Path(root) / "runs" / plan.run_name / "drafters"


def checkpoint_path(plan: Plan, name: str, root: Path = REPO_ROOT) -> Path:
    """A trained row's checkpoint: in ``runs/<run>/drafters/``, else the committed ``checkpoints/<run>/``."""
    places = (drafter_dir(plan, root) / name, Path(root) / committed_path(plan, name))
    for path in places:
        if (path / "config.json").is_file():
            return path
    raise PlanError(
        f"no checkpoint of row {name!r} in {', '.join(map(str, places))}. Train it first "
        f"(--steps train --rows {name}), or evaluate other rows with --rows."
    )


def committed_path(plan: Plan, name: str) -> Path:
    """Where row ``name``'s checkpoint is committed, relative to the checkout."""
    return Path("checkpoints") / plan.run_name / name


def carried_path(plan: Plan, name: str, root: Path = REPO_ROOT) -> Path:
    """Row ``name``'s carried folder (``<checkpoint>.partial``, :mod:`~kvshot_lib.training.carry`) under ``root``."""
    return Path(root) / carried_folder(committed_path(plan, name))


def init_path(plan: Plan, row: Row, root: Path = REPO_ROOT) -> str | None:
    """The checkpoint a row starts from (``init_from: <row>``), if any. A carried row that holds its own weights (a
    position in its carried folder, or a state or finished checkpoint in ``runs/``) keeps its committed path without
    it: it goes on from, or is read back from, those weights, and its starting checkpoint may have left the
    repository (git history keeps it)."""
    if row.init_row is None:
        return None
    try:
        return str(checkpoint_path(plan, row.init_row, root))
    except PlanError as e:
        own = drafter_dir(plan, root) / row.name
        held = (own / "config.json").is_file() or read_train_state(own) is not None
        if row.carry and (held or carried_step(carried_path(plan, row.name, root))):
            return str(Path(root) / committed_path(plan, row.init_row))
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
    resume: bool = True,
    carried: Path | None = None,
    limits: dict | None = None,
    known_stretches: Path | None = None,
    **overrides,
):
    """Train ``row`` into ``out_dir`` (``overrides``: TrainConfig parameters, e.g. ``train_steps``), resuming a
    killed run of the same configuration, or reading a finished one back; returns the training result and its
    summary row (``reference_rows.csv``: unique tokens and token-passes, wall time, machine, plateau).
    ``carried``: the row's folder under ``checkpoints/`` that keeps its position between sessions
    (:func:`~.checkpoints.carry_saver`, within the checkpoints' ``limits``), resumed from when ``out_dir`` has no
    state as far along; ``known_stretches``: its committed table of stretches between restarts, which names the
    machines of those its logs do not (:func:`~kvshot_lib.training.run_stretches`)."""
    from ..training import run_machine, run_summary, train_drafter

    t0, cuda = time.perf_counter(), target.info.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    cfg = row.train_config(**({"init_from": init} if init else {}), **overrides)
    read_back = resume and finished_already(out_dir, cfg)  # resume=False trains afresh, whatever is there
    result = train_drafter(
        target, data.train, data.held, cfg, out_dir, d2t=d2t, resume=resume, progress=progress,
        eval_set=data.eval_set, carried=carried, on_save=carry_saver(carried, **(limits or {})) if carried else None,
    )  # fmt: skip
    if known_stretches is not None and known_stretches.is_file():
        result.known_stretches = pd.read_csv(known_stretches)
    summary = run_summary(result)
    summary.update(
        unique_tokens=data.unique_tokens,
        epochs=round(summary["train_tokens"] / max(1, data.unique_tokens), 2),
        max_memory_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        responses=data.what,
        row_seconds=summary["seconds"] if read_back else round(time.perf_counter() - t0, 1),
        headline=row.headline,
        **run_machine(result),
    )
    return result, summary


def finished_already(out_dir: Path, cfg) -> bool:
    """Whether ``out_dir`` holds this row finished with these settings (then it is read back, not trained).
    Refuses a finished row that had other settings (say, a stage-1 row asked for without the ``--budget`` it was
    trained with): the training loop would start afresh and overwrite it."""
    from ..training import finished_config

    old, new = finished_config(out_dir), cfg.as_dict()
    if old is None or old == new:
        return old is not None
    diff = ", ".join(f"{k} {old.get(k)!r} there, {v!r} asked" for k, v in new.items() if old.get(k) != v)
    raise PlanError(
        f"row {cfg.name!r} is trained already in {out_dir} with other settings ({diff}); training it again "
        "would overwrite it. Ask for the settings it was trained with to read it back (e.g. the same --budget), "
        "or move that folder aside to retrain."
    )


def kv_ablation(result, target, held) -> pd.DataFrame:
    """The row's held-out accuracy with the target KV real, zeroed and shuffled (empty for a non-KV reader), on
    ``held``: a feature store, or for an online row a tokenized split whose features the target computes."""
    from ..training import kv_ablation_table

    c = result.config
    return kv_ablation_table(
        [result], held, target, c.eval_steps, c.eval_sequences, c.batch_size, c.max_tokens,
        c.eval_branch_fraction,
    )  # fmt: skip


def train_rows(plan: Plan, target, names: list[str], root: Path, progress: bool, update, **overrides) -> None:
    """Train ``names`` one after the other (module docstring), updating the run's tables after each and its
    figures after the last (``update(tables, kind, done, draw)``)."""
    out_dir, data, d2t = drafter_dir(plan, root), {}, None
    limits = {"max_file_mb": 16, "max_total_mb": 60, **plan.checkpoints}
    for i, name in enumerate(names):
        row = plan.row(name)
        key = (row.responses, row.params.get("data_source"), row.loops, json.dumps(row.data, sort_keys=True))
        data[key] = data.get(key) or row_data(plan, target, row, progress)
        d2t = d2t if d2t is not None else draft_vocab(plan, target, row.train_config().draft_vocab_size)
        steps = train_steps_for(plan, row, data[key])
        own = dict({"train_steps": steps} if steps else {}, **overrides)
        init = init_path(plan, row, root)
        rel = committed_path(plan, name)
        carried = carried_path(plan, name, root) if row.carry else None
        result, summary = train_row(
            plan,
            row,
            target,
            data[key],
            d2t,
            out_dir / name,
            init,
            progress,
            carried=carried,
            limits=limits,
            known_stretches=stretch_table(root, plan.run_name, name) if row.carry else None,
            **own,
        )
        summary["paper_row"] = row.paper
        if row.headline or row.carry:  # a carried row's checkpoint takes its position's place (and room)
            if carried is not None:
                shutil.rmtree(carried, ignore_errors=True)
            summary.update(commit_checkpoint(result.drafter, Path(root) / rel, **limits))
            summary["checkpoint"] = str(rel) if summary["checkpoint"] else ""
        ablation = kv_ablation(result, target, data[key].held)
        update(trained_tables([result], [summary], ablation), "train", names[: i + 1], i == len(names) - 1)
        del result


# --------------------------------------------------------------------------------------------- regenerate


def regenerate_split(plan: Plan, target, split: str, max_seconds=None, conversations=None, progress=True):
    """Regenerate the ``split`` slice's responses (resumable); returns the regeneration and its folder.
    ``conversations``: ``{id: messages}`` to answer instead of reading ShareGPT."""
    d, r = plan.data, plan.data["regenerate"]
    n = d["n_eval_conversations"] if split == "eval" else d["n_train_conversations"]
    regen = regenerate_sharegpt(
        target, split, n, max_len=d["max_len"], seed=plan.seed, max_new_tokens=r["max_new_tokens"],
        max_turns=r["max_turns"], batch_size=r["batch_size"], shard_size=r.get("shard_size", max(r["batch_size"], 64)),
        progress=progress, conversations=conversations, max_seconds=max_seconds, min_len=int(d.get("min_len", 0)),
        engine=r.get("engine", "suite"), root=regeneration_root(plan), stop_at_loop=bool(r.get("stop_at_loop", False)),
    )  # fmt: skip
    return regen, regeneration_root(plan) / regen.spec["regenerated_dir"]


# --------------------------------------------------------------------------------------------------- eval


def evaluate(
    plan: Plan,
    target,
    drafters: dict,
    progress: bool = True,
    cache: Path | None = None,
):
    """MT-bench acceptance of ``drafters`` (``{name: drafter}``): chain and tree at temperature 0 by greedy replay
    on greedy references decoded in batches, then a chain at temperature 1 with the engine. ``cache``: the JSON
    file that keeps the greedy references (notebook 04 reads the same ones). Returns (runs, done)."""
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
        target, e["n_questions"], e["max_new_tokens"], progress, cache=cache, batch_size=80
    )
    # one pass of the target over each reference serves every drafter and both modes
    runs = acceptance.run_greedy_replay(target, drafters, refs, cfgs, progress=progress)
    done = [dict(drafter=name, mode=mode, temperature=0.0) for mode in cfgs for name in drafters]
    for name, d in drafters.items():  # temperature 1: the engine, one generation at a time
        sampled = {"chain": dataclasses.replace(cfgs["chain"], temperature=1.0)}
        runs += acceptance.run_engine(target, {name: d}, e["n_questions_sampled"], sampled, progress=progress)
        done.append(dict(drafter=name, mode="chain", temperature=1.0))
    return runs, done


def evaluated_checkpoints(plan: Plan, rows: list[str] | None, root: Path) -> tuple[dict, list[str]]:
    """The checkpoints the eval steps measure, ``{label: folder}`` (``rows``, else the plan's eval rows that were
    trained; and the ``baseline`` run's committed checkpoints paired with them, ``<row>@<run>``), and the plan's
    eval rows left out because they have no checkpoint (rows dropped for time)."""
    found, missing = {}, []
    for name in rows or plan.eval_rows():
        try:
            found[name] = checkpoint_path(plan, name, root=root)
        except PlanError:
            if rows:
                raise
            missing.append(name)
    for own, label in plan.baseline_pairs():  # another run's committed checkpoints, e.g. hidden-ttt@reference
        if rows and own not in rows:  # only the pairs of the rows asked for
            continue
        row, run = label.split("@")
        folder = Path(root) / "checkpoints" / run / row
        if label not in found and (folder / "config.json").is_file():
            found[label] = folder
    return found, missing


def evaluated_drafters(plan: Plan, target, rows: list[str] | None, root: Path) -> tuple[dict, list[str]]:
    """The drafters of :func:`evaluated_checkpoints`, loaded, and the n-gram drafter (MT-bench's baseline)."""
    from ..drafters import NgramDrafter, load_drafter

    found, missing = evaluated_checkpoints(plan, rows, root)
    drafters = {name: load_drafter(path, target) for name, path in found.items()}
    drafters["ngram"] = NgramDrafter(target.info.vocab_size)
    return drafters, missing


# ------------------------------------------------------------------------------------------------ the run


def status(plan: Plan, root: Path = REPO_ROOT) -> pd.DataFrame:
    """Where each row of a (running or stopped) run stands, from its folder alone: done, at step n of its cap
    (the last saved state, or its carried position under ``checkpoints/`` where that is further), or not started;
    with token-passes, the last held-out acc_0 and the hours so far."""
    import json

    from ..training.carry import carried_ahead, read_carried
    from ..training.state import read_train_state

    rows = []
    for name in plan.training_order():
        out = drafter_dir(plan, root) / name
        rec = dict(
            row=name, state="not started", step=None, cap=None, token_passes=None, acc_0=None, hours=None
        )
        meta = read_train_state(out)
        carried = carried_path(plan, name, root)
        state = "training"
        if carried_ahead(carried, meta):
            meta, state = read_carried(carried), "carried"  # to go on from, on this machine or another
        cfg_file = out / "config.json"
        extra = json.loads(cfg_file.read_text()).get("extra", {}) if cfg_file.is_file() else {}
        if extra.get("completed"):
            rec.update(state="done", step=extra["steps_trained"], cap=extra["train_config"]["train_steps"],
                       token_passes=extra["train_tokens"], acc_0=extra["final_eval"].get("acc_0"),
                       hours=extra["train_seconds"] / 3600)  # fmt: skip
        elif meta is not None:
            logs = meta["logs"]
            rec.update(state=state, step=meta["step"], cap=meta["config"]["train_steps"],
                       token_passes=sum(h["tokens"] for h in logs["history"]),
                       acc_0=logs["eval"][-1]["acc_0"] if logs["eval"] else None,
                       hours=logs.get("_seconds", 0.0) / 3600)  # fmt: skip
        rows.append(rec)
    return pd.DataFrame(rows)


def run_notebooks(plan: Plan, root: Path) -> list[dict]:
    """The profile's notebooks (its ``notebooks:`` list) on this run's folders, with the plan's notebook
    parameters (``notebooks:`` of the reference section, with its smoke overrides)."""
    from ..runner import load_profile, run_profile

    if not load_profile(plan.profile).notebooks:
        return []
    sets = dict(plan.notebooks)
    if plan.smoke:
        sets.update(target=plan.target, device="cpu", dtype="float32")
    return run_profile(plan.profile, sets=sets, root=Path(root), run_name=plan.run_name)


def run_reference(
    plan: Plan,
    device: str,
    steps=STEPS,
    rows: list[str] | None = None,
    root: Path = REPO_ROOT,
    progress: bool = True,
    figures: bool = True,
    **train_overrides,
) -> dict:
    """The run on this machine (module docstring): ``steps`` of :data:`STEPS`, ``rows`` (default: every row in
    training order; evaluated: the plan's eval rows). Writes ``root/runs/<run>/``, ``root/figures/<run>/`` and
    ``root/checkpoints/<run>/``; the tables after every row, the figures (``figures``) after each step."""
    if any(s not in STEPS for s in steps):
        raise PlanError(f"the run's steps are {list(STEPS)}, got {list(steps)}.")
    device = resolve_device(device)
    names = [plan.row(r).name for r in rows] if rows else plan.training_order()
    t0, env, record = time.perf_counter(), environment(device), dict(steps=list(steps))
    target = load_reference_target(plan, device) if set(steps) - {"notebooks"} else None

    def update(tables: dict, kind: str, done: list[str], draw: bool = True) -> None:
        info = dict(job=f"{kind}@{env['host']}", kind=kind, rows=" ".join(done), gpu=env["gpu"] or device,
                    cpu=env.get("cpu"), torch=env["torch"], transformers=env["transformers"],
                    started=env["started"], seconds=round(time.perf_counter() - t0, 1))  # fmt: skip
        update_run(plan, {**tables, "reference_jobs.csv": pd.DataFrame([info])}, root, draw=draw and figures)

    if "regenerate" in steps and plan.data.get("responses", "regenerated") == "regenerated":
        record["regenerated"] = {
            s: len(regenerate_split(plan, target, s, progress=progress)[0]) for s in ("eval", "train")
        }
        update({"corpus_tokens.csv": corpus_tokens(plan, target)}, "regenerate", [], draw=False)
    if "train" in steps:
        train_rows(plan, target, names, root, progress, update, **train_overrides)
        record["trained"] = names
    if "heldout" in steps and plan.baseline:
        found, record["not_on_both_heldout"] = evaluated_checkpoints(plan, rows, root)
        cross = cross_heldout(plan, target, found, progress)
        update({"heldout_cross.csv": cross}, "heldout", list(found))
    if "eval" in steps:
        drafters, record["not_evaluated"] = evaluated_drafters(plan, target, rows, root)
        cache = Path(root) / "runs" / plan.run_name / "results" / "mtbench_greedy.json"
        runs, record["evaluated"] = evaluate(plan, target, drafters, progress=progress, cache=cache)
        update(acceptance_tables(runs, plan.eval.get("bootstrap", 1000)), "eval", list(drafters))
    if "notebooks" in steps:
        record["notebooks"] = [r["notebook"] for r in run_notebooks(plan, root)]
    return record
