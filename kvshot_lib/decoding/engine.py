"""The lossless decoding engine: plain autoregressive decoding, chain drafting and EAGLE-2 tree drafting.

One *cycle* of speculative decoding (batch size 1):

1. the drafter drafts a chain or a tree after the *root*, the last committed token (not yet in the
   target's cache);
2. the target scores the root and every draft node in one forward, with a tree attention mask and
   explicit position ids (root at position P, a node at depth d at P + 1 + d);
3. verification walks down from the root:
   - temperature 0: descend to the child equal to the target's argmax;
   - chain sampled at temperature > 0: the rejection rule of :mod:`.sampling`;
   - tree at temperature > 0: sample the target's token and descend if a child drafted it (draft
     children are chosen by top-k, not sampled, so this is the lossless rule for them);
   the target's choice at the last node reached is the *bonus* token;
4. the accepted path's K/V are moved into place and the rest of the block is cropped, so the cache
   holds exactly the committed tokens; stop tokens end generation at that token.

Every cycle records the accepted drafts and, for each draft step, whether it was attempted and
accepted (:class:`GenerationResult`); wall time is split into prefill, draft, verify (the forward and the
acceptance rule) and commit. A chain is verified with the model's own causal mask, a tree with an explicit one.
With shapes chosen by expected speed, every verified tree also teaches the acceptance estimates
(:meth:`~.shapes.AcceptanceModel.observe`).

The loops carry a :class:`~.cycle.CycleState` from cycle to cycle (:mod:`.cycle`: the prefill, the output
so far, drafting, committing); this module holds verification (:func:`verify_tree`) and the two loops, plain
decoding and speculative decoding. SpecPV's loop is :mod:`.specpv`; :func:`~.dispatch.generate` picks one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor

from ..drafters.base import TargetView
from ..drafters.tree_mask import ancestor_matrix, tree_attention_mask
from ..target.forward import forward
from .cycle import CycleState, DecodeConfig, GenerationResult, Prefill, choose_token, keep_block_positions
from .kernels import small_batch_linear
from .sampling import accept_draft_tokens, logits_to_probs, residual_probs, sample
from .tree import DraftTree


def _count_step(result: GenerationResult, step: int, accepted: bool) -> None:
    while len(result.step_attempts) <= step:
        result.step_attempts.append(0)
        result.step_accepts.append(0)
    result.step_attempts[step] += 1
    result.step_accepts[step] += int(accepted)


def walk_tree(
    tree: DraftTree, target_token: Callable[[int], int], result: GenerationResult
) -> tuple[list[int], int]:
    """Descend from the root while some child holds the target's token; count each step's attempt.

    ``target_token(b)`` is the target's token after block position b (0 = root, i + 1 = node i): its
    argmax at temperature 0, a sample of its distribution otherwise. Returns the accepted node indices
    and the bonus token (the target's token after the last accepted node)."""
    children = tree.children()
    path: list[int] = []
    block = 0
    while True:
        want = target_token(block)
        kids = children[block]
        hit = next((c for c in kids if tree.tokens[c] == want), None)
        if kids:
            _count_step(result, len(path), hit is not None)
        if hit is None:
            return path, want
        path.append(hit)
        block = hit + 1


def verify_sampled_chain(tree: DraftTree, p: Tensor, d2t, gen, result) -> tuple[list[int], int]:
    """The rejection rule on a chain whose drafts were sampled from ``tree.q``; ``p [n+1, V]`` holds the
    target's probabilities at the root and after each draft."""
    n = len(tree)
    q = torch.stack(tree.q).to(p.device)  # [n, V_draft]
    if d2t is not None:
        q = q.new_zeros(n, p.shape[-1]).index_copy_(1, d2t.to(p.device, torch.long), q)  # [n, V]
    ok = accept_draft_tokens(p[:n], q, torch.tensor(tree.tokens, device=p.device), gen).tolist()
    n_acc = ok.index(False) if False in ok else n
    for step in range(min(n_acc + 1, n)):
        _count_step(result, step, step < n_acc)
    if n_acc < n:
        return list(range(n_acc)), int(sample(residual_probs(p[n_acc], q[n_acc]), gen))
    return list(range(n)), int(sample(p[n], gen))


def verify_tree(
    tree: DraftTree, logits: Tensor, cfg: DecodeConfig, gen, d2t, result
) -> tuple[list[int], int]:
    """The accepted path and the bonus token, from the target's ``logits [N+1, V]`` over the verified block
    (the root, then the draft nodes); each draft step's attempt is counted in ``result``."""
    if cfg.temperature == 0:
        choice = logits.argmax(-1).tolist()
        return walk_tree(tree, choice.__getitem__, result)
    if tree.q and tree.is_chain():
        p = logits_to_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)  # [n+1, V]
        return verify_sampled_chain(tree, p, d2t, gen, result)
    return walk_tree(tree, lambda b: choose_token(logits[b], cfg, gen), result)


@torch.inference_mode()
def autoregressive_generate(
    target, prompt_ids, cfg: DecodeConfig, prefill: Prefill | None = None
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
    target,
    drafter,
    prompt_ids,
    cfg: DecodeConfig,
    on_cycle: Callable[[Tensor, object], None] | None = None,
    prefill: Prefill | None = None,
) -> GenerationResult:
    """Chain or tree speculative decoding with ``drafter`` (any SessionFactory). Lossless: at temperature 0
    the output is token for token that of :func:`autoregressive_generate`; at temperature > 0 it follows
    the target's distribution. ``on_cycle(committed [1, P], cache)`` is called after every cycle (tests).
    ``prefill``: start from a copy of a shared :class:`Prefill` of this prompt."""
    cfg.validate()
    if cfg.mode == "ar":
        return autoregressive_generate(target, prompt_ids, cfg, prefill)
    with small_batch_linear(target.model, drafter, enabled=cfg.small_batch_kernel):
        return _speculative(target, drafter, prompt_ids, cfg, on_cycle, prefill)


@torch.inference_mode()
def _speculative(target, drafter, prompt_ids, cfg: DecodeConfig, on_cycle, prefill=None) -> GenerationResult:
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
        block = torch.tensor([[result.token_ids[-1], *tree.tokens]], device=dev)  # [1, N+1]
        positions = torch.tensor([[P, *(P + 1 + d for d in tree.depths)]], device=dev)  # [1, N+1]
        chain = tree.is_chain()  # the model's causal mask serves a chain
        mask = None if chain else tree_attention_mask(ancestor_matrix(tree.parents), P, mask_dtype, dev)
        out = forward(model, block, cache, positions=positions, mask=mask, hidden_states=bool(layers))
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
