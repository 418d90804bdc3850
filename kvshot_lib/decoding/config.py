"""How to decode and what one generation measured.

:class:`DecodeConfig` says how to decode, in one of three *modes* (:data:`MODES`: ``ar``, ``chain``, ``tree``), with
draft shapes fixed or chosen by expected speed (:data:`SHAPES`); :class:`GenerationResult` holds the new tokens and
everything counted and timed along the way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .sampling import check_sampling_args
from .speed_model import SpeedModel

MODES = ("ar", "chain", "tree")
SHAPES = ("fixed", "chosen")
TARGET_CACHES = ("auto", "dynamic", "static")
DRAFT_LOOPS = ("auto", "host", "device")


@dataclass
class DecodeConfig:
    """How to decode. ``chain_depth`` is k, the number of drafted tokens per chain cycle; the tree has
    ``tree_depth`` levels, ``tree_top_k`` children per expanded node and ``tree_budget`` nodes.

    ``shape="chosen"`` drafts by expected speed (:mod:`.proposal`, :mod:`.speed_model`): the fixed sizes become caps,
    drafting stops when the next node is not worth its cost, and the verified nodes are those that maximize
    expected tokens per second under ``speed`` (a :class:`~.speed_model.SpeedModel`: the measured cost model and the
    acceptance estimates, shared by the generations that pass it). ``lookup=True`` adds prompt lookup's
    continuation (up to ``lookup_tokens``) to every cycle's proposal, verified in the same forward.

    ``target_cache`` is the target's KV cache: ``dynamic`` (transformers' ``DynamicCache``, grown by concatenation),
    ``static`` (preallocated and written by slot; on a GPU every decode and verify forward is a CUDA graph replay,
    :mod:`kvshot_lib.target.graphs`) or ``auto``: static on a GPU, dynamic on a CPU (where the static cache's
    full-length attention costs more than it saves). Both give the same tokens.

    ``draft_loop`` is where a greedy fixed-shape cycle is drafted: ``host`` (:mod:`.tree`: the dynamic tree built in
    Python, level by level), ``device`` (:mod:`.device_draft`: the chain or the fixed-width beam tree in tensors over
    the session's fixed-shape steps, one host read per cycle; on a GPU replayed as a CUDA graph) or ``auto``: device
    on a GPU, host on a CPU. Sampling, shapes chosen by expected speed and drafters without fixed-shape steps (n-gram,
    the target itself) always draft on the host. ``compile_target``: on a GPU's static cache, the recorded forwards
    run the decoder layers' norms and MLPs compiled by ``torch.compile`` (:func:`kvshot_lib.target.graphs.compiled_layers`;
    compiling takes seconds per width, so it is off by default, and a CPU ignores it)."""

    mode: str = "chain"
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    chain_depth: int = 4
    tree_depth: int = 6
    tree_top_k: int = 4
    tree_budget: int = 24
    stop_token_ids: tuple[int, ...] | None = None  # None: the target's EOS ids
    seed: int = 0
    small_batch_kernel: bool = True  # CPU: a faster matmul for 1-8-token blocks (kvshot_lib.decoding.kernels)
    shape: str = "fixed"  # "fixed" | "chosen" (by expected tokens per second; needs speed)
    lookup: bool = False  # prompt lookup joins the drafter's proposal
    lookup_tokens: int = 8
    target_cache: str = "auto"  # "auto" | "dynamic" | "static"
    draft_loop: str = "auto"  # "auto" | "host" | "device"
    compile_target: bool = (
        False  # GPU, static cache: graphs record the decoder layers' norms and MLPs compiled
    )
    speed: SpeedModel | None = field(default=None, repr=False, compare=False)

    def validate(self) -> DecodeConfig:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}.")
        if self.target_cache not in TARGET_CACHES:
            raise ValueError(f"target_cache must be one of {TARGET_CACHES}, got {self.target_cache!r}.")
        if self.draft_loop not in DRAFT_LOOPS:
            raise ValueError(f"draft_loop must be one of {DRAFT_LOOPS}, got {self.draft_loop!r}.")
        if self.shape not in SHAPES:
            raise ValueError(f"shape must be one of {SHAPES}, got {self.shape!r}.")
        if self.shape == "chosen" and self.speed is None:
            raise ValueError(
                "shape='chosen' needs speed=SpeedModel(cost_model_for(target, {name: drafter}), name): the measured "
                "costs and the acceptance estimates it chooses by."
            )
        check_sampling_args(self.temperature, self.top_k, self.top_p)
        for name in (
            "max_new_tokens",
            "chain_depth",
            "tree_depth",
            "tree_top_k",
            "tree_budget",
            "lookup_tokens",
        ):
            value = getattr(self, name)
            if (
                not isinstance(value, int)
                or isinstance(value, bool)
                or value < (0 if name == "max_new_tokens" else 1)
            ):
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        return self

    def static_cache(self, device) -> bool:
        """Whether the target decodes on a static cache on ``device`` (``target_cache``; auto: on a GPU)."""
        return self.target_cache == "static" or (self.target_cache == "auto" and device.type == "cuda")

    def device_draft(self, device) -> bool:
        """Whether a cycle drafts on the device path (``draft_loop``; auto: on a GPU), where it applies: greedy,
        fixed shapes."""
        on = self.draft_loop == "device" or (self.draft_loop == "auto" and device.type == "cuda")
        return on and self.temperature == 0 and self.shape == "fixed"

    def widest_block(self) -> int:
        """The most tokens one target forward can verify: the root and every node of the largest proposal."""
        drafts = 0 if self.mode == "ar" else max(self.chain_depth, self.tree_budget)
        return 1 + drafts + (self.lookup_tokens if self.lookup else 0)


@dataclass
class GenerationResult:
    """One generation: the new tokens and everything measured along the way."""

    token_ids: list[int]  # generated tokens; a stop token, if hit, is the last one
    prompt_len: int
    stop_reason: str  # "stop_token" | "max_new_tokens" | "context"
    accepted_per_cycle: list[int] = field(default_factory=list)  # drafts accepted per cycle (bonus excluded)
    drafted_per_cycle: list[int] = field(default_factory=list)  # draft nodes verified per cycle
    step_attempts: list[int] = field(default_factory=list)  # [k] cycles that reached draft step k
    step_accepts: list[int] = field(default_factory=list)  # [k] ... and accepted it
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0  # the target's forward and the acceptance rule
    commit_s: float = 0.0  # the cache moved into place, hidden states kept, tokens appended
    total_s: float = 0.0

    @property
    def n_cycles(self) -> int:
        return len(self.accepted_per_cycle)

    @property
    def tokens_per_s(self) -> float:
        """End to end: new tokens over wall time, prefill included."""
        return len(self.token_ids) / self.total_s if self.total_s > 0 else float("nan")
