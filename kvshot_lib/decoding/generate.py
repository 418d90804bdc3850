"""``generate``: one entry point for every way of decoding, above both loops.

It picks plain decoding, speculative decoding (:mod:`.engine`) or partial verification (:mod:`.specpv`), so it
imports both; neither imports it.
"""

from __future__ import annotations

from ..drafters.base import SessionFactory
from ..target import Target
from .config import DecodeConfig, GenerationResult
from .cycle import Prefill
from .engine import autoregressive_generate, speculative_generate
from .specpv import SpecPVConfig, specpv_generate


def generate(
    target: Target,
    prompt_ids,
    cfg: DecodeConfig,
    drafter: SessionFactory | None = None,
    partial: SpecPVConfig | None = None,
    prefill: Prefill | None = None,
) -> GenerationResult:
    """Decode ``prompt_ids`` with ``cfg.mode``: ``"ar"`` needs no drafter; ``"chain"`` / ``"tree"`` need one.
    ``partial`` verifies against a partial KV cache (SpecPV, :func:`~.specpv.specpv_generate`); ``prefill``
    starts from a copy of a shared :class:`~.cycle.Prefill` of this prompt."""
    cfg.validate()
    if partial is not None:
        return specpv_generate(target, drafter, prompt_ids, cfg, partial, prefill=prefill)
    if cfg.mode == "ar":
        return autoregressive_generate(target, prompt_ids, cfg, prefill)
    if drafter is None:
        raise ValueError(f"mode={cfg.mode!r} needs a drafter; use mode='ar' for plain decoding.")
    return speculative_generate(target, drafter, prompt_ids, cfg, prefill=prefill)
