"""What one speculative cycle costs on this machine, in this precision: measured once, saved, reused.

A cycle is drafting, one target forward over the root and the drafted nodes, and the commit. The draft shape
that decodes fastest (:mod:`.speed_model`) trades expected accepted tokens against these seconds, so they are
measured, not assumed (vLLM profiles each step shape at start-up for the same reason):

* ``verify_chain[k]`` / ``verify_tree[k]``: one target forward of a ``k``-token block (the root and ``k - 1``
  drafts) on a cache of ``context`` tokens, ``k = 1..64``, causal (a chain) or with an explicit tree mask,
  building the mask included; through :func:`~.kernels.small_batch_linear`, as the engine runs it;
* ``commit_s``: moving the accepted path's K/V into place and cropping the rest (:func:`~.cycle.keep_block_positions`);
* per drafter, ``start_s`` (``start_cycle``: ingest the new positions, draft the root's child) and
  ``expand_s[n]`` (``expand`` of ``n`` nodes in one call), timed inside real cycles by a :class:`TimedSession`;
  :meth:`CostModel.expand` interpolates them linearly in ``n``.

Every cost is the *median* of its repetitions (12 for verification, sizes interleaved): what a typical cycle pays.
The fastest repetition, which this module priced verification at before (``costs/3``), is a forward the engine
seldom reaches on a small shared VM: in ``benchmarks/verify_cost_gap.py`` the engine's forwards cost 0.98-1.46 times
that price (docs/onpolicy-results.md), so the chooser verified more than paid. A median also ignores the time slices
other work takes. Each table is then made non-decreasing in k (or n) by pooling adjacent violators (isotonic
regression): a bigger block never costs less, and one lucky or unlucky timing does not bend the shape chooser.

:func:`cost_model_for` loads the entry for (CPU model, torch version, threads, target architecture, dtype) from
``<cache>/cost_models.json`` and measures what is missing (about a minute for the target, seconds per drafter);
``CostModel.from_dict`` rebuilds a synthetic one for tests.

``--precision auto`` decodes in the precision whose plain decoding step is faster here (:func:`decode_precision`):
:func:`plain_step_s` is ``verify_chain[1]``, a one-token forward on the cache, read from the cached cost model of
each dtype, or measured alone where none is cached (that one size, seconds) and cached beside them. The choice
and both timings are printed once per process (``target.precision.PrecisionChoice``).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch

from ..drafters.base import DraftSession, SessionFactory, TargetView
from ..drafters.tree_mask import ancestor_matrix, tree_attention_mask
from ..target import Target
from ..target.disk_cache import read_table, save_entry
from ..target.forward import crop, forward, new_cache
from ..target.graphs import width_for
from ..target.loading import cast_target
from ..target.precision import (
    DTYPES,
    PrecisionChoice,
    cpu_model,
    decode_choice,
    decode_dtype,
    precision_label,
)
from ..target.static_cache import static_cache_for
from .config import DecodeConfig
from .cycle import keep_block_positions
from .engine import speculative_generate
from .kernels import small_batch_linear

FORMAT = "costs/4"  # in every key: entries measured another way are measured again (costs/3: fastest, lower quartile)
BLOCK_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)
EXPAND_WIDTHS = (1, 2, 4, 8)


@dataclass
class DrafterCost:
    """Seconds of a drafter's two calls: ``start_cycle``, and ``expand`` by the nodes it drafts at once."""

    start_s: float
    expand_s: dict[int, float]  # n nodes in one expand call -> seconds


@dataclass
class CostModel:
    """Measured seconds per cycle phase for one (machine, target, dtype); see the module docstring."""

    key: str
    precision: str  # "fp32" | "bf16" | ...
    context: int  # cached tokens under the timed blocks
    verify_chain: dict[int, float]  # block tokens (root + drafts) -> seconds, causal
    verify_tree: dict[int, float]  # the same with a tree mask
    commit_s: float
    drafters: dict[str, DrafterCost] = field(default_factory=dict)

    def verify(self, n_tokens: int, tree: bool = True) -> float:
        """Seconds of a target forward over ``n_tokens`` block tokens: linear between measured sizes, and
        past the largest along the last measured slope."""
        table = self.verify_tree if tree else self.verify_chain
        return _interpolate(table, n_tokens)

    def start(self, drafter: str) -> float:
        return self._drafter(drafter).start_s

    def expand(self, drafter: str, n: int) -> float:
        """Seconds of one ``expand`` call drafting ``n`` nodes (0 for ``n == 0``)."""
        return _interpolate(self._drafter(drafter).expand_s, n) if n > 0 else 0.0

    def _drafter(self, name: str) -> DrafterCost:
        if name not in self.drafters:
            raise KeyError(
                f"the cost model {self.key!r} has no costs for drafter {name!r} (it has {sorted(self.drafters)}); "
                "measure it with cost_model_for(target, {name: drafter})."
            )
        return self.drafters[name]

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        def table(t):
            return {int(k): float(v) for k, v in t.items()}

        drafters = {
            name: DrafterCost(float(c["start_s"]), table(c["expand_s"]) or {1: float(c["start_s"])})
            for name, c in d.get("drafters", {}).items()
        }
        return cls(
            key=d["key"],
            precision=d["precision"],
            context=int(d["context"]),
            verify_chain=table(d["verify_chain"]),
            verify_tree=table(d["verify_tree"]),
            commit_s=float(d["commit_s"]),
            drafters=drafters,
        )


def _interpolate(table: dict[int, float], x: int) -> float:
    xs = sorted(table)
    if x <= xs[0]:
        return table[xs[0]]
    for lo, hi in zip(xs, xs[1:]):
        if x <= hi:
            return table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo)
    if len(xs) == 1:
        return table[xs[0]]
    lo, hi = xs[-2], xs[-1]
    return table[hi] + (table[hi] - table[lo]) * (x - hi) / (hi - lo)


# ------------------------------------------------------------------------------------------------ measuring


def _typical(times: list[float]) -> float:
    """The median of repeated timings (of an even count, the mean of the middle two)."""
    return statistics.median(times)


def monotone(table: dict[int, float]) -> dict[int, float]:
    """The closest non-decreasing table in the least-squares sense (pool adjacent violators over sorted keys)."""
    keys = sorted(table)
    blocks: list[list[float]] = []  # [sum, count] per pooled block
    for k in keys:
        blocks.append([table[k], 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    values = [b[0] / b[1] for b in blocks for _ in range(b[1])]
    return dict(zip(keys, values))


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.inference_mode()
def measure_verification(
    target: Target,
    context: int = 256,
    sizes=BLOCK_SIZES,
    reps: int = 12,
    kernel: bool = True,
    static: bool | None = None,
) -> tuple[dict[int, float], dict[int, float], float]:
    """Seconds (the median repetition, made non-decreasing in k) of a ``k``-token forward (causal, then tree-masked) on a cache of ``context`` random
    tokens for every ``k`` in ``sizes``, and the seconds of a commit; sizes interleaved per repetition. ``static``:
    on the static cache (on a GPU, graph replays at the padded widths; the first round captures them), as decoding
    runs there; None: as ``target_cache="auto"`` decodes on this device."""
    model = target.model
    dev = model.device
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, min(5000, target.info.vocab_size), (1, context), generator=g).to(dev)
    if static is None:
        static = DecodeConfig().static_cache(dev)
    cache = static_cache_for(model, context + width_for(max(sizes))) if static else new_cache(model)
    forward(model, prompt, cache, logits_to_keep=1)
    dtype = next(model.parameters()).dtype
    times = defaultdict(list)
    commits = []
    with small_batch_linear(model, enabled=kernel):
        for rep in range(reps + 1):  # the first round warms up every shape
            for k in sizes:
                block = torch.randint(100, 1000, (1, k), generator=g).to(dev)  # [1, k]
                positions = torch.arange(context, context + k, device=dev)[None]  # [1, k]
                for tree in (False, True):
                    t0 = _clock(dev)
                    mask = None
                    if tree and k > 1:
                        mask = tree_attention_mask(
                            ancestor_matrix(list(range(-1, k - 2))), context, dtype, dev
                        )
                    forward(model, block, cache, positions, mask)
                    t1 = _clock(dev)
                    if tree:
                        keep_block_positions(
                            cache, context, [0, k - 1] if k > 1 else [0]
                        )  # a path of one draft
                        commits.append(_clock(dev) - t1)
                    crop(cache, context)
                    if rep:
                        times[k, tree].append(t1 - t0)
    chain = monotone({k: _typical(times[k, False]) for k in sizes})
    treed = monotone({k: _typical(times[k, True]) for k in sizes})
    return chain, treed, _typical(commits)


class TimedSession:
    """A draft session that times its own ``start_cycle`` and ``expand`` calls (by nodes per call)."""

    def __init__(self, session: DraftSession, device):
        self.inner, self.device = session, device
        self.d2t, self.hidden_layers = session.d2t, session.hidden_layers
        self.start_times: list[float] = []
        self.expand_times: dict[int, list[float]] = defaultdict(list)

    def start_cycle(self, committed, view: TargetView):
        t0 = _clock(self.device)
        out = self.inner.start_cycle(committed, view)
        self.start_times.append(_clock(self.device) - t0)
        return out

    def expand(self, tokens, parents):
        t0 = _clock(self.device)
        out = self.inner.expand(tokens, parents)
        self.expand_times[len(tokens)].append(_clock(self.device) - t0)
        return out

    def end_cycle(self) -> None:
        self.inner.end_cycle()


@dataclass
class _TimedFactory:
    drafter: SessionFactory
    device: torch.device
    sessions: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.drafter.name

    def new_session(self):
        self.sessions.append(TimedSession(self.drafter.new_session(), self.device))
        return self.sessions[-1]


def measure_drafter(
    target: Target, drafter: SessionFactory, context: int = 256, new_tokens: int = 24, widths=EXPAND_WIDTHS
) -> DrafterCost:
    """A drafter's ``start_cycle`` and ``expand`` seconds, timed inside real speculative cycles on a random prompt
    of ``context`` tokens: trees of depth 3 with ``n`` children per level, for ``n`` in ``widths``."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(100, min(5000, target.info.vocab_size), (context,), generator=g).tolist()
    timed = _TimedFactory(drafter, target.model.device)
    for width in (widths[0], *widths):  # the first run warms up
        cfg = DecodeConfig(
            mode="tree",
            max_new_tokens=new_tokens,
            tree_depth=3,
            tree_top_k=width,
            tree_budget=3 * width,
            stop_token_ids=(),
        )
        speculative_generate(target, timed, prompt, cfg)
    sessions = timed.sessions[1:]
    starts = [t for s in sessions for t in s.start_times]
    expands = defaultdict(list)
    for s in sessions:
        for n, ts in s.expand_times.items():
            expands[n] += ts
    start = _typical(starts)
    # a drafter that never expanded here (n-gram lookup finds no match in a random prompt) is charged its start
    return DrafterCost(start, monotone({n: _typical(ts) for n, ts in sorted(expands.items())}) or {1: start})


# --------------------------------------------------------------------------------------------- the disk cache


def cost_key(target: Target, kernel: bool = True) -> str:
    dtype = next(target.model.parameters()).dtype
    return (
        f"{FORMAT}|{cpu_model() if target.model.device.type == 'cpu' else torch.cuda.get_device_name()}|torch {torch.__version__}"
        f"|{torch.get_num_threads()} threads|{target.info.name} {target.info.fingerprint}|{precision_label(dtype)}"
        f"|kernel {kernel}"
    )


COST_MODELS = "cost_models.json"


def cost_model_for(
    target: Target,
    drafters: dict | None = None,
    context: int = 256,
    kernel: bool = True,
    remeasure: bool = False,
) -> CostModel:
    """The cost model of ``target`` in its dtype on this machine, with the costs of every drafter in ``drafters``
    (name -> SessionFactory): read from ``<cache>/cost_models.json``, what is missing measured and saved."""
    key = cost_key(target, kernel)
    entry = None if remeasure else read_table(COST_MODELS).get(key)
    if entry is None or int(entry.get("context", -1)) != context:
        chain, tree, commit = measure_verification(target, context, kernel=kernel)
        dtype = next(target.model.parameters()).dtype
        entry = dict(
            key=key,
            precision=precision_label(dtype),
            context=context,
            verify_chain=chain,
            verify_tree=tree,
            commit_s=commit,
            drafters={},
        )
    model = CostModel.from_dict(entry)
    missing = {
        name: d for name, d in (drafters or {}).items() if d is not None and name not in model.drafters
    }
    for name, drafter in missing.items():  # the engine runs them with its kernels
        model.drafters[name] = measure_drafter(target, drafter, context)
    if missing or entry.get("drafters") is None or key not in read_table(COST_MODELS):
        save_entry(COST_MODELS, key, model.as_dict())
    return model


# ----------------------------------------------------------------------------- the precision of ``auto``

PLAIN_STEP = "plain-step"  # the key prefix of a plain decoding step measured alone
PLAIN_STEP_REPS = 6  # its timed repetitions, after a warm-up (the cost model's full measurement takes 12)


def plain_step_s(target: Target, context: int = 256, kernel: bool = True) -> float:
    """Seconds of one plain decoding step of ``target`` in its dtype (a one-token forward on a cache of ``context``
    tokens): ``verify_chain[1]`` of its cached cost model; where none is cached, that size measured alone (the
    median of :data:`PLAIN_STEP_REPS`) and cached in ``<cache>/cost_models.json`` beside the cost models."""
    key = cost_key(target, kernel)
    disk = read_table(COST_MODELS)
    entry = disk.get(key)
    if entry is not None and int(entry.get("context", -1)) == context:
        step = CostModel.from_dict(entry).verify_chain.get(1)
        if step is not None:
            return step
    alone = disk.get(f"{PLAIN_STEP}|{key}")
    if alone is not None and int(alone.get("context", -1)) == context:
        return float(alone["seconds"])
    chain, _, _ = measure_verification(target, context, sizes=(1,), reps=PLAIN_STEP_REPS, kernel=kernel)
    save_entry(COST_MODELS, f"{PLAIN_STEP}|{key}", dict(context=context, seconds=chain[1]))
    return chain[1]


def decode_choice_for(target: Target, context: int = 256, kernel: bool = True) -> PrecisionChoice:
    """What ``auto`` decodes ``target`` in on this machine: the precision whose :func:`plain_step_s` is faster
    (bf16 by at least ``target.precision.BF16_MIN_GAIN``); fp32, timing nothing, where bf16 is not native."""

    def step(label: str) -> float:
        return plain_step_s(cast_target(target, DTYPES[label]), context, kernel)

    basis = (
        f"one plain decoding step of {target.info.name} on {context} cached tokens, "
        f"{torch.get_num_threads()} threads, from its cost model"
    )
    return decode_choice(target.info.device, step, basis)


def decode_precision(target: Target, precision: str = "auto", kernel: bool = True) -> torch.dtype:
    """The dtype to decode ``target`` in: ``fp32`` or ``bf16`` as asked (``target.precision.decode_dtype``), or for
    ``auto`` the faster one here (:func:`decode_choice_for`)."""
    if precision == "auto":
        return DTYPES[decode_choice_for(target, kernel=kernel).precision]
    return decode_dtype(precision, target.info.device)
