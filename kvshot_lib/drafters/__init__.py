"""The drafters stage: the decode-time contract (``base``), the trainable paradigms, and the baselines.

Trainable: hidden-only (EAGLE-3), KV-only, hybrid, and the block drafter (``block.py``, DFlash-style parallel
drafting of a whole block in one forward, with its session in ``block_session.py``).

* :func:`load_drafter` (checkpoint folder, target) -> a drafter that is also a ``SessionFactory``;
* :func:`build_drafter` / :func:`drafter_config_for` make a fresh one; :func:`save_drafter` writes one;
* :mod:`.baselines`: drafters that need no training (n-gram prompt lookup, the target itself, early exit,
  random), and :func:`resolve_drafter` / :func:`drafters_for_run` that turn names and folders into drafters;
  :func:`drafter_for_target` binds one to another copy of its target (bf16 decoding).

It hands drafter modules to training and drafter sessions (``start_cycle`` / ``expand``) to decoding.
"""

from .attention import Segment, apply_rope, segmented_attention
from .base import DraftSession, SessionFactory, TargetView
from .baselines import (
    BASELINES,
    EarlyExitDrafter,
    NgramDrafter,
    RandomDrafter,
    SelfDrafter,
    drafter_for_target,
    drafters_for_run,
    is_baseline_name,
    resolve_drafter,
)
from .checkpoint import build_drafter, load_drafter, read_config, rebind_drafter, save_drafter
from .config import (
    KV_MODES,
    PARADIGMS,
    REGIMES,
    DrafterConfig,
    DrafterConfigError,
    DrafterTargetMismatch,
    drafter_config_for,
)
from .eagle3_format import export_eagle3, is_eagle3_folder, load_eagle3
from .kv import KVDrafter, RecencyBias
from .session import TrainedDraftSession
from .target_init import init_attention_from_target
from .tree_mask import ancestor_matrix, tree_attention_mask
from .unroll import TrainBatch, UnrollContext, ttt_attention_mask
from .vocab import count_tokens, coverage, draft_vocab_from_counts, target_to_draft, vocab_hash

__all__ = [
    "BASELINES",
    "DraftSession",
    "DrafterConfig",
    "DrafterConfigError",
    "DrafterTargetMismatch",
    "EarlyExitDrafter",
    "KVDrafter",
    "KV_MODES",
    "NgramDrafter",
    "PARADIGMS",
    "REGIMES",
    "RandomDrafter",
    "RecencyBias",
    "Segment",
    "SelfDrafter",
    "SessionFactory",
    "TargetView",
    "TrainBatch",
    "TrainedDraftSession",
    "UnrollContext",
    "ancestor_matrix",
    "apply_rope",
    "build_drafter",
    "count_tokens",
    "coverage",
    "draft_vocab_from_counts",
    "drafter_config_for",
    "drafter_for_target",
    "drafters_for_run",
    "init_attention_from_target",
    "is_baseline_name",
    "load_drafter",
    "load_eagle3",
    "export_eagle3",
    "is_eagle3_folder",
    "read_config",
    "rebind_drafter",
    "resolve_drafter",
    "save_drafter",
    "segmented_attention",
    "target_to_draft",
    "tree_attention_mask",
    "ttt_attention_mask",
    "vocab_hash",
]
