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
3. **full verification** when the pending tokens reach ``full_every`` (P), at the start, after a
   rollback, and whenever the context fits the budget: the pending tokens are *re-fed* with the root and
   the drafts against the full cache, so they get exact K/V; the drafts are verified on exact logits; the
   partial cache is rebuilt from the full one, its blocks scored with the drafts' queries;
4. modes. ``specpv`` (the paper): partially verified tokens are final. ``strict``: at each full pass the
   pending tokens chosen on partial logits are re-checked against the full logits (argmax at
   temperature 0; at temperature > 0 the rejection rule with the partial distribution as the proposal),
   and generation rolls back to the first mismatch and continues from the full model's token; output
   ending on unchecked tokens gets a last check first. So ``strict`` output is plain decoding's, token
   for token at temperature 0, at any budget (``tests/test_specpv.py``).

``full_every=0`` verifies fully every cycle: lossless speculative decoding. Phase times, the kind of each
cycle and every rollback are recorded in :class:`SpecPVResult`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import DynamicCache

from ..drafters.base import TargetView
from ..drafters.tree_mask import ancestor_matrix, tree_attention_mask
from ..target.capture import capture
from .engine import (
    DecodeConfig,
    GenerationResult,
    Prefill,
    _check_prompt,
    _choose,
    _commit,
    _verify,
    draft_cycle,
    keep_block_positions,
    start_prompt,
)
from .kernels import small_batch_linear
from .partial_kv import PartialKVCache, PartialKVConfig, compact_attention_mode
from .sampling import accept_draft_tokens, logits_to_probs, residual_probs, sample
from .tree import DraftTree

VERIFY_MODES = ("specpv", "strict")


@dataclass
class SpecPVConfig(PartialKVConfig):
    """Partial verification: the cache geometry (:class:`~.partial_kv.PartialKVConfig`), a full pass once
    ``full_every`` tokens are pending (0: every cycle), and ``strict`` re-checking at each full pass.
    ``always_partial`` verifies partially even when the context fits the budget (tests)."""

    full_every: int = 16
    strict: bool = False
    always_partial: bool = False

    def validate(self) -> SpecPVConfig:
        super().validate()
        if not isinstance(self.full_every, int) or isinstance(self.full_every, bool) or self.full_every < 0:
            raise ValueError(
                f"full_every (P) must be a non-negative integer: a full pass once P tokens are pending "
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
    target,
    drafter,
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
def _specpv(target, drafter, prompt_ids, cfg, pv, on_partial, on_full, prefill) -> SpecPVResult:
    model, max_ctx, dev = target.model, target.info.max_context, target.model.device
    ids = _check_prompt(prompt_ids, max_ctx).to(dev)
    T = ids.shape[1]
    stops = set(cfg.stop_token_ids if cfg.stop_token_ids is not None else target.info.eos_token_ids)
    gen = torch.Generator().manual_seed(cfg.seed)
    result = SpecPVResult([], T, "max_new_tokens")
    if cfg.max_new_tokens == 0:
        return result
    session = drafter.new_session() if drafter is not None else None
    layers = tuple(session.hidden_layers) if session is not None else ()
    d2t = session.d2t if session is not None else None
    full, logits, hidden, result.prefill_s = start_prompt(model, ids, layers, prefill)
    t0 = time.perf_counter() - result.prefill_s
    committed = torch.empty(1, T + cfg.max_new_tokens, dtype=torch.long, device=dev)  # [1, T_max]
    committed[:, :T] = ids
    done = _commit(result, [_choose(logits, cfg, gen)], stops, cfg)
    committed[0, T] = result.token_ids[0]
    mask_dtype = next(model.parameters()).dtype
    all_layers = range(model.config.num_hidden_layers)
    partial: PartialKVCache | None = None  # None: the next pass is a full one
    F = T  # exact K/V in the full cache: positions 0..F-1
    q_partial: list[Tensor] = []  # strict, temperature > 0: the partial distribution of tokens F+1..P
    rewritten_from: int | None = None  # first position a full pass re-fed since the drafter last drafted
    while True:
        P = T + len(result.token_ids) - 1  # the root's position
        check_only = False
        if done or P + 1 >= max_ctx:
            if not (pv.strict and P > F):
                if not done:
                    result.stop_reason = "context"
                break
            check_only = True  # strict: check the partially verified tokens before ending
        fits = P + 1 <= pv.budget and not pv.always_partial
        use_full = check_only or partial is None or P - F >= pv.full_every or fits
        cap = 0 if check_only else min(cfg.max_new_tokens - len(result.token_ids), max_ctx - P - 1) - 1
        t_draft = time.perf_counter()
        tree = DraftTree()
        if cap > 0 and session is not None:
            cache = full if P == F else PendingView(full, partial)
            view = TargetView(cache=cache, hidden=hidden, rewritten_from=rewritten_from)
            tree = draft_cycle(session, cfg, committed[:, : P + 1], view, cap, gen)
            session.end_cycle()
            hidden, rewritten_from = {}, None
        t_verify = time.perf_counter()
        result.draft_s += t_verify - t_draft
        if use_full:
            n_pend = P - F
            if n_pend:  # re-fed: their exact K/V replace the partial pass's, which a drafter may have read
                rewritten_from = F if rewritten_from is None else min(rewritten_from, F)
            block, positions, mask = full_block(F, committed[:, F : P + 1], tree, mask_dtype, dev)
            refresh = not check_only and (P + 1 > pv.budget or pv.always_partial)
            with capture(
                model, all_layers if refresh else [], hidden=False, kv=False, queries=refresh
            ) as rec:
                out = model(
                    input_ids=block,
                    past_key_values=full,
                    position_ids=positions,
                    attention_mask=mask,
                    use_cache=True,
                    output_hidden_states=bool(layers),
                )
            result.n_full += 1
            result.refed_tokens += n_pend
            rows = out.logits[0]  # [n_pend + 1 + N, V]
            bad = (
                _first_mismatch(rows[:n_pend], committed[0, F + 1 : P + 1], q_partial, cfg, gen)
                if pv.strict
                else None
            )
            if (
                bad is not None
            ):  # strict: roll back to the first mismatch, continue from the full model's token
                k, token = bad
                keep_block_positions(full, F, list(range(k + 1)))
                hidden = {layer: out.hidden_states[layer + 1][:, : k + 1] for layer in layers}
                result.rollbacks.append(n_pend - k)
                del result.token_ids[F + 1 + k - T :]
                result.stop_reason = "max_new_tokens"
                done = _commit(result, [token], stops, cfg)
                committed[0, F + 1 + k] = token
                F, partial, q_partial = F + k + 1, None, []
                result.full_s += time.perf_counter() - t_verify
                continue
            if check_only:
                result.full_s += time.perf_counter() - t_verify
                result.stop_reason = result.stop_reason if done else "context"
                break
            path, bonus = _verify(tree, rows[n_pend:], cfg, gen, d2t, result)
            keep = [*range(n_pend + 1), *(n_pend + 1 + i for i in path)]
            keep_block_positions(full, F, keep)
            if layers:
                idx = torch.tensor(keep, device=dev)
                hidden = {layer: out.hidden_states[layer + 1].index_select(1, idx) for layer in layers}
            F, q_partial = P + 1 + len(path), []
            t_refresh = time.perf_counter()
            result.full_s += t_refresh - t_verify
            if refresh:
                queries = {li: rec.queries_at(li)[:, :, n_pend:] for li in all_layers}  # root + drafts rows
                partial = partial or PartialKVCache(pv)
                partial.refresh(full, queries, model.config)
            else:
                partial = None
            result.refresh_s += time.perf_counter() - t_refresh
            kind = "full"
        else:
            block = torch.tensor([[result.token_ids[-1], *tree.tokens]], device=dev)  # [1, N+1]
            positions = torch.tensor([[P, *(P + 1 + d for d in tree.depths)]], device=dev)  # [1, N+1]
            past = partial.cache.get_seq_length()
            mask = partial.mask(ancestor_matrix(tree.parents), mask_dtype, dev)  # [1, 1, N+1, past+N+1]
            with compact_attention_mode(model):
                out = model(
                    input_ids=block,
                    past_key_values=partial.cache,
                    position_ids=positions,
                    attention_mask=mask,
                    use_cache=True,
                    output_hidden_states=bool(layers) or on_partial is not None,
                )
            result.n_partial += 1
            rows = out.logits[0]  # [N+1, V]
            path, bonus = _verify(tree, rows, cfg, gen, d2t, result)
            keep = [0, *(i + 1 for i in path)]
            if pv.strict and cfg.temperature > 0:
                q_partial += list(logits_to_probs(rows[keep], cfg.temperature, cfg.top_k, cfg.top_p))
            result.partial_s += time.perf_counter() - t_verify
            if on_partial is not None:
                ids_all = torch.cat([committed[:, F:P], block], 1)
                on_partial(PartialStep(model, full, F, ids_all, tree, rows, out.hidden_states[-1][0], path))
            t_keep = time.perf_counter()
            keep_block_positions(partial.cache, past, keep)
            if layers:
                idx = torch.tensor(keep, device=dev)
                fresh = {layer: out.hidden_states[layer + 1].index_select(1, idx) for layer in layers}
                hidden = (
                    {layer: torch.cat([hidden[layer], fresh[layer]], 1) for layer in layers}
                    if hidden
                    else fresh
                )
            result.partial_s += time.perf_counter() - t_keep
            kind = "partial"
        if cap > 0 and session is not None:
            result.accepted_per_cycle.append(len(path))
            result.drafted_per_cycle.append(len(tree))
            result.cycle_kind.append(kind)
        new = [tree.tokens[i] for i in path] + [bonus]
        done = _commit(result, new, stops, cfg)
        n_in = min(len(new), T + len(result.token_ids) - (P + 1))  # tokens that made it into the output
        committed[0, P + 1 : P + 1 + n_in] = torch.tensor(new[:n_in], device=dev)
        if kind == "full" and on_full is not None:
            on_full(committed[:, :F].clone(), full)
    result.verify_s = result.partial_s + result.full_s
    result.total_s = time.perf_counter() - t0
    return result


def _first_mismatch(rows: Tensor, tokens: Tensor, q_partial: list[Tensor], cfg: DecodeConfig, gen):
    """Strict mode: ``(k, token)`` for the first pending token ``tokens[k]`` that the full model's logits
    ``rows[k]`` reject, with the full model's replacement; None when all stand. Greedy: the argmax must
    match. Sampling: ``tokens[k]`` was drawn from the partial distribution ``q_partial[k]``, so the rejection
    rule with proposal q and target p = full keeps the output distributed as the full model's."""
    if rows.shape[0] == 0:
        return None
    if cfg.temperature == 0:
        want = rows.argmax(-1)  # [n]
        wrong = (want != tokens).nonzero()
        return None if len(wrong) == 0 else (int(wrong[0]), int(want[wrong[0]]))
    p = logits_to_probs(rows, cfg.temperature, cfg.top_k, cfg.top_p)  # [n, V]
    q = torch.stack(q_partial[: rows.shape[0]]).to(p.device)  # [n, V]
    ok = accept_draft_tokens(p, q, tokens, gen).tolist()
    if all(ok):
        return None
    k = ok.index(False)
    return k, int(sample(residual_probs(p[k], q[k]), gen))
