"""CPU studies for the reference run (issue 13), on SmolLM2 with the default run's data and settings.

Each study trains drafters with the settings of the default profile's notebook 02 (read from the profile and
the notebook's parameters cell, so the two cannot drift apart), prints a table and saves it as CSV + JSON under
``benchmarks/results/`` with the machine named:

    python benchmarks/cpu_studies.py vocab          # draft vocabulary 4k / 8k / 16k: coverage and acc_0
    python benchmarks/cpu_studies.py control        # the no-target control (paradigm "none") at the default budget
    python benchmarks/cpu_studies.py regeneration   # hidden-only TTT on original vs regenerated responses

Options: ``--steps N`` (default: the profile's 400), ``--threads 1`` (default), ``--out DIR``. Checkpoints and
logs go to ``runs/studies/<study>/`` (git-ignored); finished runs are reused, so a study can be resumed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pandas as pd  # noqa: E402
import torch  # noqa: E402

from kvshot_lib import corpus  # noqa: E402
from kvshot_lib.drafters import count_tokens, coverage  # noqa: E402
from kvshot_lib.evaluation import speedup  # noqa: E402
from kvshot_lib.runner import NOTEBOOK_DIR, load_profile, notebook_parameters  # noqa: E402
from kvshot_lib.target import load_target  # noqa: E402
from kvshot_lib.training import (  # noqa: E402
    build_draft_vocab,
    greedy_targets,  # noqa: E402
    parse_drafter_specs,
    train_drafter,
)

RESULTS = ROOT / "benchmarks" / "results"
SHARED_KEYS = (
    "train_steps",
    "batch_size",
    "max_tokens",
    "lr",
    "ttt_steps",
    "branch_fraction",
    "query_group",
    "eval_every",
    "eval_sequences",
    "eval_branch_fraction",
    "draft_vocab_size",
    "seed",
)


def default_settings() -> dict:
    """Notebook 02's parameters under the default profile: the data slice and the shared training settings."""
    params = notebook_parameters(NOTEBOOK_DIR / "02_train_drafters.ipynb")
    profile = load_profile("default")
    params.update({k: v for k, v in profile.parameters.items() if k in params})
    params.update(profile.overrides.get("02", {}))
    return params


def shared_training(params: dict, steps: int | None) -> dict:
    shared = {k: params[k] for k in SHARED_KEYS}
    shared["max_tokens"] = shared["max_tokens"] or None
    shared["query_group"] = shared["query_group"] or None
    shared["probe_every"] = 0  # gradient probes change nothing in training and cost time
    if steps:
        shared["train_steps"] = steps
        shared["eval_every"] = max(1, min(shared["eval_every"], steps // 4))
    return shared


def load_default_data(params: dict):
    tgt = load_target(params["target"], device="cpu", dtype="float32")
    n_train, n_eval, max_len = (
        params["n_train_conversations"],
        params["n_eval_conversations"],
        params["max_len"],
    )
    train_split = corpus.tokenize_sharegpt(tgt.tokenizer, "train", n_train, max_len, seed=params["seed"])
    eval_split = corpus.tokenize_sharegpt(tgt.tokenizer, "eval", n_eval, max_len, seed=params["seed"])
    return (
        tgt,
        train_split,
        eval_split,
        corpus.extract_features(tgt, train_split),
        corpus.extract_features(tgt, eval_split),
    )


def run_row(tgt, train_store, eval_store, spec: dict, shared: dict, out_dir: Path, d2t=None) -> dict:
    cfg = parse_drafter_specs([spec], shared)[0]
    result = train_drafter(tgt, train_store, eval_store, cfg, out_dir / cfg.name, d2t=d2t)
    final = result.final_eval()
    tokens = sum(h["tokens"] for h in result.logs["history"])
    row = dict(drafter=cfg.name, paradigm=cfg.paradigm, regime=cfg.regime, train_steps=cfg.train_steps)
    row.update({k: round(v, 4) for k, v in final.items() if k.startswith("acc_") or k == "ceiling"})
    row.update(n_0=final.get("n_0"), train_tokens=tokens, seconds=round(result.train_seconds, 1))
    row["tokens_per_s"] = round(tokens / max(result.train_seconds, 1e-9), 1)
    return row


def save(name: str, rows: list[dict], meta: dict, out: Path) -> pd.DataFrame:
    out.mkdir(parents=True, exist_ok=True)
    machine = speedup.machine_name(speedup.machine_info())
    table = pd.DataFrame(rows)
    table.to_csv(out / f"{name}_{machine}.csv", index=False)
    meta = dict(meta, machine=speedup.machine_info(), torch_threads=torch.get_num_threads(), rows=rows)
    (out / f"{name}_{machine}.json").write_text(json.dumps(meta, indent=1, default=str))
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print(table)
    print("saved", out / f"{name}_{machine}.csv")
    return table


def study_vocab(args, params, shared) -> None:
    """Coverage of the held-out greedy tokens and held-out acc_0 of hidden-only TTT at each draft vocabulary."""
    tgt, _, _, train_store, eval_store = load_default_data(params)
    V = tgt.info.vocab_size
    train_counts, eval_counts = count_tokens(train_store, V), count_tokens(eval_store, V)
    n_eval = min(shared["eval_sequences"], len(eval_store))
    greedy = torch.zeros(
        V, dtype=torch.int64
    )  # the target's greedy next token at every held-out assistant position
    for i, top in enumerate(greedy_targets(eval_store, tgt, len(eval_store))):
        mask = eval_store.sequence(i, ["loss_mask"])["loss_mask"].bool()
        want = top[:-1][mask[1:]]  # position t predicts token t+1, counted where t+1 is an assistant token
        greedy += torch.bincount(want, minlength=V)[:V]
    rows = []
    for size in args.sizes:
        d2t = build_draft_vocab(train_store, tgt, size)
        spec = dict(
            paradigm="hidden", regime=args.regime, name=f"hidden-{args.regime}-v{size}", draft_vocab_size=size
        )
        if args.eval_steps:
            spec["eval_steps"] = args.eval_steps
        row = dict(draft_vocab_size=size, share_of_target_vocab=round(size / V, 4))
        row.update(
            coverage_train_assistant=round(coverage(d2t, train_counts), 4),
            coverage_heldout_assistant=round(coverage(d2t, eval_counts), 4),
            coverage_heldout_greedy=round(coverage(d2t, greedy), 4),
        )
        t0 = time.perf_counter()
        row.update(run_row(tgt, train_store, eval_store, spec, shared, args.runs / "vocab", d2t=d2t))
        print(f"vocab {size}: done in {time.perf_counter() - t0:.0f} s", flush=True)
        rows.append(row)
    meta = dict(
        study="draft vocabulary",
        target=tgt.info.name,
        train=f"{len(train_store)} ShareGPT conversations ({train_store.n_tokens} tokens)",
        heldout=f"{len(eval_store)} conversations; acc_k on the first {n_eval}",
        settings=shared,
        note="coverage_heldout_greedy: share of the target's greedy next tokens at held-out assistant positions "
        "that the draft vocabulary (the most frequent training assistant tokens) contains: the ceiling of acc_k.",
    )
    save("draft_vocab_study", rows, meta, args.out)


def study_control(args, params, shared) -> None:
    """The no-target control (paradigm "none") trained like the default run's drafters (TTT and TF)."""
    tgt, _, _, train_store, eval_store = load_default_data(params)
    d2t = build_draft_vocab(train_store, tgt, shared["draft_vocab_size"])
    rows = []
    for regime in args.regimes:
        spec = dict(paradigm="none", regime=regime)
        rows.append(run_row(tgt, train_store, eval_store, spec, shared, args.runs / "control", d2t=d2t))
    meta = dict(
        study="no-target control",
        target=tgt.info.name,
        train=f"{len(train_store)} ShareGPT conversations ({train_store.n_tokens} tokens)",
        heldout=f"{len(eval_store)} conversations; acc_k on the first {min(shared['eval_sequences'], len(eval_store))}",
        settings=shared,
    )
    save("no_target_control", rows, meta, args.out)


REGEN = dict(max_new_tokens=256, max_turns=1)


def head(split, n: int):
    """The first ``n`` conversations of a tokenized split (a new spec, so caches tell it apart)."""
    from kvshot_lib.corpus import TokenizedSplit

    k = min(n, len(split))
    return TokenizedSplit(
        split.ids[:k], split.loss_mask[:k], split.source_ids[:k], dict(split.spec, head=k), split.counts
    )


def regenerated_data(args, params, tgt):
    """The default slices with the target's own greedy responses: ``--regen-conversations`` training conversations
    (a prefix of the 300; what is cached is used, and generated further only if missing) and the first
    ``eval_sequences`` held-out ones."""
    n_train, n_eval, max_len, seed = (
        params[k] for k in ("n_train_conversations", "n_eval_conversations", "max_len", "seed")
    )
    kw = dict(max_len=max_len, seed=seed, batch_size=args.regen_batch, **REGEN)
    n_held = params["eval_sequences"]
    held_split = corpus.tokenize_sharegpt(tgt.tokenizer, "eval", n_eval, max_len, seed=seed)
    held = corpus.cached_regeneration(tgt, held_split, REGEN["max_new_tokens"], REGEN["max_turns"])
    if held is None or len(held) + held.counts.get("template_mismatch", 0) < n_held:
        held = corpus.regenerate_sharegpt(tgt, "eval", n_eval, shard_size=n_held, max_seconds=0.0, **kw)
    train = corpus.tokenize_sharegpt(tgt.tokenizer, "train", n_train, max_len, seed=seed)
    regen = corpus.cached_regeneration(tgt, train, REGEN["max_new_tokens"], REGEN["max_turns"])
    while regen is None or len(regen) + regen.counts.get("template_mismatch", 0) < args.regen_conversations:
        regen = corpus.regenerate_sharegpt(tgt, "train", n_train, shard_size=64, max_seconds=0.0, **kw)
    return head(regen, args.regen_conversations), head(held, n_held)


def study_regeneration(args, params, shared) -> None:
    """Hidden-only TTT on the same conversations with their original vs the target's regenerated responses,
    at equal training tokens; both evaluated on the original and on the regenerated held-out slice."""
    from kvshot_lib.training import EvalSet, evaluate_per_step

    tgt, train_split, eval_split, train_store, eval_store = load_default_data(params)
    regen_train, regen_eval = regenerated_data(args, params, tgt)
    if args.data_only:
        print(len(regen_train), regen_train.counts, len(regen_eval), regen_eval.counts)
        return
    n = args.regen_conversations
    orig_train = corpus.tokenize_sharegpt(tgt.tokenizer, "train", n, params["max_len"], seed=params["seed"])
    assert set(regen_train.source_ids) <= set(orig_train.source_ids), (
        "the two arms must share their conversations"
    )
    stores = {
        "original": corpus.extract_features(tgt, orig_train),
        "regenerated": corpus.extract_features(tgt, regen_train),
    }
    regen_eval_store = corpus.extract_features(tgt, regen_eval)
    d2t = build_draft_vocab(
        train_store, tgt, shared["draft_vocab_size"]
    )  # the default run's vocabulary, both arms
    steps = args.steps or 200
    mean_len = {
        k: sum(min(len(x), shared["max_tokens"]) for x in s.ids) / len(s.ids)
        for k, s in (("original", orig_train), ("regenerated", regen_train))
    }
    arms = {}
    for data, store in stores.items():
        arm_steps = (
            steps if data == "original" else round(steps * mean_len["original"] / mean_len["regenerated"])
        )
        arm = dict(shared, train_steps=arm_steps, eval_every=max(1, arm_steps // 4))
        cfg = parse_drafter_specs(
            [dict(paradigm="hidden", regime="ttt", name=f"hidden-ttt-{data}-{n}")], arm
        )[0]
        arms[data] = train_drafter(
            tgt, store, eval_store, cfg, args.runs / "regeneration" / cfg.name, d2t=d2t
        )
    n_eval = shared["eval_sequences"]
    rows = []
    for heldout, store in (("original held-out", eval_store), ("regenerated held-out", regen_eval_store)):
        for data, result in arms.items():
            d = result.drafter.eval()
            evs = EvalSet.build(store, d.cfg, tgt, n_eval, shared["batch_size"], shared["max_tokens"])
            ev = evaluate_per_step(d, evs, result.config.eval_steps, None, shared["eval_branch_fraction"])
            tokens = sum(h["tokens"] for h in result.logs["history"])
            row = dict(
                trained_on=data,
                evaluated_on=heldout,
                train_steps=result.config.train_steps,
                train_tokens=tokens,
            )
            row.update({k: round(v, 4) for k, v in ev.items() if k.startswith("acc_") or k == "ceiling"})
            row.update(n_0=ev["n_0"], seconds=round(result.train_seconds, 1))
            rows.append(row)
    meta = dict(
        study="regenerated responses",
        target=tgt.info.name,
        regeneration=dict(REGEN, train=regen_train.counts, heldout=regen_eval.counts),
        train=f"the same {n} ShareGPT training conversations: original responses ({stores['original'].n_tokens} tokens) "
        f"or the target's greedy responses to their first user turn ({stores['regenerated'].n_tokens} tokens)",
        heldout=f"the first {n_eval} held-out conversations, original and regenerated",
        settings=dict(shared, train_steps=steps),
        note="equal training tokens: the regenerated arm's steps are scaled by the ratio of mean cropped lengths; "
        "the draft vocabulary is the default run's (4096 most frequent tokens of the 300 original conversations).",
    )
    save("regeneration_study", rows, meta, args.out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", choices=("vocab", "control", "regeneration"))
    ap.add_argument(
        "--steps", type=int, default=0, help="optimizer steps per drafter (0: the default profile's)"
    )
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--regimes", nargs="+", default=["ttt"], help="control: the regimes to train")
    ap.add_argument("--regime", default="ttt", help="vocab: the hidden-only drafter's regime")
    ap.add_argument("--eval-steps", type=int, default=0, help="vocab: held-out draft steps evaluated (0: 7)")
    ap.add_argument(
        "--regen-batch", type=int, default=16, help="regeneration: conversations decoded together"
    )
    ap.add_argument(
        "--data-only", action="store_true", help="regeneration: only regenerate (and cache) the data"
    )
    ap.add_argument(
        "--regen-conversations", type=int, default=128, help="regeneration: training conversations"
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "studies")
    args = ap.parse_args()
    if args.steps:  # a shorter study keeps its runs apart from the full-budget ones
        args.runs = args.runs / f"steps{args.steps}"
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    params = default_settings()
    shared = shared_training(params, args.steps)
    {"vocab": study_vocab, "control": study_control, "regeneration": study_regeneration}[args.study](
        args, params, shared
    )


if __name__ == "__main__":
    main()
