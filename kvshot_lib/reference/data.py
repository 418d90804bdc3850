"""The reference run's data: the ShareGPT slices, their feature stores, one held-out set and one budget for all rows.

* :func:`data_splits`: the training and held-out slices (split by conversation, 512–1,024-token sequences on the
  CPU plan), with the original responses or, where the regeneration has reached, the target's own;
* :func:`row_data`: what a row trains on. A ``data_source: store`` row (the CPU plan) gets the slices' feature
  stores, extracted once in bf16 where the machine has it (resumable, :func:`~kvshot_lib.corpus.extract_features`)
  and reused by every row (:func:`row_store`); an ``online`` row (the GPU plan) gets the tokenized slices. Either
  way one held-out set, collated for every feature any row reads, measures every row;
* :func:`corpus_tokens`: what each regenerated training slice of the plan yields, before and after its loops are
  cut or their conversations dropped (``corpus_tokens.csv``);
* :func:`train_steps_for`: the optimizer steps of the plan's token-pass cap (``budget.token_passes``) on these
  sequences, so the cap is in tokens as the issue states it, whatever the sequence lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ..corpus import (
    cached_regeneration,
    cut_looping,
    extract_features,
    looping_conversations,
    tokenize_sharegpt,
    training_tokens,
)
from ..target import assets
from ..target.assets import REPO_ROOT
from .plan import Plan, PlanError, Row


def data_splits(plan: Plan, target, responses: str, data: dict | None = None):
    """(training, held-out) TokenizedSplits and what they are: regenerated where the regeneration has reached.
    ``data``: the slice's keys (:meth:`Plan.row_data_spec`), default the plan's ``data``."""
    d = data or plan.data
    kw = dict(seed=plan.seed, min_len=int(d.get("min_len", 0)))
    train = tokenize_sharegpt(target.tokenizer, "train", d["n_train_conversations"], d["max_len"], **kw)
    held = tokenize_sharegpt(target.tokenizer, "eval", d["n_eval_conversations"], d["max_len"], **kw)
    if responses == "original":
        return train, held, "original"
    r, root = plan.data["regenerate"], regeneration_root(plan)
    out = [cached_regeneration(target, s, r["max_new_tokens"], r["max_turns"], root) for s in (train, held)]
    if out[0] is None:  # nothing regenerated yet: say so in every table
        return train, held, "original (no regenerated responses yet)"
    what = f"regenerated ({len(out[0])} of {len(train)} training conversations)"
    return out[0], out[1] if out[1] is not None else held, what


def regeneration_root(plan: Plan) -> Path:
    """Where the plan keeps its regenerated responses: ``data.regenerate.dir`` (relative to the repository, e.g.
    the committed ``data/regenerated``), else the cache's ``regenerated/``."""
    folder = plan.data.get("regenerate", {}).get("dir")
    return REPO_ROOT / folder if folder else assets.cache_dir() / "regenerated"


@dataclass
class RowData:
    """What the rows of one kind of responses train and are evaluated on."""

    train: object  # FeatureStore (data_source "store") or TokenizedSplit ("online")
    held: object
    what: str  # which responses, for the tables
    eval_set: object  # the held-out EvalSet every row is measured on
    unique_tokens: int  # tokens of the training slice (token-passes are counted by the loop)
    mean_length: float  # tokens per training sequence, as the loop sees them (after max_tokens)


def row_data(plan: Plan, target, row: Row, progress: bool = True) -> RowData:
    """The data of ``row``'s responses and data source (module docstring)."""
    from ..drafters import drafter_config_for
    from ..training import EvalSet, online_eval_set

    spec = plan.row_data_spec(row)
    train, held, what = data_splits(plan, target, row.responses, spec)
    keep = None
    if row.loops == "drop":
        keep = without_looping(train, target.info.eos_token_ids)
        if not keep:
            raise PlanError(f"row {row.name!r} drops looping answers, and every training conversation loops.")
        what += f", without the {len(train) - len(keep)} conversations whose answers loop"
    base = row.train_config()
    crop = base.max_tokens or math.inf
    floor = int(spec.get("min_train_tokens", 0))  # how far the slice must reach, before any row's filter
    if train.n_tokens < floor:
        raise PlanError(
            f"the training slice holds {train.n_tokens:,} tokens, fewer than the plan's min_train_tokens "
            f"{floor:,}: raise data.n_train_conversations."
        )
    if row.loops == "cut":  # the same conversations, each loop cut after its first repetition
        train = cut_looping(train, target.info.eos_token_ids)
        what += (
            f", each of its {train.counts['looping_answers_cut']} looping answers cut after its first repetition "
            f"({train.counts['looping_tokens_cut']:,} tokens)"
        )
    kept = train if keep is None else train.subset(keep)
    mean_length = sum(min(len(x), crop) for x in kept.ids) / len(kept)
    unique = kept.n_tokens
    superset = drafter_config_for(target, "hybrid", draft_vocab_size=base.draft_vocab_size)
    args = (superset, target, base.eval_sequences, base.batch_size, base.max_tokens)
    if base.data_source == "store":  # extracted once, resumable; every store row reuses it
        train = row_store(target, train, keep, base.mixed_precision)
        held = extract_features(target, held, precision=base.mixed_precision)
        eval_set = EvalSet.build(held, *args)
    else:
        train, eval_set = kept, online_eval_set(held, *args)
    return RowData(train, held, what, eval_set, unique, mean_length)


def row_store(target, split, keep: list[int] | None, precision: str):
    """The feature store a row reads: a view of the whole slice's where that one is finished (the slice's rows share
    it), else, for a row that keeps only ``keep``, a store of those conversations alone (a row that drops looping
    answers extracts ~55% of stage 2's slice, not all of it)."""
    if keep is None:
        return extract_features(target, split, precision=precision)
    whole = extract_features(target, split, precision=precision, extract=False)
    return (
        whole.subset(keep)
        if whole is not None
        else extract_features(target, split.subset(keep), precision=precision)
    )


def without_looping(train, stops) -> list[int]:
    """The indices of ``train``'s conversations none of whose answers loops (what ``loops: drop`` keeps)."""
    return [i for i, bad in enumerate(looping_conversations(train, stops)) if not bad]


def corpus_tokens(plan: Plan, target) -> pd.DataFrame:
    """One line per training slice that the plan's regenerated rows read (by its size, ``n_train_conversations``):
    the conversations regenerated so far, their tokens as the target answered, and the unique training tokens
    once each loop is cut (``loops: cut``) or each looping conversation dropped (``loops: drop``); with the rows
    that read it."""
    slices: dict[int, tuple[dict, list[str]]] = {}
    for row in plan.rows.values():
        if row.responses == "regenerated":
            spec = plan.row_data_spec(row)
            slices.setdefault(int(spec["n_train_conversations"]), (spec, []))[1].append(row.name)
    stops, out = target.info.eos_token_ids, []
    for n, (spec, names) in sorted(slices.items()):
        train, _, what = data_splits(plan, target, "regenerated", spec)
        if not what.startswith("regenerated"):
            continue  # nothing of this slice is regenerated yet
        keep, counts = without_looping(train, stops), training_tokens(train, stops)
        out.append(dict(
            conversations=n, regenerated=len(train), tokens=counts["tokens"], tokens_loops_cut=counts["tokens_loops_cut"],
            tokens_loops_dropped=train.subset(keep).n_tokens, looping_conversations=len(train) - len(keep),
            looping_answers_cut=counts["answers_cut"],
            rows=" ".join(names),
        ))  # fmt: skip
    return pd.DataFrame(out)


def train_steps_for(plan: Plan, row: Row, data: RowData) -> int | None:
    """The optimizer steps of the plan's token-pass cap for ``row`` on ``data`` (None: the row's own steps)."""
    cap = plan.row_budget(row).get("token_passes")
    if not cap:
        return None
    return max(1, math.ceil(cap / (row.train_config().batch_size * data.mean_length)))


def draft_vocab(plan: Plan, target, size: int):
    """One draft vocabulary for every row: the ``size`` most frequent assistant tokens of the training slice, in
    the plan's ``data.vocab_from`` responses (default: the original ones; the on-policy run counts the target's
    own answers, as SpecForge builds its vocabulary), over its first ``data.vocab_conversations`` conversations
    where set, so that the vocabulary stays put while more conversations are regenerated."""
    from ..training import build_draft_vocab

    train = data_splits(plan, target, plan.data.get("vocab_from", "original"))[0]
    n = plan.data.get("vocab_conversations")
    if n:
        if len(train) < n:
            raise PlanError(
                f"the draft vocabulary counts the first {n} training conversations, but only {len(train)} are "
                "there yet: regenerate more (--steps regenerate) or lower data.vocab_conversations."
            )
        train = train.head(n)
    return build_draft_vocab(train, target, size)
