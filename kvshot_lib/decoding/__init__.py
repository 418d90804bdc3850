"""The decoding stage: the lossless speculative decoding engine.

* :func:`generate` decodes a prompt plainly (``ar``), with a chain of drafts, or with an EAGLE-2 dynamic
  tree (:class:`DecodeConfig`), verifying greedily or with the rejection-sampling rule (:mod:`.sampling`);
* :mod:`.tree` drafts one cycle through a drafter's session; :mod:`.kernels` holds the small-batch matmul
  that makes verifying a block cheap on a CPU.

It hands :class:`GenerationResult` objects (tokens, accepted tokens per cycle, per-step counts, timings) to
evaluation.
"""

from .engine import (
    MODES,
    DecodeConfig,
    GenerationResult,
    autoregressive_generate,
    generate,
    keep_block_positions,
    speculative_generate,
    verify_sampled_chain,
    walk_tree,
)
from .kernels import small_batch_linear
from .sampling import (
    accept_draft_tokens,
    check_sampling_args,
    logits_to_probs,
    rejection_sample,
    residual_probs,
    sample,
)
from .tree import DraftTree, draft_chain, draft_dynamic_tree

__all__ = [
    "MODES",
    "DecodeConfig",
    "DraftTree",
    "GenerationResult",
    "accept_draft_tokens",
    "autoregressive_generate",
    "check_sampling_args",
    "draft_chain",
    "draft_dynamic_tree",
    "generate",
    "keep_block_positions",
    "logits_to_probs",
    "rejection_sample",
    "residual_probs",
    "sample",
    "small_batch_linear",
    "speculative_generate",
    "verify_sampled_chain",
    "walk_tree",
]
