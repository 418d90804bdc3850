"""SpecPV: speculative decoding that verifies against a partial KV cache, with a periodic full pass.

State: the **full cache** (a DynamicCache) holds exact K/V of positions ``0..F-1`` and nothing else; the
committed tokens run to the *root* at ``P >= F``; the *pending* tokens ``F..P-1`` were verified only
partially, and their (inexact) K/V sit in the buffer of the :class:`~.partial_kv.PartialKVCache`.

One cycle (batch size 1):

1. the drafter drafts a chain or a tree after the root, exactly as in :mod:`.engine` (any drafter: the
   n-gram drafter, trained checkpoints, baselines; none at all verifies the root alone). Its view of the
   target's cache is the full cache followed by the buffer;
2. **partial verification** (the usual case): the root and the drafts run against the compact cache
   (sinks, retrieved blocks, window, buffer) with their true position ids and an explicit tree mask; the
   accepted path and the bonus are chosen from those logits and the accepted K/V join the buffer;
3. **full verification** when ``full_every`` tokens are pending, at the start, after a rollback, and
   whenever the context fits the budget: the pending tokens are *re-fed* with the root and
   the drafts against the full cache, so they get exact K/V; the drafts are verified on exact logits; the
   partial cache is rebuilt from the full one, its blocks scored with the drafts' queries;
4. two *variants* (:data:`VARIANTS`; ``mode`` is kept for ar/chain/tree). ``specpv`` (the paper): partially
   verified tokens are final. ``strict`` (``SpecPVConfig.strict``): at each full pass the
   pending tokens chosen on partial logits are re-checked against the full logits (argmax at
   temperature 0; at temperature > 0 the rejection rule with the partial distribution as the proposal:
   :func:`~.verify.first_mismatch`),
   and generation rolls back to the first mismatch and continues from the full model's token; output
   ending on unchecked tokens gets a last check first. So ``strict`` output is plain decoding's, token
   for token at temperature 0, at any budget (``tests/test_specpv.py``).

``full_every=0`` verifies fully every cycle: lossless speculative decoding. Phase times, the kind of each
cycle and every rollback are recorded in :class:`SpecPVResult`. In the code, ``P`` is always the root's
position, never ``full_every``. The loop (:func:`_specpv`) drafts through the
:class:`~.cycle.CycleState`, then runs one of :class:`_Passes`' two passes; a strict rollback
(:meth:`_Passes._roll_back`) starts the cycle over.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor
from transformers import DynamicCache

from ..drafters.base import DraftSession, SessionFactory, TargetView
from ..drafters.tree_mask import ancestor_matrix, tree_attention_mask
from ..target import Target
from ..target.capture import capture
from ..target.forward import forward
from .config import DecodeConfig, GenerationResult
from .cycle import CycleState, Prefill, keep_block_positions
from .kernels import small_batch_linear
from .partial_kv import PartialKVCache, PartialKVConfig, compact_attention_mode
from .sampling import logits_to_probs
from .tree import DraftTree
from .verify import first_mismatch, verify_tree

VARIANTS = ("specpv", "strict")  # SpecPVConfig.strict: False, True


@dataclass
class SpecPVConfig(PartialKVConfig):
    """Partial verification: the cache geometry (:class:`~.partial_kv.PartialKVConfig`), a full pass once
    ``full_every`` tokens are pending (0: every cycle), and the variant: ``strict`` re-checks at each full pass.
    ``always_partial`` verifies partially even when the context fits the budget (tests)."""

    full_every: int = 16
    strict: bool = False
    always_partial: bool = False

    def validate(self) -> SpecPVConfig:
        super().validate()
        if not isinstance(self.full_every, int) or isinstance(self.full_every, bool) or self.full_every < 0:
            raise ValueError(
                f"full_every must be a non-negative integer: a full pass once that many tokens are pending "
                f"(0 = every cycle, lossless); got {self.full_every!r}."
            )
        return self


@dataclass
class SpecPVResult(GenerationResult):
    """A generation under partial verification. ``cycle_kind[i]`` is ``"partial"`` or ``"full"`` for the
    i-th drafting cycle (aligned with ``accepted_per_cycle``); ``rollbacks`` lists the tokens discarded at
    each strict rollback. ``verify_s = partial_s + full_s``; ``refresh_s`` (block scoring and gathering the
    compact cache) is counted apart from both."""

    cycle_kind: list[str] = field(default_factory=list)
    n_partial: int = 0  # verification forwards on the compact cache
    n_full: int = 0  # ... on the full cache (re-feeding the pending tokens)
    refed_tokens: int = 0  # pending tokens re-fed at full passes
    rollbacks: list[int] = field(default_factory=list)
    partial_s: float = 0.0
    full_s: float = 0.0
    refresh_s: float = 0.0


@dataclass
class PartialStep:
    """What a probe sees after a partial verification (before its K/V join the buffer)."""

    model: torch.nn.Module
    full_cache: DynamicCache  # exact K/V of positions 0..F-1
    F: int
    ids: Tensor  # [1, P-F+1+N]: the pending tokens, the root and the drafts
    tree: DraftTree
    logits: Tensor  # [N+1, V] partial-verification logits of the root and the drafts
    hidden: Tensor  # [N+1, H] their last hidden states (after the final norm)
    path: list[int]  # accepted draft nodes


def full_block(F: int, pending_and_root: Tensor, tree: DraftTree, dtype, device):
    """Ids ``[1, n]``, positions ``[1, n]`` and mask of a full pass: the pending tokens and the root
    (positions ``F..P``, causal), then the draft tree under the root."""
    n_pend = pending_and_root.shape[1] - 1
    parents = [k - 1 for k in range(n_pend)] + [n_pend - 1 if p < 0 else n_pend + p for p in tree.parents]
    ids = torch.cat([pending_and_root, torch.tensor([tree.tokens], dtype=torch.long, device=device)], 1)
    P = F + n_pend
    positions = torch.tensor([[*range(F, P + 1), *(P + 1 + d for d in tree.depths)]], device=device)
    mask = tree_attention_mask(ancestor_matrix(parents), F, dtype, device) if parents else None
    return ids, positions, mask


class _PendingLayer:
    """One layer of the drafter's view: the full cache's exact K/V, then the buffer's (built on access)."""

    def __init__(self, full, compact, n_static: int):
        self._full, self._compact, self._n = full, compact, n_static
        self._kv: tuple[Tensor, Tensor] | None = None

    def _get(self) -> tuple[Tensor, Tensor]:
        if self._kv is None:
            buf = slice(self._n, None)
            self._kv = (
                torch.cat([self._full.keys, self._compact.keys[:, :, buf]], 2),  # [1, kvH, P, D]
                torch.cat([self._full.values, self._compact.values[:, :, buf]], 2),
            )
        return self._kv

    keys = property(lambda self: self._get()[0])
    values = property(lambda self: self._get()[1])


class PendingView:
    """A cache-like view of positions ``0..P-1`` for drafters that read the target's K/V."""

    def __init__(self, full: DynamicCache, partial: PartialKVCache):
        self.layers = [
            _PendingLayer(f, c, partial.n_static) for f, c in zip(full.layers, partial.cache.layers)
        ]
        self._len = full.get_seq_length() + partial.n_buffer

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._len


def specpv_generate(
    target: Target,
    drafter: SessionFactory | None,
    prompt_ids,
    cfg: DecodeConfig,
    pv: SpecPVConfig,
    on_partial: Callable[[PartialStep], None] | None = None,
    on_full: Callable[[Tensor, DynamicCache], None] | None = None,
    prefill: Prefill | None = None,
) -> SpecPVResult:
    """Decode with partial verification (module docstring). ``drafter=None`` with ``cfg.mode="ar"`` verifies
    the root alone each cycle. ``on_partial(PartialStep)`` runs after each partial verification (fidelity
    probes); ``on_full(committed [1, F], full_cache)`` after each full pass (tests)."""
    cfg.validate()
    pv.validate()
    if (drafter is None) != (cfg.mode == "ar"):
        raise ValueError(
            f"mode={cfg.mode!r} with drafter={getattr(drafter, 'name', drafter)!r}: partial verification takes "
            "a drafter with mode chain/tree, or none with mode ar (the root alone each cycle)."
        )
    with small_batch_linear(target.model, drafter, enabled=cfg.small_batch_kernel):
        return _specpv(target, drafter, prompt_ids, cfg, pv, on_partial, on_full, prefill)


@torch.inference_mode()
def _specpv(
    target: Target, drafter: SessionFactory | None, prompt_ids, cfg, pv, on_partial, on_full, prefill
) -> SpecPVResult:
    """The loop: draft, then one full or partial pass per cycle; a strict rollback starts the cycle over."""
    cfg = replace(cfg, target_cache="dynamic")  # the partial cache is built from a DynamicCache's layers
    state = CycleState(target, prompt_ids, cfg, SpecPVResult)
    result = state.result
    if cfg.max_new_tokens == 0:
        return result
    session = drafter.new_session() if drafter is not None else None
    layers = tuple(session.hidden_layers) if session is not None else ()
    passes = _Passes(target.model, pv, state, state.prefill(layers, prefill), layers, session)
    while True:
        P = state.root
        check_only = False  # strict, at the end: only re-check the partially verified tokens
        if state.done or P + 1 >= state.max_context:
            if not (pv.strict and P > passes.F):
                if not state.done:
                    result.stop_reason = "context"
                break
            check_only = True
        cap = 0 if check_only else state.cap()  # drafts that can commit
        t_draft = time.perf_counter()
        tree = DraftTree()
        if cap > 0 and session is not None:
            full = passes.full
            view = TargetView(
                cache=full if P == passes.F else PendingView(full, passes.partial),
                hidden=state.hidden,
                rewritten_from=passes.rewritten_from,
            )
            tree = state.draft(session, view, cap)
            passes.rewritten_from = None  # the drafter has read the rewritten positions again
        t_verify = time.perf_counter()
        result.draft_s += t_verify - t_draft
        if check_only or passes.full_pass_due(P):
            verdict = passes.full_pass(tree, P, check_only)
            if passes.rolled_back:
                continue  # strict: generation goes on from the full model's token
            if check_only:  # strict, at the end: every partially verified token stood
                result.stop_reason = result.stop_reason if state.done else "context"
                break
            kind = "full"
        else:
            verdict = passes.partial_pass(tree, P, on_partial)
            kind = "partial"
        path, bonus = verdict
        if cap > 0 and session is not None:
            state.record(tree, path)
            result.cycle_kind.append(kind)
        state.commit([*(tree.tokens[i] for i in path), bonus])
        if kind == "full" and on_full is not None:
            on_full(state.committed[:, : passes.F].clone(), passes.full)
    result.verify_s = result.partial_s + result.full_s
    return state.finish()


class _Passes:
    """The two verification passes of one generation and strict mode's rollback (module docstring).

    ``full`` holds the exact K/V of positions ``0..F-1``; ``partial`` is the compact cache (None: the next pass
    is a full one); ``q_partial`` keeps, for strict mode at temperature > 0, the partial distribution each
    pending token ``F+1..P`` was drawn from."""

    def __init__(
        self,
        model,
        pv: SpecPVConfig,
        state: CycleState,
        full: DynamicCache,
        layers,
        session: DraftSession | None,
    ):
        self.model, self.pv, self.state, self.full, self.layers = model, pv, state, full, layers
        self.d2t = session.d2t if session is not None else None
        self.F = state.prompt_len
        self.partial: PartialKVCache | None = None
        self.q_partial: list[Tensor] = []
        self.rewritten_from: int | None = (
            None  # first position a full pass re-fed since the drafter last drafted
        )
        self.rolled_back = False
        self.mask_dtype = next(model.parameters()).dtype
        self.all_layers = range(model.config.num_hidden_layers)

    def full_pass_due(self, P: int) -> bool:
        """At the start and after a rollback (no compact cache), once ``full_every`` tokens are pending, and
        whenever the context fits the budget."""
        fits = P + 1 <= self.pv.budget and not self.pv.always_partial
        return self.partial is None or P - self.F >= self.pv.full_every or fits

    def full_pass(self, tree: DraftTree, P: int, check_only: bool) -> tuple[list[int], int] | None:
        """Re-feed the pending tokens ``F..P-1`` with the root and the drafts against the full cache, so that they
        get exact K/V, and verify the drafts on exact logits; then rebuild the compact cache, its blocks scored
        with the drafts' queries. Strict: first re-check the pending tokens, and roll back at the first
        mismatch. Returns the accepted path and the bonus, or None after a rollback or a final check."""
        state, result, pv, dev = self.state, self.state.result, self.pv, self.state.ids.device
        t_verify = time.perf_counter()
        F, n_pend = self.F, P - self.F
        if n_pend:  # re-fed: their exact K/V replace the partial pass's, which a drafter may have read
            self.rewritten_from = F if self.rewritten_from is None else min(self.rewritten_from, F)
        block, positions, mask = full_block(F, state.committed[:, F : P + 1], tree, self.mask_dtype, dev)
        refresh = not check_only and (P + 1 > pv.budget or pv.always_partial)
        with capture(
            self.model, self.all_layers if refresh else [], hidden=False, kv=False, queries=refresh
        ) as rec:
            out = forward(self.model, block, self.full, positions, mask, hidden_states=bool(self.layers))
        result.n_full += 1
        result.refed_tokens += n_pend
        rows = out.logits[0]  # [n_pend + 1 + N, V]
        self.rolled_back = False
        if pv.strict:
            bad = first_mismatch(
                rows[:n_pend], state.committed[0, F + 1 : P + 1], self.q_partial, state.cfg, state.gen
            )
            if bad is not None:
                self._roll_back(out, n_pend, *bad)
                result.full_s += time.perf_counter() - t_verify
                return None
        if check_only:
            result.full_s += time.perf_counter() - t_verify
            return None
        path, bonus = verify_tree(tree, rows[n_pend:], state.cfg, state.gen, self.d2t, result)
        keep = [*range(n_pend + 1), *(n_pend + 1 + i for i in path)]
        keep_block_positions(self.full, F, keep)
        state.keep_hidden(out.hidden_states, self.layers, keep, replace=True)
        self.F, self.q_partial = P + 1 + len(path), []
        t_refresh = time.perf_counter()
        result.full_s += t_refresh - t_verify
        if refresh:
            queries = {li: rec.queries_at(li)[:, :, n_pend:] for li in self.all_layers}  # root + drafts rows
            self.partial = self.partial or PartialKVCache(pv)
            self.partial.refresh(self.full, queries, self.model.config)
        else:
            self.partial = None
        result.refresh_s += time.perf_counter() - t_refresh
        return path, bonus

    def _roll_back(self, out, n_pend: int, k: int, token: int) -> None:
        """Strict: the pending token ``F+1+k`` is wrong. Keep the exact K/V of ``F..F+k``, drop the output from
        there and commit the full model's ``token`` in its place; the next pass is a full one."""
        state, F = self.state, self.F
        keep_block_positions(self.full, F, list(range(k + 1)))
        state.keep_hidden(out.hidden_states, self.layers, list(range(k + 1)), replace=True)
        state.result.rollbacks.append(n_pend - k)
        state.roll_back(F + 1 + k)
        state.commit([token])
        self.F, self.partial, self.q_partial, self.rolled_back = F + k + 1, None, [], True

    def partial_pass(self, tree: DraftTree, P: int, on_partial) -> tuple[list[int], int]:
        """Verify the root and the drafts against the compact cache (sinks, retrieved blocks, window, buffer),
        with their true positions and an explicit tree mask; the accepted K/V join the buffer."""
        state, result, dev = self.state, self.state.result, self.state.ids.device
        t_verify = time.perf_counter()
        cfg, partial = state.cfg, self.partial
        block = torch.tensor([[result.token_ids[-1], *tree.tokens]], device=dev)  # [1, N+1]
        positions = torch.tensor([[P, *(P + 1 + d for d in tree.depths)]], device=dev)  # [1, N+1]
        past = partial.cache.get_seq_length()
        mask = partial.mask(ancestor_matrix(tree.parents), self.mask_dtype, dev)  # [1, 1, N+1, past+N+1]
        with compact_attention_mode(self.model):
            hidden = bool(self.layers) or on_partial is not None
            out = forward(self.model, block, partial.cache, positions, mask, hidden_states=hidden)
        result.n_partial += 1
        rows = out.logits[0]  # [N+1, V]
        path, bonus = verify_tree(tree, rows, cfg, state.gen, self.d2t, result)
        keep = [0, *(i + 1 for i in path)]
        if self.pv.strict and cfg.temperature > 0:
            self.q_partial += list(logits_to_probs(rows[keep], cfg.temperature, cfg.top_k, cfg.top_p))
        result.partial_s += time.perf_counter() - t_verify
        if on_partial is not None:
            ids_all = torch.cat([state.committed[:, self.F : P], block], 1)
            on_partial(
                PartialStep(
                    self.model, self.full, self.F, ids_all, tree, rows, out.hidden_states[-1][0], path
                )
            )
        t_keep = time.perf_counter()
        keep_block_positions(partial.cache, past, keep)
        state.keep_hidden(out.hidden_states, self.layers, keep)
        result.partial_s += time.perf_counter() - t_keep
        return path, bonus
