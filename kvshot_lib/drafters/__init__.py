"""Drafters: the decode-time contract (``base``) and the three trainable paradigms.

* :func:`load_drafter` (checkpoint folder, target) -> a drafter that is also a ``SessionFactory``;
* :func:`build_drafter` / :func:`drafter_config_for` make a fresh one; :func:`save_drafter` writes one.
"""

from .base import DraftSession, SessionFactory, TargetView
from .checkpoint import build_drafter, load_drafter, read_config, save_drafter
from .config import (
    KV_MODES,
    PARADIGMS,
    REGIMES,
    DrafterConfig,
    DrafterConfigError,
    DrafterTargetMismatch,
    drafter_config_for,
)
from .vocab import count_tokens, draft_vocab_from_counts, target_to_draft, vocab_hash

__all__ = [
    "KV_MODES",
    "PARADIGMS",
    "REGIMES",
    "DraftSession",
    "DrafterConfig",
    "DrafterConfigError",
    "DrafterTargetMismatch",
    "SessionFactory",
    "TargetView",
    "build_drafter",
    "count_tokens",
    "draft_vocab_from_counts",
    "drafter_config_for",
    "load_drafter",
    "read_config",
    "save_drafter",
    "target_to_draft",
    "vocab_hash",
]
