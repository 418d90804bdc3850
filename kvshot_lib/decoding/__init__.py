"""The decoding stage: the lossless speculative decoding engine.

* :func:`generate` (:mod:`.dispatch`) decodes a prompt in one of three *modes*: plainly (``ar``), with a chain
  of drafts, or with an EAGLE-2 dynamic tree (:class:`DecodeConfig`), verifying greedily or with the
  rejection-sampling rule (:mod:`.sampling`);
* :mod:`.cycle` holds what every loop shares: a :class:`Prefill` of the prompt, then *cycles* (draft, verify,
  commit) carried by a :class:`CycleState`; :mod:`.engine` verifies and runs the plain and speculative loops;
* :mod:`.tree` drafts one cycle through a drafter's session in a fixed shape; :mod:`.proposal` drafts it in a
  shape chosen by expected speed (:mod:`.shapes`: accepted tokens per second from online acceptance estimates and
  :mod:`.cost_model`'s measured costs, with an early stop), and joins prompt lookup's continuation to it;
  :mod:`.kernels` holds the small-batch matmul that makes a decoding step and a verified block cheap on a CPU;
* :mod:`.specpv` verifies against a partial KV cache (:mod:`.partial_kv`: sinks, retrieved blocks, a
  window, a buffer) with a full pass once ``full_every`` tokens are pending (SpecPV), in one of two
  *variants*: ``specpv`` (the paper's) or ``strict`` (lossless); ``generate(..., partial=SpecPVConfig(...))``.

It hands :class:`GenerationResult` objects (tokens, accepted tokens per cycle, per-step counts, timings) to
evaluation.
"""

from .cost_model import (
    CostModel,
    DrafterCost,
    TimedSession,
    cost_model_for,
    measure_drafter,
    measure_verification,
)
from .cycle import (
    MODES,
    SHAPES,
    CycleState,
    DecodeConfig,
    GenerationResult,
    Prefill,
    draft_cycle,
    keep_block_positions,
    stop_tokens,
)
from .dispatch import generate
from .engine import (
    autoregressive_generate,
    speculative_generate,
    verify_sampled_chain,
    verify_tree,
    walk_tree,
)
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
from .sampling import (
    accept_draft_tokens,
    check_sampling_args,
    logits_to_probs,
    rejection_sample,
    residual_probs,
    sample,
)
from .shapes import (
    AcceptanceModel,
    SpeedModel,
    best_chain_length,
    best_expansion,
    best_size,
    chain_values,
    expected_tokens,
)
from .specpv import VARIANTS, SpecPVConfig, SpecPVResult, specpv_generate
from .tree import DraftTree, draft_chain, draft_dynamic_tree

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
