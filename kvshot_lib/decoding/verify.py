"""Verification: which drafts the target accepts, and the token it adds after them (the *bonus*).

The target scores the root (the last committed token) and every draft node in one forward; verification then
walks down from the root (:func:`verify_tree`):

* temperature 0: descend to the child equal to the target's argmax (:func:`walk_tree`);
* a chain sampled at temperature > 0: the rejection rule (Leviathan et al. 2023; Chen et al. 2023) for each
  draft ``x ~ q`` in turn: accept ``x`` with probability ``min(1, p(x) / q(x))``, otherwise emit a token from
  the residual ``norm(max(0, p - q))`` and stop (:func:`first_rejection`). The emitted token is then
  distributed exactly as ``p``, and the acceptance probability is ``sum_v min(p(v), q(v))``
  (``tests/test_sampling.py`` checks both with chi-square tests);
* a tree at temperature > 0: sample the target's token (:func:`choose_token`) and descend if a child drafted it
  (draft children are chosen by top-k, not sampled, so this is the lossless rule for them);

the target's choice at the last node reached is the bonus token. SpecPV's strict mode re-checks the tokens chosen
on partial logits against the full ones with the same two rules (:func:`first_mismatch`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .config import DecodeConfig, GenerationResult
from .sampling import logits_to_probs, sample, uniform
from .tree import DraftTree


def choose_token(logits: Tensor, cfg: DecodeConfig, gen: torch.Generator) -> int:
    """The target's own pick from ``logits [V]``: argmax, or a sample of its processed distribution."""
    if cfg.temperature == 0:
        return int(logits.argmax())
    return int(sample(logits_to_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p), gen))


def accept_draft_tokens(p: Tensor, q: Tensor, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """The accept test of the rejection rule, row by row: ``[n]`` bool.

    p, q: ``[n, V]`` target and draft probabilities; x: ``[n]`` draft tokens, each sampled from its row of q.
    Row i is accepted with probability ``min(1, p[i, x_i] / q[i, x_i])``: draw u ~ U[0, 1) and accept iff
    ``u * q(x) < p(x)`` (never accepts a token the target gives probability 0).
    """
    px = p.gather(-1, x[:, None])[:, 0]  # [n]
    qx = q.gather(-1, x[:, None])[:, 0]  # [n]
    u = uniform(px.shape, generator, px.dtype, px.device)  # [n]
    return u * qx < px


def residual_probs(p: Tensor, q: Tensor) -> Tensor:
    """``norm(max(0, p - q))`` row by row, ``[..., V]``; falls back to ``p`` where ``p == q`` (rejection is then
    impossible anyway, up to rounding)."""
    r = (p - q).clamp_min(0)  # [..., V]
    total = r.sum(-1, keepdim=True)  # [..., 1]
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(r.dtype).tiny), p)


def rejection_sample(
    p: Tensor, q: Tensor, x: Tensor, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """The full rule on independent rows: ``(accepted [n] bool, emitted [n] int64)``.

    ``emitted[i]`` is ``x[i]`` when accepted, else a sample of the residual ``norm(max(0, p_i - q_i))``.
    Each ``emitted[i]`` is distributed as ``p[i]``. A chain applies the same two steps, the residual at its first
    rejection only (:func:`first_rejection`).
    """
    accepted = accept_draft_tokens(p, q, x, generator)  # [n]
    resampled = sample(residual_probs(p, q), generator)  # [n]
    return accepted, torch.where(accepted, x, resampled)


def first_rejection(p: Tensor, q: Tensor, x: Tensor, gen) -> tuple[int, int] | None:
    """The rejection rule along a chain of drafts ``x [n]``, each drawn from its row of ``q [n, V]``, against
    ``p [n, V]``: ``(k, token)`` for the first rejected draft, with a sample of the residual there; None when
    every draft is accepted."""
    ok = accept_draft_tokens(p, q, x, gen).tolist()
    if all(ok):
        return None
    k = ok.index(False)
    return k, int(sample(residual_probs(p[k], q[k]), gen))


def first_mismatch(rows: Tensor, tokens: Tensor, q: list[Tensor], cfg: DecodeConfig, gen):
    """``(k, token)`` for the first of the chain ``tokens [n]`` that the target's logits ``rows [n, V]`` reject,
    with the target's replacement; None when all stand. Greedy: the argmax must match. Sampling: ``tokens[k]`` was
    drawn from ``q[k]``, so the rejection rule keeps the output distributed as the target's."""
    if rows.shape[0] == 0:
        return None
    if cfg.temperature == 0:
        want = rows.argmax(-1)  # [n]
        wrong = (want != tokens).nonzero()
        return None if len(wrong) == 0 else (int(wrong[0]), int(want[wrong[0]]))
    p = logits_to_probs(rows, cfg.temperature, cfg.top_k, cfg.top_p)  # [n, V]
    return first_rejection(p, torch.stack(q[: rows.shape[0]]).to(p.device), tokens, gen)


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


def verify_sampled_chain(
    tree: DraftTree, p: Tensor, d2t: Tensor | None, gen, result: GenerationResult
) -> tuple[list[int], int]:
    """The rejection rule on a chain whose drafts were sampled from ``tree.q``; ``p [n+1, V]`` holds the
    target's probabilities at the root and after each draft."""
    n = len(tree)
    q = torch.stack(tree.q).to(p.device)  # [n, V_draft]
    if d2t is not None:
        q = q.new_zeros(n, p.shape[-1]).index_copy_(1, d2t.to(p.device, torch.long), q)  # [n, V]
    rejected = first_rejection(p[:n], q, torch.tensor(tree.tokens, device=p.device), gen)
    n_acc = n if rejected is None else rejected[0]
    for step in range(min(n_acc + 1, n)):
        _count_step(result, step, step < n_acc)
    return list(range(n_acc)), rejected[1] if rejected is not None else int(sample(p[n], gen))


def verify_tree(
    tree: DraftTree, logits: Tensor, cfg: DecodeConfig, gen, d2t: Tensor | None, result: GenerationResult
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
