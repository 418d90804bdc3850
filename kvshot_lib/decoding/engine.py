"""The lossless decoding engine: plain autoregressive decoding, chain drafting and EAGLE-2 tree drafting.

One *cycle* of speculative decoding (batch size 1):

1. the drafter drafts a chain or a tree after the *root*, the last committed token (not yet in the
   target's cache);
2. the target scores the root and every draft node in one forward, with a tree attention mask and
   explicit position ids (root at position P, a node at depth d at P + 1 + d);
3. verification walks down from the root:
   - temperature 0: descend to the child equal to the target's argmax;
   - chain sampled at temperature > 0: the rejection rule of :mod:`kvshot_lib.sampling`;
   - tree at temperature > 0: sample the target's token and descend if a child drafted it (draft
     children are chosen by top-k, not sampled, so this is the lossless rule for them);
   the target's choice at the last node reached is the *bonus* token;
4. the accepted path's K/V are moved into place and the rest of the block is cropped, so the cache
   holds exactly the committed tokens; stop tokens end generation at that token.

Every cycle records the accepted drafts and, for each draft step, whether it was attempted and
accepted (:class:`GenerationResult`); wall time is split into prefill, draft and verify.
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
from .kernels import small_batch_linear
from .sampling import accept_draft_tokens, check_sampling_args, logits_to_probs, residual_probs, sample
from .tree import DraftTree, draft_chain, draft_dynamic_tree

MODES = ("ar", "chain", "tree")


@dataclass
class DecodeConfig:
    """How to decode. ``chain_depth`` is k, the number of drafted tokens per chain cycle; the tree has
    ``tree_depth`` levels, ``tree_top_k`` children per expanded node and ``tree_budget`` nodes."""

    mode: str = "chain"
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    chain_depth: int = 4
    tree_depth: int = 6
    tree_top_k: int = 4
    tree_budget: int = 24
    stop_token_ids: tuple[int, ...] | None = None  # None: the target's EOS ids
    seed: int = 0
    small_batch_kernel: bool = True  # CPU: a faster matmul for 2-8-token blocks (kvshot_lib.linear_kernels)

    def validate(self) -> DecodeConfig:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}.")
        check_sampling_args(self.temperature, self.top_k, self.top_p)
        for name in ("max_new_tokens", "chain_depth", "tree_depth", "tree_top_k", "tree_budget"):
            value = getattr(self, name)
            if (
                not isinstance(value, int)
                or isinstance(value, bool)
                or value < (0 if name == "max_new_tokens" else 1)
            ):
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        return self


@dataclass
class GenerationResult:
    """One generation: the new tokens and everything measured along the way."""

    token_ids: list[int]  # generated tokens; a stop token, if hit, is the last one
    prompt_len: int
    stop_reason: str  # "stop_token" | "max_new_tokens" | "context"
    accepted_per_cycle: list[int] = field(default_factory=list)  # drafts accepted per cycle (bonus excluded)
    drafted_per_cycle: list[int] = field(default_factory=list)  # draft nodes verified per cycle
    step_attempts: list[int] = field(default_factory=list)  # [k] cycles that reached draft step k
    step_accepts: list[int] = field(default_factory=list)  # [k] ... and accepted it
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    @property
    def n_cycles(self) -> int:
        return len(self.accepted_per_cycle)

    @property
    def tokens_per_s(self) -> float:
        """End to end: new tokens over wall time, prefill included."""
        return len(self.token_ids) / self.total_s if self.total_s > 0 else float("nan")

    @property
    def mat(self) -> float:
        """Mean accepted tokens per cycle, the bonus token included (tau)."""
        n = self.n_cycles
        return (sum(self.accepted_per_cycle) + n) / n if n else float("nan")


def _count_step(result: GenerationResult, step: int, accepted: bool) -> None:
    while len(result.step_attempts) <= step:
        result.step_attempts.append(0)
        result.step_accepts.append(0)
    result.step_attempts[step] += 1
    result.step_accepts[step] += int(accepted)


def _check_prompt(prompt_ids, max_context: int) -> Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(1, -1)  # [1, T]
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty; give at least one token.")
    if ids.shape[1] >= max_context:
        raise ValueError(f"the prompt has {ids.shape[1]} tokens but the target's context is {max_context}.")
    return ids


def _choose(logits: Tensor, cfg: DecodeConfig, gen: torch.Generator) -> int:
    """The target's own pick from ``logits [V]``: argmax, or a sample of its processed distribution."""
    if cfg.temperature == 0:
        return int(logits.argmax())
    return int(sample(logits_to_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p), gen))


def _commit(result: GenerationResult, new: list[int], stops: set[int], cfg: DecodeConfig) -> bool:
    """Append tokens to the output up to and including the first stop token; True when generation ends."""
    for t in new:
        result.token_ids.append(t)
        if t in stops:
            result.stop_reason = "stop_token"
            return True
        if len(result.token_ids) >= cfg.max_new_tokens:
            result.stop_reason = "max_new_tokens"
            return True
    return False


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
    """A prompt already run through the target, to share between generations of the same prompt (the
    long-context benchmarks): each generation starts from a copy of ``cache``. ``seconds`` is charged to
    every generation's ``prefill_s`` and ``total_s`` as if it had run there."""

    ids: Tensor  # [1, T]
    cache: DynamicCache
    logits: Tensor  # [V] at the last prompt position
    hidden: dict[int, Tensor]  # layer -> [1, T, H]
    seconds: float


@torch.inference_mode()
def prefill_prompt(target, prompt_ids, layers=()) -> Prefill:
    """Run ``prompt_ids`` through the target once, keeping the hidden states of ``layers``."""
    model = target.model
    ids = _check_prompt(prompt_ids, target.info.max_context).to(model.device)
    t0 = time.perf_counter()
    cache = DynamicCache(config=model.config)
    logits, hidden = _prefill(model, ids, cache, tuple(layers))
    return Prefill(ids, cache, logits, hidden, time.perf_counter() - t0)


def take_prefill(
    pre: Prefill, ids: Tensor, layers: tuple[int, ...], config
) -> tuple[DynamicCache, Tensor, dict]:
    """A private copy of ``pre``'s cache, its logits and the hidden states of ``layers``, checked against
    the prompt ``ids [1, T]`` of the generation that uses it."""
    if not torch.equal(pre.ids.to(ids.device), ids):
        raise ValueError("the shared prefill was computed for another prompt; prefill this prompt first.")
    missing = [layer for layer in layers if layer not in pre.hidden]
    if missing:
        raise ValueError(
            f"the shared prefill lacks the hidden states of layers {missing}; prefill with them."
        )
    cache = DynamicCache(config=config)
    for i, layer in enumerate(pre.cache.layers):
        cache.update(layer.keys, layer.values, i)  # concatenation onto an empty layer: a copy
    return cache, pre.logits, {layer: pre.hidden[layer] for layer in layers}


def start_prompt(
    model, ids: Tensor, layers: tuple[int, ...], prefill: Prefill | None = None
) -> tuple[DynamicCache, Tensor, dict, float]:
    """A generation's start: the prompt's cache, its last logits, the hidden states of ``layers`` and the
    prefill's seconds; from a private copy of a shared :class:`Prefill` of ``ids``, or by running it."""
    if prefill is not None:
        cache, logits, hidden = take_prefill(prefill, ids, layers, model.config)
        return cache, logits, hidden, prefill.seconds
    t0 = time.perf_counter()
    cache = DynamicCache(config=model.config)
    logits, hidden = _prefill(model, ids, cache, layers)
    return cache, logits, hidden, time.perf_counter() - t0


def _prefill(model, ids: Tensor, cache, layers: tuple[int, ...]):
    out = model(
        input_ids=ids,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
        output_hidden_states=bool(layers),
    )
    hidden = {layer: out.hidden_states[layer + 1] for layer in layers}  # [1, T, H] each
    return out.logits[0, -1], hidden


@torch.inference_mode()
def autoregressive_generate(
    target, prompt_ids, cfg: DecodeConfig, prefill: Prefill | None = None
) -> GenerationResult:
    """The baseline: one target forward per token on a KV cache (argmax, or a sample at temperature > 0).
    ``prefill``: start from a copy of a shared :class:`Prefill` of this prompt instead of running it."""
    cfg.validate()
    model, max_ctx = target.model, target.info.max_context
    ids = _check_prompt(prompt_ids, max_ctx).to(model.device)
    stops = set(cfg.stop_token_ids if cfg.stop_token_ids is not None else target.info.eos_token_ids)
    gen = torch.Generator().manual_seed(cfg.seed)
    result = GenerationResult([], ids.shape[1], "max_new_tokens")
    if cfg.max_new_tokens > 0:
        cache, logits, _, result.prefill_s = start_prompt(model, ids, (), prefill)
        t0 = time.perf_counter() - result.prefill_s
        done = _commit(result, [_choose(logits, cfg, gen)], stops, cfg)
        pos = ids.shape[1]
        tok = torch.empty(1, 1, dtype=torch.long, device=model.device)
        while not done:
            if pos + 1 >= max_ctx:
                result.stop_reason = "context"
                break
            tok[0, 0] = result.token_ids[-1]
            out = model(
                input_ids=tok,
                past_key_values=cache,
                use_cache=True,
                position_ids=torch.tensor([[pos]], device=model.device),
            )
            pos += 1
            done = _commit(result, [_choose(out.logits[0, -1], cfg, gen)], stops, cfg)
        result.total_s = time.perf_counter() - t0
        result.verify_s = result.total_s - result.prefill_s
    return result


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


def _verify(tree: DraftTree, logits: Tensor, cfg: DecodeConfig, gen, d2t, result) -> tuple[list[int], int]:
    """Accepted path and bonus from the target's ``logits [N+1, V]`` over the verified block."""
    if cfg.temperature == 0:
        choice = logits.argmax(-1).tolist()
        return walk_tree(tree, choice.__getitem__, result)
    if tree.q and tree.is_chain():
        p = logits_to_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)  # [n+1, V]
        return verify_sampled_chain(tree, p, d2t, gen, result)
    return walk_tree(tree, lambda b: _choose(logits[b], cfg, gen), result)


def draft_cycle(session, cfg: DecodeConfig, committed: Tensor, view, cap: int, gen) -> DraftTree:
    """One cycle's drafts: a chain or a dynamic tree of at most ``cap`` tokens below the root ``committed[-1]``."""
    if cfg.mode == "chain":
        depth = min(cfg.chain_depth, cap)
        return draft_chain(session, committed, view, depth, cfg.temperature, cfg.top_k, cfg.top_p, gen)
    return draft_dynamic_tree(
        session,
        committed,
        view,
        min(cfg.tree_depth, cap),
        cfg.tree_top_k,
        cfg.tree_budget,
        cfg.temperature,
        cfg.top_k,
        cfg.top_p,
    )


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
    model, max_ctx, dev = target.model, target.info.max_context, target.model.device
    ids = _check_prompt(prompt_ids, max_ctx).to(dev)
    stops = set(cfg.stop_token_ids if cfg.stop_token_ids is not None else target.info.eos_token_ids)
    gen = torch.Generator().manual_seed(cfg.seed)
    result = GenerationResult([], ids.shape[1], "max_new_tokens")
    if cfg.max_new_tokens == 0:
        return result
    session = drafter.new_session()
    layers = tuple(session.hidden_layers)
    d2t = session.d2t
    cache, logits, pending, result.prefill_s = start_prompt(model, ids, layers, prefill)
    t0 = time.perf_counter() - result.prefill_s
    committed = torch.empty(1, ids.shape[1] + cfg.max_new_tokens, dtype=torch.long, device=dev)  # [1, T_max]
    committed[:, : ids.shape[1]] = ids
    done = _commit(result, [_choose(logits, cfg, gen)], stops, cfg)
    committed[0, ids.shape[1]] = result.token_ids[0]
    mask_dtype = next(model.parameters()).dtype
    while not done:
        P = ids.shape[1] + len(result.token_ids) - 1  # cached positions; the root sits at P
        if P + 1 >= max_ctx:
            result.stop_reason = "context"
            break
        cap = min(cfg.max_new_tokens - len(result.token_ids), max_ctx - P - 1) - 1  # drafts that can commit
        t_draft = time.perf_counter()
        tree = DraftTree()
        if cap > 0:
            view = TargetView(cache=cache, hidden=pending)
            tree = draft_cycle(session, cfg, committed[:, : P + 1], view, cap, gen)
            session.end_cycle()
            pending = {}
        t_verify = time.perf_counter()
        block = torch.tensor([[result.token_ids[-1], *tree.tokens]], device=dev)  # [1, N+1]
        positions = torch.tensor([[P, *(P + 1 + d for d in tree.depths)]], device=dev)  # [1, N+1]
        mask = (
            tree_attention_mask(ancestor_matrix(tree.parents), P, mask_dtype, dev) if len(tree) > 1 else None
        )
        out = model(
            input_ids=block,
            past_key_values=cache,
            position_ids=positions,
            attention_mask=mask,
            use_cache=True,
            output_hidden_states=bool(layers),
        )
        path, bonus = _verify(tree, out.logits[0], cfg, gen, d2t, result)
        keep = [0, *(i + 1 for i in path)]
        keep_block_positions(cache, P, keep)
        if layers:
            idx = torch.tensor(keep, device=dev)
            fresh = {
                layer: out.hidden_states[layer + 1].index_select(1, idx) for layer in layers
            }  # [1, n+1, H]
            pending = (
                {layer: torch.cat([pending[layer], fresh[layer]], 1) for layer in layers}
                if pending
                else fresh
            )
        if cap > 0:
            result.accepted_per_cycle.append(len(path))
            result.drafted_per_cycle.append(len(tree))
        new = [tree.tokens[i] for i in path] + [bonus]
        done = _commit(result, new, stops, cfg)
        if not done:
            committed[0, P + 1 : P + 1 + len(new)] = torch.tensor(new, device=dev)
        result.draft_s += t_verify - t_draft
        result.verify_s += time.perf_counter() - t_verify
        if on_cycle is not None and not done:
            on_cycle(committed[:, : P + 1 + len(path)].clone(), cache)
    result.total_s = time.perf_counter() - t0
    return result


def generate(
    target, prompt_ids, cfg: DecodeConfig, drafter=None, partial=None, prefill: Prefill | None = None
) -> GenerationResult:
    """Decode ``prompt_ids`` with ``cfg.mode``: ``"ar"`` needs no drafter; ``"chain"`` / ``"tree"`` need one.
    ``partial`` (a :class:`~kvshot_lib.decoding.specpv.SpecPVConfig`) verifies against a partial KV cache
    (SpecPV, :func:`~kvshot_lib.decoding.specpv.specpv_generate`); ``prefill`` shares a prompt's prefill."""
    cfg.validate()
    if partial is not None:
        from .specpv import specpv_generate  # the partial verifier builds on this engine

        return specpv_generate(target, drafter, prompt_ids, cfg, partial, prefill=prefill)
    if cfg.mode == "ar":
        return autoregressive_generate(target, prompt_ids, cfg, prefill)
    if drafter is None:
        raise ValueError(f"mode={cfg.mode!r} needs a drafter; use mode='ar' for plain decoding.")
    return speculative_generate(target, drafter, prompt_ids, cfg, prefill=prefill)
