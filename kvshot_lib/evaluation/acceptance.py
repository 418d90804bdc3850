"""Acceptance by draft step on MT-bench: every drafter, chain and tree, both turns, at several temperatures.

Each question is asked in two turns; the second is conditioned on the model's own first answer.

* At temperature > 0 every generation runs through the real engine
  (:func:`kvshot_lib.decoding.speculative_generate`).
* At temperature 0 the engine's output is the plain greedy output whatever the drafter, so every cycle
  is decided by the drafter and the greedy continuation alone: a draft node is accepted iff its path
  matches the greedy tokens. :func:`replay_greedy` replays those cycles exactly: same cycle boundaries,
  same drafter calls, same target cache and hidden states handed to the drafter, but the target runs
  once per prompt (one forward over prompt + greedy output) instead of once per cycle, and is shared by
  every drafter; and a chain stops drafting at its first wrong token, since later ones are never
  tested (so ``drafted_per_cycle`` counts only those). ``tests/test_decoding_harness.py`` checks that
  it reproduces the engine's counts.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..corpus import answer_text, batched_greedy, chat_prompt_ids, load_mtbench, mtbench_messages
from ..decoding.config import DecodeConfig, GenerationResult
from ..decoding.cycle import CycleState, stop_tokens
from ..decoding.engine import autoregressive_generate, speculative_generate
from ..decoding.tree import DraftTree
from ..decoding.verify import walk_tree
from ..drafters.base import TargetView
from ..target.forward import forward, new_cache
from . import metrics


@dataclass
class Reference:
    """One MT-bench turn decoded greedily without stop tokens (the replay needs tokens past a stop)."""

    question_id: int
    turn: int
    prompt_ids: list[int]
    greedy_ids: list[int]


LABELS = ("drafter", "paradigm", "regime", "mode", "temperature")


@dataclass
class AcceptanceRun:
    """All generations of one drafter in one mode at one temperature."""

    drafter: str
    paradigm: str
    regime: str
    mode: str
    temperature: float
    results: list[GenerationResult] = field(default_factory=list)

    def labels(self) -> dict:
        """The columns that name this run in the result tables."""
        return {name: getattr(self, name) for name in LABELS}

    def step_counts(self) -> tuple[list[int], list[int]]:
        """Attempts and acceptances per draft step, summed over every generation."""
        return metrics.sum_step_counts((r.step_attempts, r.step_accepts) for r in self.results)


def greedy_references(
    target, n_questions: int | None, max_new_tokens: int, progress: bool = True, cache=None, batch_size=None
) -> list[Reference]:
    """Both turns of the first ``n_questions`` MT-bench questions, greedy; turn 2 sees turn 1's answer.

    ``cache``: a JSON file that keeps them for this target and these settings (notebook 03 writes it and
    notebook 04 reads the same references back instead of decoding them again). ``batch_size``: decode each
    turn's prompts in batches (the reference run on a GPU): batched greedy decoding equals one-at-a-time greedy
    decoding up to float rounding (``tests/test_regenerate.py``)."""
    spec = dict(
        target=target.info.name, fingerprint=target.info.fingerprint, n=n_questions, new=max_new_tokens
    )
    if cache is not None and Path(cache).is_file():
        saved = json.loads(Path(cache).read_text())
        if saved.get("spec") == spec:
            return [Reference(**r) for r in saved["references"]]
    refs = _decode_references(target, n_questions, max_new_tokens, progress, batch_size)
    if cache is not None:
        Path(cache).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(cache).with_suffix(".tmp")  # whole or absent: another run may be waiting for it
        tmp.write_text(json.dumps(dict(spec=spec, references=[dataclasses.asdict(r) for r in refs])))
        tmp.replace(cache)
    return refs


def _decode_references(
    target, n_questions, max_new_tokens: int, progress: bool, batch_size=None
) -> list[Reference]:
    stops = set(stop_tokens(None, target.info))
    cfg = DecodeConfig(mode="ar", max_new_tokens=max_new_tokens, stop_token_ids=())
    questions = load_mtbench(n_questions)
    firsts, refs = [None] * len(questions), {}
    for turn in (0, 1):
        prompts = [
            chat_prompt_ids(target.tokenizer, mtbench_messages(q, turn, firsts[i]))
            for i, q in enumerate(questions)
        ]
        if batch_size:
            chunks = range(0, len(prompts), batch_size)
            ids = [
                x
                for a in chunks
                for x in batched_greedy(target, prompts[a : a + batch_size], max_new_tokens, stop=False)
            ]
        else:
            bar = tqdm(prompts, desc=f"greedy references, turn {turn + 1}", disable=not progress)
            ids = [autoregressive_generate(target, p, cfg).token_ids for p in bar]
        for i, (q, prompt, out) in enumerate(zip(questions, prompts, ids)):
            refs[i, turn] = Reference(q.question_id, turn, prompt, out)
            firsts[i] = answer_text(target.tokenizer, out, stops)
    return [refs[i, turn] for i in range(len(questions)) for turn in (0, 1)]


def cache_prefix(cache, n: int):
    """A DynamicCache whose layers are views of the first ``n`` positions of ``cache`` (nothing copied)."""
    view = copy.copy(cache)
    view.layers = []
    for layer in cache.layers:
        short = copy.copy(layer)
        short.keys, short.values = layer.keys[:, :, :n], layer.values[:, :, :n]  # [B, kvH, n, D]
        view.layers.append(short)
    return view


@torch.inference_mode()
def target_states(target, ref: Reference, layers: tuple[int, ...]):
    """The target's cache and chosen hidden states over prompt + greedy output, in one forward."""
    full = torch.tensor([ref.prompt_ids + ref.greedy_ids], device=target.model.device)  # [1, T+G]
    cache = new_cache(target.model)
    out = forward(target.model, full, cache, logits_to_keep=1, hidden_states=bool(layers))
    hidden = {layer: out.hidden_states[layer + 1] for layer in layers}  # [1, T+G, H]
    return full, cache, hidden


@torch.inference_mode()
def replay_greedy(target, drafter, ref: Reference, cfg: DecodeConfig, states=None) -> GenerationResult:
    """The engine's temperature-0 cycles for ``ref``, without verification forwards (see module doc)."""
    cfg.validate()
    if cfg.temperature != 0 or cfg.mode not in ("chain", "tree"):
        raise ValueError("replay_greedy replays chain/tree decoding at temperature 0 only.")
    T, max_ctx = len(ref.prompt_ids), target.info.max_context
    if len(ref.greedy_ids) < min(cfg.max_new_tokens, max_ctx - T):
        raise ValueError(
            f"the reference holds {len(ref.greedy_ids)} greedy tokens; replaying max_new_tokens="
            f"{cfg.max_new_tokens} needs that many (decode the reference with stop_token_ids=())."
        )
    session = drafter.new_session()
    full, cache, hidden = states or target_states(target, ref, tuple(session.hidden_layers))
    seq = full[0].tolist()
    state = CycleState(target, ref.prompt_ids, cfg)
    result = state.result
    if cfg.max_new_tokens == 0:
        return result
    state.commit([seq[T]])  # the target's first token, as the prefill would choose it
    given = 0  # hidden states handed to the drafter: positions 0..given-1
    while not state.done and not state.out_of_context():
        P, cap = state.root, state.cap()
        tree = DraftTree()
        t_draft = time.perf_counter()
        if cap > 0:
            view = TargetView(
                cache=cache_prefix(cache, P), hidden={k: v[:, given:P] for k, v in hidden.items()}
            )
            wrong = lambda d, tok, P=P: tok != seq[P + 1 + d]  # noqa: E731
            # a chain's drafts after the first wrong one are never tested: skip them
            tree = state.draft(session, view, cap, stop_after=wrong if cfg.mode == "chain" else None)
            given = P
        result.draft_s += time.perf_counter() - t_draft
        # The target's greedy token after each block position that lies on the greedy path.
        on_path = [True]
        for tok, parent, depth in zip(tree.tokens, tree.parents, tree.depths):
            on_path.append(on_path[parent + 1] and tok == seq[P + 1 + depth])
        depth_of = [-1, *tree.depths]
        choice = [seq[P + 2 + depth_of[b]] if on_path[b] else -1 for b in range(len(tree) + 1)]
        path, bonus = walk_tree(tree, choice.__getitem__, result)
        if cap > 0:
            state.record(tree, path)
        state.commit([*(tree.tokens[i] for i in path), bonus])
    return result


def mode_configs(base: DecodeConfig, modes) -> dict[str, DecodeConfig]:
    """``{mode: base with that mode}`` for chain and/or tree, validated."""
    bad = [m for m in modes if m not in ("chain", "tree")]
    if bad:
        raise ValueError(f"acceptance is measured in modes 'chain' and 'tree'; got {bad}.")
    return {m: dataclasses.replace(base, mode=m).validate() for m in modes}


def _meta(name: str, drafter) -> tuple[str, str, str]:
    return (
        name,
        getattr(drafter, "paradigm", "baseline") or "baseline",
        getattr(drafter, "regime", "-") or "-",
    )


def run_greedy_replay(
    target, drafters: dict, refs: list[Reference], cfgs: dict[str, DecodeConfig], progress: bool = True
) -> list[AcceptanceRun]:
    """Temperature 0: replay every drafter in every mode (``cfgs``: mode -> config) on shared references."""
    runs = {
        (name, mode): AcceptanceRun(*_meta(name, d), mode, 0.0)
        for name, d in drafters.items()
        for mode in cfgs
    }
    layers = tuple(sorted({layer for d in drafters.values() for layer in d.new_session().hidden_layers}))
    for ref in tqdm(refs, desc="replaying drafters (T=0)", disable=not progress):
        states = target_states(target, ref, layers)
        for name, drafter in drafters.items():
            for mode, cfg in cfgs.items():
                runs[name, mode].results.append(replay_greedy(target, drafter, ref, cfg, states))
    return list(runs.values())


def run_engine(
    target, drafters: dict, n_questions: int | None, cfgs: dict[str, DecodeConfig], progress: bool = True
) -> list[AcceptanceRun]:
    """Any temperature: the real engine on both turns; turn 2 sees this run's own first answer."""
    stops = set(stop_tokens(None, target.info))
    questions = load_mtbench(n_questions)
    runs = []
    for name, drafter in drafters.items():
        for mode, cfg in cfgs.items():
            run = AcceptanceRun(*_meta(name, drafter), mode, cfg.temperature)
            for i, q in enumerate(
                tqdm(questions, desc=f"{name} {mode} T={cfg.temperature:g}", disable=not progress)
            ):
                first = None
                for turn in (0, 1):
                    prompt = chat_prompt_ids(target.tokenizer, mtbench_messages(q, turn, first))
                    seeded = dataclasses.replace(cfg, seed=cfg.seed * 1_000_003 + 2 * i + turn)
                    out = speculative_generate(target, drafter, prompt, seeded)
                    run.results.append(out)
                    first = answer_text(target.tokenizer, out.token_ids, stops)
            runs.append(run)
    return runs


def acceptance_table(runs: list[AcceptanceRun], max_steps: int | None = None) -> pd.DataFrame:
    """One row per drafter x mode x temperature x step: alpha_conditional, p_reach, n_attempts, n_accepts."""
    rows = [
        {**run.labels(), **rec}
        for run in runs
        for rec in metrics.acceptance_by_step(*run.step_counts(), max_steps)
    ]
    columns = [
        *LABELS,
        "step",
        "alpha_conditional",
        "p_reach",
        "n_attempts",
        "n_accepts",
    ]
    return pd.DataFrame(rows, columns=columns)


def acceptance_summary(runs: list[AcceptanceRun]) -> pd.DataFrame:
    """One row per drafter x mode x temperature: MAT, alpha_0, alpha_6, retention, cycles, tokens."""
    rows = []
    for run in runs:
        attempts, accepts = run.step_counts()
        alpha = metrics.alpha_conditional(attempts, accepts)
        per_cycle = [a for r in run.results for a in r.accepted_per_cycle]
        rows.append(
            dict(
                **run.labels(),
                mat=metrics.mean_accepted_tokens(per_cycle),
                alpha_0=alpha[0] if alpha else float("nan"),
                alpha_6=alpha[6] if len(alpha) > 6 else float("nan"),
                retention=metrics.retention(alpha, attempts=attempts),  # NaN below 20 attempts
                n_attempts_6=attempts[6] if len(attempts) > 6 else 0,
                n_cycles=len(per_cycle),
                n_generations=len(run.results),
                n_tokens=sum(len(r.token_ids) for r in run.results),
                draft_s=sum(r.draft_s for r in run.results),
            )
        )
    return pd.DataFrame(rows)
