"""What a decoding loop carries from cycle to cycle, and the steps every loop shares.

* a :class:`Prefill` is a prompt run through the target once; a generation starts from it or from a private
  copy of a shared one (the long-context benchmarks prefill each prompt once for every method);
* a :class:`CycleState` carries a generation from one *cycle* to the next: the output so far, the committed
  tokens, the stop tokens, the target's hidden states the drafter has not seen yet. It drafts a cycle
  (:func:`draft_cycle`), records it, keeps the verified block's hidden states and commits the new tokens.

Plain speculative decoding (:mod:`.engine`), SpecPV (:mod:`.specpv`) and the greedy replay of
:mod:`kvshot_lib.evaluation.acceptance` all run their cycles on a :class:`CycleState`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache

from ..drafters.base import DraftSession, TargetView
from ..drafters.baselines import NgramDrafter
from ..target import Target
from ..target.forward import clone_cache, forward, new_cache, prepare_graphs
from ..target.graphs import width_for
from ..target.static_cache import StaticKVCache, static_cache_for
from .config import DecodeConfig, GenerationResult
from .device_draft import device_chain, device_tree
from .proposal import add_lookup, chosen_chain, chosen_tree, lookup_chain, select_by_value
from .tree import DraftTree, draft_chain, draft_dynamic_tree
from .verify import choose_token


def check_prompt(prompt_ids, max_context: int) -> Tensor:
    """The prompt as ``[1, T]`` ids; refused when empty or when it fills the target's context."""
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(1, -1)  # [1, T]
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty; give at least one token.")
    if ids.shape[1] >= max_context:
        raise ValueError(f"the prompt has {ids.shape[1]} tokens but the target's context is {max_context}.")
    return ids


def stop_tokens(cfg: DecodeConfig | None, info) -> tuple[int, ...]:
    """The tokens that end a generation, in order: ``cfg.stop_token_ids`` if given, else the target's EOS ids."""
    given = cfg.stop_token_ids if cfg is not None else None
    return tuple(given if given is not None else info.eos_token_ids)


def keep_block_positions(cache, start: int, keep: list[int]) -> None:
    """Keep the block entries ``start + keep[i]`` at ``start + i`` in every layer, then crop the rest."""
    n_keep, total = len(keep), cache.get_seq_length()
    if keep != list(range(n_keep)):
        src = torch.tensor(keep, device=cache.layers[0].keys.device) + start  # [n_keep]
        for layer in cache.layers:
            layer.keys[:, :, start : start + n_keep] = layer.keys[:, :, src]  # [B, kvH, n_keep, D]
            layer.values[:, :, start : start + n_keep] = layer.values[:, :, src]
    if total > start + n_keep:
        cache.crop(-(total - start - n_keep))


@dataclass
class Prefill:
    """A prompt run through the target once: its cache, the logits at its last position and the hidden
    states of some layers. A generation starts from a private :meth:`copy`, so several generations of the same
    prompt (the long-context benchmarks) share one; ``seconds`` is charged to each generation's ``prefill_s``
    and ``total_s`` as if it had run there."""

    ids: Tensor  # [1, T]
    cache: DynamicCache
    logits: Tensor  # [V] at the last prompt position
    hidden: dict[int, Tensor]  # layer -> [1, T, H]
    seconds: float

    @classmethod
    @torch.inference_mode()
    def run(
        cls,
        target: Target,
        prompt_ids,
        layers=(),
        store: dict | None = None,
        cache: StaticKVCache | None = None,
    ) -> Prefill:
        """Run ``prompt_ids`` through the target, keeping the hidden states of ``layers``. ``store``: a dict
        that keeps prefills by prompt and layers, so that a prompt seen before is not run again. ``cache``: an
        empty static cache to fill (else a new ``DynamicCache``); such a prefill is one generation's own."""
        key = (tuple(torch.as_tensor(prompt_ids).reshape(-1).tolist()), tuple(layers))
        if store is not None and key in store and cache is None:
            return store[key]
        model = target.model
        ids = check_prompt(prompt_ids, target.info.max_context).to(model.device)
        t0 = time.perf_counter()
        cache = new_cache(model) if cache is None else cache
        out = forward(model, ids, cache, logits_to_keep=1, hidden_states=bool(layers))
        hidden = {layer: out.hidden_states[layer + 1] for layer in layers}  # [1, T, H] each
        pre = cls(ids, cache, out.logits[0, -1], hidden, time.perf_counter() - t0)
        if store is not None and not isinstance(cache, StaticKVCache):
            store[key] = pre
        return pre

    def copy(self, ids: Tensor, layers: tuple[int, ...], config) -> Prefill:
        """A private copy of the cache for one generation of the prompt ``ids [1, T]``, with the hidden
        states of ``layers``; refused if it was computed for another prompt or without those layers."""
        if not torch.equal(self.ids.to(ids.device), ids):
            raise ValueError("the shared prefill was computed for another prompt; prefill this prompt first.")
        missing = [layer for layer in layers if layer not in self.hidden]
        if missing:
            raise ValueError(
                f"the shared prefill lacks the hidden states of layers {missing}; prefill with them."
            )
        cache = clone_cache(self.cache, config)
        return Prefill(
            self.ids, cache, self.logits, {layer: self.hidden[layer] for layer in layers}, self.seconds
        )


class CycleState:
    """What a decoding loop carries from one cycle to the next (batch size 1).

    * ``result``: the output so far and everything counted (a :class:`~.config.GenerationResult` or a subclass);
    * ``committed [1, T + max_new_tokens]``: the prompt and the committed tokens, ``root + 1`` of them so far;
    * ``hidden``: layer -> ``[1, n, H]``, the target's hidden states of the committed positions that the
      drafter has not seen yet (handed over by :meth:`draft`);
    * ``done``: a stop token or ``max_new_tokens`` was reached.

    The *root*, the last committed token, is not in the target's cache yet: it sits at position ``root``.
    """

    def __init__(self, target: Target, prompt_ids, cfg: DecodeConfig, result_type=GenerationResult):
        self.target, self.cfg, self.max_context = target, cfg, target.info.max_context
        self.ids = check_prompt(prompt_ids, self.max_context).to(target.model.device)  # [1, T]
        self.prompt_len = T = self.ids.shape[1]
        self.stops = set(stop_tokens(cfg, target.info))
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.result = result_type([], T, "max_new_tokens")
        self.committed = torch.empty(1, T + cfg.max_new_tokens, dtype=torch.long, device=self.ids.device)
        self.committed[:, :T] = self.ids
        self.hidden: dict[int, Tensor] = {}
        self.done = False
        self.lookup = NgramDrafter(target.info.vocab_size).new_session() if cfg.lookup else None
        self.t0 = time.perf_counter()

    def prefill(self, layers: tuple[int, ...], shared: Prefill | None = None) -> DynamicCache | StaticKVCache:
        """Run the prompt (or copy a ``shared`` prefill of it) and commit the target's first token; returns
        the target's cache, which then holds the prompt: a static one where ``cfg.target_cache`` says so, sized
        for the prompt, every new token and the widest block (padded as its graph is)."""
        model = self.target.model
        static = None
        if self.cfg.static_cache(model.device):
            need = self.prompt_len + self.cfg.max_new_tokens + width_for(self.cfg.widest_block())
            static = static_cache_for(model, need, self.cfg.compile_target)
        if shared is not None:
            pre = shared.copy(self.ids, layers, model.config)
            if static is not None:
                static.load(pre.cache)
                pre.cache = static
        else:
            pre = Prefill.run(self.target, self.ids, layers, cache=static)
        if static is not None:  # on a GPU: every width's graph now, not in the middle of the generation
            prepare_graphs(model, static, self.cfg.widest_block(), bool(layers))
        self.result.prefill_s, self.hidden = pre.seconds, pre.hidden
        self.t0 = time.perf_counter() - pre.seconds
        self.commit([choose_token(pre.logits, self.cfg, self.gen)])
        return pre.cache

    @property
    def root(self) -> int:
        """The root's position: the number of positions in the target's cache."""
        return self.prompt_len + len(self.result.token_ids) - 1

    def out_of_context(self) -> bool:
        """True (and the stop reason set) when the target's context has no room for another position."""
        if self.root + 1 >= self.max_context:
            self.result.stop_reason = "context"
            return True
        return False

    def cap(self) -> int:
        """How many drafts this cycle can commit: room in ``max_new_tokens`` and in the context, less the bonus."""
        P = self.root
        return min(self.cfg.max_new_tokens - len(self.result.token_ids), self.max_context - P - 1) - 1

    def draft(self, session: DraftSession, view: TargetView, cap: int, stop_after=None) -> DraftTree:
        """This cycle's drafts below the root (:func:`draft_cycle`); ``view``'s hidden states count as handed over."""
        tree = draft_cycle(
            session,
            self.cfg,
            self.committed[:, : self.root + 1],
            view,
            cap,
            self.gen,
            stop_after,
            self.lookup,
        )
        session.end_cycle()
        self.hidden = {}
        return tree

    def record(self, tree: DraftTree, path: list[int]) -> None:
        """Count a drafting cycle: the drafts it accepted and the nodes it verified."""
        self.result.accepted_per_cycle.append(len(path))
        self.result.drafted_per_cycle.append(len(tree))

    def keep_hidden(
        self, hidden_states, layers: tuple[int, ...], keep: list[int], replace: bool = False
    ) -> None:
        """Add the target's hidden states of the kept block rows ``keep`` (``hidden_states``: a forward's
        ``out.hidden_states``) to those the drafter has not seen, or ``replace`` them."""
        if not layers:
            return
        idx = torch.tensor(keep, device=self.ids.device)
        fresh = {layer: hidden_states[layer + 1].index_select(1, idx) for layer in layers}  # [1, n, H]
        if self.hidden and not replace:
            fresh = {layer: torch.cat([self.hidden[layer], fresh[layer]], 1) for layer in layers}
        self.hidden = fresh

    def commit(self, new: list[int]) -> bool:
        """Append ``new`` to the output up to and including the first stop token, and to ``committed``;
        returns (and keeps in ``done``) whether generation has ended."""
        result, start = self.result, self.prompt_len + len(self.result.token_ids)
        for t in new:
            result.token_ids.append(t)
            if t in self.stops:
                result.stop_reason, self.done = "stop_token", True
                break
            if len(result.token_ids) >= self.cfg.max_new_tokens:
                result.stop_reason, self.done = "max_new_tokens", True
                break
        n_in = self.prompt_len + len(result.token_ids) - start  # the tokens that made it into the output
        self.committed[0, start : start + n_in] = torch.tensor(new[:n_in], device=self.ids.device)
        return self.done

    def roll_back(self, position: int) -> None:
        """Forget the output from ``position`` on (strict SpecPV); the next commit writes there."""
        del self.result.token_ids[position - self.prompt_len :]
        self.result.stop_reason, self.done = "max_new_tokens", False

    def finish(self) -> GenerationResult:
        self.result.total_s = time.perf_counter() - self.t0
        return self.result


def draft_cycle(
    session: DraftSession,
    cfg: DecodeConfig,
    committed: Tensor,
    view: TargetView,
    cap: int,
    gen,
    stop_after=None,
    lookup: DraftSession | None = None,
) -> DraftTree:
    """One cycle's drafts: a chain or a dynamic tree of at most ``cap`` tokens below the root ``committed[-1]``,
    of fixed size or chosen by expected speed (``cfg.shape``), with prompt lookup's continuation merged in when
    ``lookup`` (an n-gram session) is given. ``stop_after(step, token)``: a fixed chain stops drafting when it
    returns True (the greedy replay's shortcut)."""
    T, k, p = cfg.temperature, cfg.top_k, cfg.top_p
    if cfg.shape == "chosen":
        if cfg.mode == "chain":
            tree, spent = chosen_chain(
                session, committed, view, min(cfg.chain_depth, cap), cfg.speed, T, k, p, gen
            )
        else:
            tree, spent = chosen_tree(
                session, committed, view, min(cfg.tree_depth, cap), cfg.tree_top_k, cfg.speed, T, k, p
            )
        if lookup is not None:
            tree = add_lookup(tree, *lookup_chain(lookup, committed, min(cfg.lookup_tokens, cap)), cfg.speed)
        elif cfg.mode == "chain" and T > 0:
            return (
                tree  # a sampled chain keeps its drafts: a cut by their own confidences would bias the rule
            )
        budget = cfg.chain_depth if cfg.mode == "chain" and lookup is None else cfg.tree_budget
        return select_by_value(tree, spent, cfg.speed, budget)
    device = cfg.device_draft(committed.device) and stop_after is None
    tree = None
    if cfg.mode == "chain":
        depth = min(cfg.chain_depth, cap)
        if device:
            tree = device_chain(session, committed, view, cfg.chain_depth, cap)
        if tree is None:
            tree = draft_chain(session, committed, view, depth, T, k, p, gen, stop_after)
    else:
        depth = min(cfg.tree_depth, cap)
        if device:
            tree = device_tree(session, committed, view, cfg.tree_depth, cfg.tree_top_k, cfg.tree_budget, cap)
        if tree is None:
            tree = draft_dynamic_tree(
                session, committed, view, depth, cfg.tree_top_k, cfg.tree_budget, T, k, p
            )
    if lookup is not None:
        tree = add_lookup(tree, *lookup_chain(lookup, committed, min(cfg.lookup_tokens, cap)), None)
    return tree
