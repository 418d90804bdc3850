"""Drafters that need no training: the target drafting for itself, a shallow copy of it, a random drafter
and an n-gram (prompt-lookup) drafter. Each is a ``SessionFactory`` of :mod:`kvshot_lib.drafters.base`.

* ``self``: the target itself, with its own KV cache. Everything is accepted at temperature 0 (up to
  rounding), so it is the engine's sanity check, not a speed-up: each draft step costs a target step.
  With ``noise > 0`` Gaussian noise is added to its logits: a drafter of tunable quality for tests.
* ``early-exit-<n>``: the target's first n decoder layers, then its final norm and LM head (weights
  shared, nothing copied). An untrained, non-trivially correlated drafter for tests.
* ``random``: seeded random logits; nearly every draft is rejected.
* ``ngram``: prompt lookup. The draft distribution after a context is the empirical distribution of
  the tokens that followed earlier occurrences of the context's longest suffix (``max_n`` down to
  ``min_n`` tokens) in the prompt and the output so far; all ``-inf`` (no draft) when nothing matches.
  ``min_n = 2`` by default: on MT-bench with SmolLM2, single-token matches are right too rarely to pay
  for the wider verification (MAT 1.19 -> 1.13 per cycle on first turns, but fewer wasted drafts; the
  estimated speedup goes from 0.93-1.03x to 1.04-1.08x on first turns and from 1.3-1.6x to 1.4-1.85x on
  second turns).

:func:`resolve_drafter` turns a name or a checkpoint path into a drafter, with clear errors.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ..target import Target
from ..target.forward import crop, forward, new_cache
from .base import SessionFactory, TargetView
from .tree_mask import ancestor_matrix, tree_attention_mask

BASELINES = ("self", "ngram", "random")


class ModelDraftSession:
    """Drafts with a causal LM (the target or a shallow copy) holding its own KV cache.

    The cache holds the committed tokens the session has seen, then the nodes of the current cycle;
    ``end_cycle`` crops the nodes. Nodes attend to the committed context and their own ancestors. A
    committed prefix that changed since the last cycle (a verifier that rolls back, as SpecPV's strict mode
    does) is cropped back to where it still agrees and re-fed from there.
    """

    d2t = None
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, model: torch.nn.Module, noise: float = 0.0, generator: torch.Generator | None = None):
        self.model, self.noise, self.generator = model, noise, generator
        self.cache = new_cache(model)
        self.n_committed = 0  # committed tokens in self.cache
        self.seen = torch.empty(0, dtype=torch.long)  # [n_committed] those tokens
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.mask_dtype = next(model.parameters()).dtype

    @torch.inference_mode()
    def start_cycle(self, committed: Tensor, view: TargetView) -> Tensor:
        self._rewind(committed[0])
        new = committed[:, self.n_committed :]  # [1, n_new]: accepted drafts and the root
        positions = torch.arange(self.n_committed, committed.shape[1], device=new.device)[None]  # [1, n_new]
        out = forward(self.model, new, self.cache, positions, logits_to_keep=1)
        self.n_committed = committed.shape[1]
        self.seen = committed[0].clone()
        return self._noisy(out.logits[0, -1])  # [V]

    def _rewind(self, committed: Tensor) -> None:
        """Crop the cache to the longest prefix of ``committed [P+1]`` it holds (the root is always new)."""
        n = min(self.n_committed, committed.shape[0] - 1)
        differ = (self.seen[:n].to(committed.device) != committed[:n]).nonzero()
        keep = int(differ[0]) if len(differ) else n
        if keep < self.n_committed:
            crop(self.cache, keep)
            self.n_committed = keep

    def _noisy(self, logits: Tensor) -> Tensor:
        if not self.noise:
            return logits
        return logits + self.noise * torch.randn(logits.shape, generator=self.generator).to(logits)

    @torch.inference_mode()
    def expand(self, tokens: Tensor, parents: Tensor) -> Tensor:
        first = len(self.parents)
        for p in parents.tolist():
            self.parents.append(p)
            self.depths.append(0 if p < 0 else self.depths[p] + 1)
        anc = ancestor_matrix(self.parents)[first + 1 :, 1:]  # [n, n_nodes]: the new nodes' ancestry
        past = self.n_committed  # committed tokens, the root included
        mask = tree_attention_mask(anc, past, self.mask_dtype, tokens.device)  # [1, 1, n, past + n_nodes]
        positions = torch.tensor([[past + d for d in self.depths[first:]]], device=tokens.device)  # [1, n]
        out = forward(self.model, tokens[None], self.cache, positions, mask)
        return self._noisy(out.logits[0])  # [n, V]

    def end_cycle(self) -> None:
        crop(self.cache, self.n_committed)
        self.parents, self.depths = [], []


@dataclass
class SelfDrafter:
    """The target drafting for itself (plus Gaussian logit noise of std ``noise``, seeded per session)."""

    target: Target
    noise: float = 0.0
    seed: int = 0
    paradigm: str = "baseline"
    regime: str = "-"
    _sessions: int = 0

    @property
    def name(self) -> str:
        return "self" if not self.noise else f"self-noise{self.noise:g}"

    def new_session(self) -> ModelDraftSession:
        self._sessions += 1
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self._sessions)
        return ModelDraftSession(self.target.model, self.noise, generator)


def early_exit_model(model: torch.nn.Module, n_layers: int) -> torch.nn.Module:
    """A causal LM made of ``model``'s first ``n_layers`` decoder layers, final norm and LM head (shared)."""
    total = model.config.num_hidden_layers
    if not 1 <= n_layers <= total:
        raise ValueError(f"n_layers must be in 1..{total}, got {n_layers}.")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = n_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:n_layers]
    with torch.device("meta"):
        small = type(model)(config)
    small.model.embed_tokens = model.model.embed_tokens
    small.model.layers = torch.nn.ModuleList(model.model.layers[:n_layers])
    small.model.norm = model.model.norm
    small.model.rotary_emb = model.model.rotary_emb
    small.lm_head = model.lm_head
    return small.eval()


@dataclass
class EarlyExitDrafter:
    """The target's first ``n_layers`` layers as an untrained drafter (a stand-in for a trained one)."""

    target: Target
    n_layers: int
    paradigm: str = "baseline"
    regime: str = "-"
    model: torch.nn.Module = field(init=False, repr=False)

    def __post_init__(self):
        self.model = early_exit_model(self.target.model, self.n_layers)
        self.name = f"early-exit-{self.n_layers}"

    def new_session(self) -> ModelDraftSession:
        return ModelDraftSession(self.model)


class RandomDraftSession:
    d2t = None
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, vocab_size: int, generator: torch.Generator):
        self.vocab_size, self.generator = vocab_size, generator

    def start_cycle(self, committed: Tensor, view: TargetView) -> Tensor:
        return torch.randn(self.vocab_size, generator=self.generator)  # [V]

    def expand(self, tokens: Tensor, parents: Tensor) -> Tensor:
        return torch.randn(len(tokens), self.vocab_size, generator=self.generator)  # [n, V]

    def end_cycle(self) -> None:
        pass


@dataclass
class RandomDrafter:
    vocab_size: int
    seed: int = 0
    name: str = "random"
    paradigm: str = "baseline"
    regime: str = "-"
    _sessions: int = 0

    def new_session(self) -> RandomDraftSession:
        self._sessions += 1
        return RandomDraftSession(
            self.vocab_size, torch.Generator().manual_seed(self.seed * 100_003 + self._sessions)
        )


class NgramDraftSession:
    """Prompt lookup over the committed tokens plus the path to the node being expanded."""

    d2t = None
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, vocab_size: int, max_n: int, min_n: int):
        self.vocab_size, self.max_n, self.min_n = vocab_size, max_n, min_n
        self.context = torch.empty(0, dtype=torch.long)
        self.paths: list[list[int]] = []

    def next_token_logits(self, seq: Tensor) -> Tensor:
        """``[V]`` log-counts of the tokens that followed the longest matching suffix of ``seq [T]``."""
        logits = torch.full((self.vocab_size,), float("-inf"))
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            windows = seq.unfold(0, n, 1)[:-1]  # [T - n, n]: window s is followed by seq[s + n]
            hits = (windows == seq[-n:]).all(-1).nonzero()[:, 0]  # [h]
            if len(hits):
                following = seq[hits + n]  # [h]
                counts = torch.bincount(following, minlength=self.vocab_size).float()  # [V]
                logits = counts.log()
                logits[following[-1]] += 1e-3  # ties go to the most recent continuation
                return logits
        return logits

    def start_cycle(self, committed: Tensor, view: TargetView) -> Tensor:
        self.context = committed[0].cpu()
        self.paths = []
        return self.next_token_logits(self.context)

    def expand(self, tokens: Tensor, parents: Tensor) -> Tensor:
        rows = []
        for t, p in zip(tokens.tolist(), parents.tolist()):
            path = (self.paths[p] if p >= 0 else []) + [t]
            self.paths.append(path)
            rows.append(self.next_token_logits(torch.cat([self.context, torch.tensor(path)])))
        return torch.stack(rows)  # [n, V]

    def end_cycle(self) -> None:
        self.paths = []


@dataclass
class NgramDrafter:
    vocab_size: int
    max_n: int = 3
    min_n: int = 2
    name: str = "ngram"
    paradigm: str = "baseline"
    regime: str = "-"

    def new_session(self) -> NgramDraftSession:
        return NgramDraftSession(self.vocab_size, self.max_n, self.min_n)


def resolve_drafter(
    spec: str, target: Target, seed: int = 0, dtype: torch.dtype | None = None
) -> SessionFactory | None:
    """A drafter by name (``self``, ``ngram``, ``random``, ``early-exit-<n>``, ``none`` -> None) or by the path
    of a trained drafter's checkpoint folder (loaded with ``kvshot_lib.drafters.load_drafter``, its weights cast
    to ``dtype`` when given: bf16 decoding runs the drafter in bf16 too)."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"drafter must be a non-empty string, got {spec!r}.")
    vocab = target.info.vocab_size
    if spec == "none":
        return None
    if spec == "self":
        return SelfDrafter(target)
    if spec == "ngram":
        return NgramDrafter(vocab)
    if spec == "random":
        return RandomDrafter(vocab, seed)
    if spec.startswith("early-exit-") and spec.removeprefix("early-exit-").isdigit():
        return EarlyExitDrafter(target, int(spec.removeprefix("early-exit-")))
    path = Path(spec).expanduser()
    if not path.exists():
        raise ValueError(
            f"Unknown drafter {spec!r}: not one of none, {', '.join(BASELINES)}, early-exit-<n>, and no such "
            "path. Give a trained drafter's checkpoint folder (made by notebook 02, under runs/<profile>/drafters/)."
        )
    if not path.is_dir():
        raise ValueError(
            f"Drafter path {path} is a file; a trained drafter is a checkpoint folder (runs/<profile>/drafters/<name>/)."
        )
    from .checkpoint import load_drafter  # here: checkpoint -> the paradigms -> session

    return load_drafter(str(path), target, dtype)


def drafter_for_target(
    drafter: SessionFactory | None, target: Target, dtype: torch.dtype | None = None
) -> SessionFactory | None:
    """``drafter`` bound to ``target`` (another copy of the target it was made for, e.g. cast to bf16 for
    decoding), trained weights in ``dtype`` when given; a drafter that reads no target comes back as it is."""
    if isinstance(drafter, SelfDrafter):
        return SelfDrafter(target, drafter.noise, drafter.seed)
    if isinstance(drafter, EarlyExitDrafter):
        return EarlyExitDrafter(target, drafter.n_layers)
    if isinstance(drafter, (NgramDrafter, RandomDrafter)) or drafter is None:
        return drafter
    from .checkpoint import rebind_drafter  # here: checkpoint -> the paradigms -> session

    return rebind_drafter(drafter, target, dtype)


def checkpoint_label(folder: str | Path) -> str:
    """A checkpoint folder's label: ``<row>@<run>`` for a committed ``checkpoints/<run>/<row>`` (never to be taken
    for a drafter trained in the run at hand), else the folder's name."""
    folder = Path(folder)
    committed = folder.resolve().parent.parent.name == "checkpoints"
    return f"{folder.name}@{folder.parent.name}" if committed else folder.name


def drafters_for_run(
    run_dir: str | Path | None,
    target: Target,
    baselines=BASELINES,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    extra=(),
) -> tuple[dict, str]:
    """The baseline drafters named in ``baselines`` plus every trained checkpoint under ``<run_dir>/drafters/``
    (labelled by folder name, weights in ``dtype`` when given; none when ``run_dir`` is None), plus the drafter
    folders in ``extra`` (any checkpoint, e.g. a public EAGLE-3 drafter in the layout vLLM loads, labelled by folder
    name, or ``<row>@<parent>`` where the run trained a drafter of that name; a committed ``checkpoints/<run>/<row>``
    is always labelled ``<row>@<run>``, so that no figure takes it for this run's),
    and a one-line note saying what was found."""
    unknown = [b for b in baselines if not is_baseline_name(b)]
    if unknown:
        raise ValueError(f"Unknown baseline drafters {unknown}; use any of {BASELINES} or early-exit-<n>.")
    drafters = {name: resolve_drafter(name, target, seed) for name in baselines}
    root = Path(run_dir) / "drafters" if run_dir is not None else None
    folders = sorted(p for p in root.glob("*") if p.is_dir()) if root and root.is_dir() else []
    for folder in map(Path, extra):
        clash = folder.name in drafters or (
            root is not None and (root / folder.name / "config.json").is_file()
        )
        label = f"{folder.name}@{folder.parent.name}" if clash else checkpoint_label(folder)
        drafters[label] = resolve_drafter(str(folder), target, seed, dtype)
    if run_dir is None:
        return drafters, f"Baselines: {', '.join(baselines)}" + (
            f"; from folders: {len(extra)}." if extra else "."
        )
    trained = {}
    for folder in folders:
        if not (folder / "config.json").is_file():
            continue  # an unfinished or foreign folder
        trained[folder.name] = resolve_drafter(str(folder), target, seed, dtype)
    if trained:
        note = f"{len(trained)} trained drafters from {root}: {', '.join(trained)}; baselines: {', '.join(baselines)}."
    else:
        note = (
            f"No trained drafters under {root} (run notebook 02 first); using the baseline drafters only: "
            f"{', '.join(baselines)}."
        )
    return {**drafters, **trained}, note


def is_baseline_name(name: str) -> bool:
    """Whether ``name`` is a baseline drafter name (not a path)."""
    return name in BASELINES or (
        name.startswith("early-exit-") and name.removeprefix("early-exit-").isdigit()
    )
