"""The decoding stage: the lossless speculative decoding engine. Where each concept lives:

* :mod:`.generate`: :func:`generate`, the one entry point: plain (``ar``), chain or tree decoding, or SpecPV;
* :mod:`.config`: :class:`DecodeConfig` (the *mode*, sampling, draft sizes and shape) and :class:`GenerationResult`;
* :mod:`.cycle`: what every loop shares: a :class:`Prefill` of the prompt, then *cycles* (draft, verify, commit)
  carried by a :class:`CycleState`;
* :mod:`.engine`: the plain and the speculative loop;
* :mod:`.verify`: the acceptance rule: greedy match, rejection sampling, the accepted path and the bonus token;
* :mod:`.sampling`: from logits to the distributions drafts and the target's tokens are drawn from;
* :mod:`.tree`: :class:`DraftTree` and the fixed shapes: a chain, and EAGLE-2's dynamic tree (its one builder);
* :mod:`.device_draft`: the same cycle drafted in tensors at fixed shapes (a chain; EAGLE-2's tree as a fixed-width
  beam), one host read per cycle, replayed as a CUDA graph on a GPU (``DecodeConfig.draft_loop``);
* :mod:`.replay`: speculative decoding at a given acceptance (real drafting and verification, drawn verdicts);
* :mod:`.proposal`: shapes chosen by expected speed, and prompt lookup's continuation joined to the drafts;
* :mod:`.speed_model`: the acceptance estimates and the expected tokens per second shapes are chosen by;
* :mod:`.cost_model`: what a cycle costs on this machine, measured once and cached;
* :mod:`.kernels`: the small-batch matmul that makes a decoding step and a verified block cheap on a CPU;
* :mod:`.partial_kv`: SpecPV's partial KV cache (sinks, retrieved blocks, a window, a buffer);
* :mod:`.specpv`: verification against it, with a full pass once ``full_every`` tokens are pending, in two
  *variants*: ``specpv`` (the paper's) or ``strict`` (lossless);
* :mod:`.cli`: ``kvshot generate``.

It hands :class:`GenerationResult` objects (tokens, accepted tokens per cycle, per-step counts, timings) to
evaluation.
"""

from .config import MODES, SHAPES, DecodeConfig, GenerationResult
from .cost_model import (
    CostModel,
    DrafterCost,
    TimedSession,
    cost_model_for,
    measure_drafter,
    measure_verification,
)
from .cycle import CycleState, Prefill, draft_cycle, keep_block_positions, stop_tokens
from .device_draft import beam_loop, chain_loop, device_chain, device_tree, draft_capture_seconds
from .engine import autoregressive_generate, speculative_generate
from .generate import generate
from .kernels import small_batch_linear
from .partial_kv import (
    BlockSummaries,
    PartialKVCache,
    PartialKVConfig,
    block_scores,
    compact_attention,
    layout,
    selected_positions,
)
from .proposal import add_lookup, chosen_chain, chosen_tree, lookup_chain, select_by_value
from .replay import ReplayedAcceptance, mat_of, profile_for_mat
from .sampling import check_sampling_args, logits_to_probs, sample
from .specpv import VARIANTS, SpecPVConfig, SpecPVResult, specpv_generate
from .speed_model import (
    AcceptanceModel,
    SpeedModel,
    best_chain_length,
    best_expansion,
    best_size,
    chain_values,
    expected_tokens,
)
from .tree import DraftTree, draft_chain, draft_dynamic_tree
from .verify import (
    accept_draft_tokens,
    rejection_sample,
    residual_probs,
    verify_sampled_chain,
    verify_tree,
    walk_tree,
)

__all__ = [
    "AcceptanceModel",
    "BlockSummaries",
    "CostModel",
    "DrafterCost",
    "SHAPES",
    "SpeedModel",
    "TimedSession",
    "add_lookup",
    "best_chain_length",
    "best_expansion",
    "best_size",
    "chain_values",
    "chosen_chain",
    "chosen_tree",
    "cost_model_for",
    "expected_tokens",
    "lookup_chain",
    "measure_drafter",
    "measure_verification",
    "select_by_value",
    "ReplayedAcceptance",
    "beam_loop",
    "chain_loop",
    "device_chain",
    "device_tree",
    "draft_capture_seconds",
    "mat_of",
    "profile_for_mat",
    "CycleState",
    "DecodeConfig",
    "DraftTree",
    "GenerationResult",
    "MODES",
    "PartialKVCache",
    "PartialKVConfig",
    "Prefill",
    "SpecPVConfig",
    "SpecPVResult",
    "VARIANTS",
    "accept_draft_tokens",
    "autoregressive_generate",
    "block_scores",
    "check_sampling_args",
    "compact_attention",
    "draft_chain",
    "draft_cycle",
    "draft_dynamic_tree",
    "generate",
    "keep_block_positions",
    "layout",
    "logits_to_probs",
    "rejection_sample",
    "residual_probs",
    "sample",
    "selected_positions",
    "small_batch_linear",
    "specpv_generate",
    "speculative_generate",
    "stop_tokens",
    "verify_sampled_chain",
    "verify_tree",
    "walk_tree",
]
