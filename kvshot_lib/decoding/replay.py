"""Speculative decoding at a given acceptance: the cost of the paradigm, timed without a trained drafter.

A target with random weights accepts nothing, so its speed says nothing about a paradigm. *Replayed acceptance*
keeps every cost real and draws only the verdict:

1. the drafter drafts for real (its chain or tree, on whichever draft path ``DecodeConfig`` picks);
2. the cycle's accepted length ``L`` is drawn from a per-step acceptance profile (``alphas``: the conditional
   acceptance of draft step k, the last one repeating), at most the tree's depth;
3. a path of ``L`` nodes is chosen (a chain's first ``L``; in a tree, the first node at depth ``L - 1`` and its
   ancestors) and the *reference's* tokens are written into it, so the target verifies the reference's tokens in
   its real forward, over the whole drafted block, and its cache holds exactly their K/V;
4. those ``L`` tokens and the next (the bonus) are committed: the output is the reference's, plain decoding's,
   so it stays checkable token for token.

:func:`profile_for_mat` stretches a chain's per-step profile to a tree's mean accepted tokens (the KVShot paper's
Table 4 gives trees only as a MAT). The engine takes a :class:`ReplayedAcceptance` as ``replay=`` and otherwise
runs unchanged. Labelled everywhere as replayed: these are speeds at the paper's acceptance, not a trained
drafter's. ``tests/test_replay.py`` checks the profile, the drawn lengths and that the output is the reference.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from .tree import DraftTree


def mat_of(alphas: tuple[float, ...], depth: int) -> float:
    """Mean accepted tokens per cycle, bonus included, of a chain of ``depth`` drafts: 1 + sum_k prod_{j<=k} a_j."""
    total, survive = 1.0, 1.0
    for k in range(depth):
        survive *= alphas[min(k, len(alphas) - 1)]
        total += survive
    return total


def profile_for_mat(alphas: tuple[float, ...], mat: float, depth: int) -> tuple[float, ...]:
    """``alphas`` scaled by one factor (each capped at 1) so that ``depth`` steps give ``mat`` (bisection)."""
    if not 1 <= mat <= 1 + depth:
        raise ValueError(f"a MAT of {mat} is out of reach of {depth} draft steps (1 to {1 + depth}).")
    steps = [alphas[min(k, len(alphas) - 1)] for k in range(depth)]
    lo, hi = 0.0, 1.0 / min(steps)
    for _ in range(100):
        c = (lo + hi) / 2
        lo, hi = (c, hi) if mat_of(tuple(min(1.0, c * a) for a in steps), depth) < mat else (lo, c)
    return tuple(min(1.0, lo * a) for a in steps)


@dataclass
class ReplayedAcceptance:
    """The verdicts of one generation at the acceptance profile ``alphas``, committing ``reference`` (plain
    decoding's new tokens, at least as many as the generation makes); ``seed`` fixes the draws."""

    reference: list[int]
    alphas: tuple[float, ...]
    seed: int = 0
    rng: random.Random = field(init=False, repr=False)

    def __post_init__(self):
        if not self.alphas or not all(0 <= a <= 1 for a in self.alphas):
            raise ValueError(f"alphas must be acceptance rates in [0, 1], got {self.alphas!r}.")
        self.rng = random.Random(self.seed)

    def draw(self, most: int) -> int:
        """An accepted length: step k is accepted with probability alpha_k given every earlier one was, up to
        ``most``."""
        n = 0
        while n < most and self.rng.random() < self.alphas[min(n, len(self.alphas) - 1)]:
            n += 1
        return n

    def choose(self, tree: DraftTree, made: int) -> tuple[list[int], int]:
        """This cycle's accepted path in ``tree`` (node indices, root down) and bonus token, after ``made`` new
        tokens; the path's nodes now carry the reference's tokens (the target verifies them)."""
        if made + (max(tree.depths) + 1 if len(tree) else 0) >= len(self.reference):
            raise ValueError(
                f"the reference holds {len(self.reference)} tokens; a cycle after {made} could need more: pass "
                "plain decoding's output of the same max_new_tokens."
            )
        L = self.draw(max(tree.depths) + 1 if len(tree) else 0)
        path: list[int] = []
        if L:
            node = tree.depths.index(L - 1)
            while node >= 0:
                path.append(node)
                node = tree.parents[node]
            path.reverse()
        for i, node in enumerate(path):
            tree.tokens[node] = self.reference[made + i]
        return path, self.reference[made + L]
