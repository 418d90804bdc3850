"""The drafters stage: the decode-time contract, the trainable paradigms, the baselines. Where each lives:

* ``base``: the contract the engine drafts through (:class:`SessionFactory`, :class:`DraftSession`,
  :class:`TargetView`); ``tree_mask``: who sees whom in a draft tree; ``vocab``: the reduced draft vocabulary;
* ``config``: :class:`DrafterConfig` of every paradigm, :func:`drafter_config_for` a target;
* ``trainable``: ``TrainableDrafter``, the base of the trainable paradigms (frozen target embedding and LM
  head, RoPE, the target's KV as each layer reads it); ``attention``: their building blocks;
* ``unroll``: training's TTT unroll (:class:`TrainBatch`, :class:`UnrollContext`, ``unroll``: their forward);
* the paradigms: ``hidden`` (EAGLE-3, 3.1), ``kv``, ``hybrid``, ``cross``, ``no_target`` (the control),
  ``block`` (DFlash-style: a block per forward); ``target_init``: a KV drafter's attention from the target's;
* decode-time sessions: ``session`` (all but the block drafter), ``block_session``, ``kv_buffer`` (their K/V);
* ``checkpoint``: :func:`build_drafter`, :func:`save_drafter`, :func:`load_drafter`, :func:`rebind_drafter`;
  ``eagle3_format``: the EAGLE-3 layout serving engines load, out and in (``cli``: ``kvshot export``);
* ``baselines``: drafters that need no training (n-gram prompt lookup, the target itself, early exit, random),
  :func:`resolve_drafter` / :func:`drafters_for_run` (names, folders -> drafters), :func:`drafter_for_target`.

It hands drafter modules to training and drafter sessions (``start_cycle`` / ``expand``) to decoding.
"""

from .attention import BandBias, Segment, apply_rope, segmented_attention
from .base import DraftSession, SessionFactory, TargetView
from .baselines import (
    BASELINES,
    EarlyExitDrafter,
    NgramDrafter,
    RandomDrafter,
    SelfDrafter,
    checkpoint_label,
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
    "BandBias",
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
    "checkpoint_label",
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
