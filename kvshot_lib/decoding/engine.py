"""The lossless decoding loops: plain autoregressive decoding, and speculative decoding with a chain or an
EAGLE-2 tree of drafts.

One *cycle* of speculative decoding (batch size 1):

1. the drafter drafts a chain or a tree after the *root*, the last committed token (not yet in the
   target's cache);
2. the target scores the root and every draft node in one forward, with explicit position ids (root at
   position P, a node at depth d at P + 1 + d): a chain under the model's own causal mask, a tree under an
   explicit one;
3. verification (:mod:`.verify`) walks down from the root and returns the accepted path and the *bonus* token;
4. the accepted path's K/V are moved into place and the rest of the block is cropped, so the cache
   holds exactly the committed tokens; stop tokens end generation at that token.

Every cycle records the accepted drafts and, for each draft step, whether it was attempted and
accepted (:class:`~.config.GenerationResult`); wall time is split into prefill, draft, verify (the forward and the
acceptance rule) and commit. With shapes chosen by expected speed, every verified tree also teaches the acceptance
estimates (:meth:`~.speed_model.AcceptanceModel.observe`).

The loops carry a :class:`~.cycle.CycleState` from cycle to cycle (:mod:`.cycle`: the prefill, the output
so far, drafting, committing). SpecPV's loop is :mod:`.specpv`; :func:`~.generate.generate` picks one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor

from ..drafters.base import SessionFactory, TargetView
from ..drafters.tree_mask import tree_attention_mask
from ..target import Target
from ..target.forward import forward
from .config import DecodeConfig, GenerationResult
from .cycle import CycleState, Prefill, keep_block_positions
from .kernels import small_batch_linear
from .replay import ReplayedAcceptance
from .tree import DraftTree
from .verify import choose_token, verify_tree


@torch.inference_mode()
def autoregressive_generate(
    target: Target, prompt_ids, cfg: DecodeConfig, prefill: Prefill | None = None
) -> GenerationResult:
    """The baseline: one target forward per token on a KV cache (argmax, or a sample at temperature > 0).
    ``prefill``: start from a copy of a shared :class:`Prefill` of this prompt instead of running it."""
    cfg.validate()
    model = target.model
    state = CycleState(target, prompt_ids, cfg)
    if cfg.max_new_tokens == 0:
        return state.result
    cache = state.prefill((), prefill)
    tok = torch.empty(1, 1, dtype=torch.long, device=model.device)
    with small_batch_linear(model, enabled=cfg.small_batch_kernel):  # the same kernels as verification
        while not state.done and not state.out_of_context():
            tok[0, 0] = state.result.token_ids[-1]
            pos = torch.tensor([[state.root]], device=model.device)
            out = forward(model, tok, cache, positions=pos)
            state.commit([choose_token(out.logits[0, -1], cfg, state.gen)])
    result = state.finish()
    result.verify_s = result.total_s - result.prefill_s
    return result


def speculative_generate(
    target: Target,
    drafter: SessionFactory,
    prompt_ids,
    cfg: DecodeConfig,
    on_cycle: Callable[[Tensor, object], None] | None = None,
    prefill: Prefill | None = None,
    replay: ReplayedAcceptance | None = None,
) -> GenerationResult:
    """Chain or tree speculative decoding with ``drafter`` (any SessionFactory). Lossless: at temperature 0
    the output is token for token that of :func:`autoregressive_generate`; at temperature > 0 it follows
    the target's distribution. ``on_cycle(committed [1, P], cache)`` is called after every cycle (tests).
    ``prefill``: start from a copy of a shared :class:`Prefill` of this prompt. ``replay``: each cycle's verdict
    drawn at a given acceptance instead (:mod:`.replay`: the costs stay real, the output is its reference's)."""
    cfg.validate()
    if cfg.mode == "ar":
        return autoregressive_generate(target, prompt_ids, cfg, prefill)
    with small_batch_linear(target.model, drafter, enabled=cfg.small_batch_kernel):
        return _speculative(target, drafter, prompt_ids, cfg, on_cycle, prefill, replay)


@torch.inference_mode()
def _speculative(
    target: Target,
    drafter: SessionFactory,
    prompt_ids,
    cfg: DecodeConfig,
    on_cycle,
    prefill=None,
    replay=None,
) -> GenerationResult:
    model, dev = target.model, target.model.device
    state = CycleState(target, prompt_ids, cfg)
    result = state.result
    if cfg.max_new_tokens == 0:
        return result
    session = drafter.new_session()
    layers = tuple(session.hidden_layers)
    cache = state.prefill(layers, prefill)
    mask_dtype = next(model.parameters()).dtype
    while not state.done and not state.out_of_context():
        P, cap = state.root, state.cap()  # the root sits at P; cap: drafts that can commit
        t_draft = time.perf_counter()
        tree = DraftTree()
        if cap > 0:
            tree = state.draft(session, TargetView(cache=cache, hidden=state.hidden), cap)
        t_verify = time.perf_counter()
        if replay is not None:  # the verdict drawn first: the block then carries the reference's tokens
            path, bonus = replay.choose(tree, len(result.token_ids))
        block = torch.tensor([[result.token_ids[-1], *tree.tokens]], device=dev)  # [1, N+1]
        positions = torch.tensor([[P, *(P + 1 + d for d in tree.depths)]], device=dev)  # [1, N+1]
        chain = tree.is_chain()  # the model's causal mask serves a chain
        mask = None if chain else tree_attention_mask(tree.ancestors(), P, mask_dtype, dev)
        out = forward(model, block, cache, positions=positions, mask=mask, hidden_states=bool(layers))
        if replay is None:
            path, bonus = verify_tree(tree, out.logits[0], cfg, state.gen, session.d2t, result)
        t_commit = time.perf_counter()
        keep = [0, *(i + 1 for i in path)]
        keep_block_positions(cache, P, keep)
        state.keep_hidden(out.hidden_states, layers, keep)
        if cap > 0:
            state.record(tree, path)
        if cfg.speed is not None:
            cfg.speed.acceptance.observe(tree, path)
        done = state.commit([*(tree.tokens[i] for i in path), bonus])
        result.draft_s += t_verify - t_draft
        result.verify_s += t_commit - t_verify
        result.commit_s += time.perf_counter() - t_commit
        if on_cycle is not None and not done:
            on_cycle(state.committed[:, : P + 1 + len(path)].clone(), cache)
    return state.finish()
