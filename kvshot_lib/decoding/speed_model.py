"""Draft shapes chosen by expected speed: accepted tokens per second, from acceptance estimates and measured costs.

A cycle that verifies draft nodes with *values* ``v_i`` (the probability that node i ends up on the accepted
path: the product of its path's acceptance probabilities) yields ``E = 1 + sum_i v_i`` tokens on average (the
bonus token counts). It takes ``T = draft + verify(n + 1) + commit`` seconds (:class:`~.cost_model.CostModel`).
The shape to pick maximizes ``E / T`` (EAGLE-2 ranks nodes by such values; Sequoia optimizes the tree for them;
vLLM admits the best-scoring slots up to the token count that maximizes expected tokens per second):

* :func:`best_size`: with the values sorted (best first; a child is never worth more than its parent, so every
  prefix is a tree), the number of nodes ``n`` that maximizes ``(1 + sum of the best n) / (base + verify(n + 1))``;
* :func:`best_chain_length`: the static chain length from per-step acceptance ``alpha_k`` (notebook 03's table):
  node k's value is ``alpha_0 * ... * alpha_k``, and drafting k tokens costs ``start + (k - 1) * expand(1)``;
* :func:`best_expansion`: the early stop. Another drafter call is made only while the expected gain of the nodes
  it adds (each expanded node's value times the expected acceptance of its child) raises the best reachable
  rate after paying for the call: a node is drafted only when the drafter's confidence so far says it can pay
  for itself.

:class:`AcceptanceModel` turns a drafter's confidence (its probability of the drafted token) into an acceptance
probability, per source (the trained drafter, prompt lookup) and draft depth, in bins, starting from ``q`` itself
and learning online from every verified node; :class:`SpeedModel` holds it with the cost model.
``tests/test_decoding_shapes.py`` checks the choices against optima computed by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Q_EDGES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.97, 1.0)  # confidence bins
MAX_DEPTH_GROUP = 3  # depths 0, 1, 2 and 3+ are calibrated apart
PRIOR_WEIGHT = 2.0  # pseudo-observations at the bin's middle confidence


def expected_tokens(values: Sequence[float]) -> float:
    """Mean tokens a cycle commits: the accepted drafts plus the bonus token."""
    return 1.0 + float(sum(values))


def best_size(values: Sequence[float], base_s: float, verify_s: Callable[[int], float]) -> tuple[int, float]:
    """``(n, tokens per second)`` maximizing ``(1 + sum(values[:n])) / (base_s + verify_s(n + 1))`` over
    ``n = 0..len(values)``; ``values`` sorted best first. Ties go to the smaller ``n``."""
    best_n, best_rate, total = 0, 1.0 / (base_s + verify_s(1)), 1.0
    for n, v in enumerate(values, start=1):
        total += v
        rate = total / (base_s + verify_s(n + 1))
        if rate > best_rate * (1 + 1e-12):
            best_n, best_rate = n, rate
    return best_n, best_rate


def chain_values(alphas: Sequence[float], k: int) -> list[float]:
    """Node values of a k-token chain under conditional per-step acceptance ``alphas`` (the last one repeats)."""
    values, v = [], 1.0
    for i in range(k):
        v *= alphas[min(i, len(alphas) - 1)]
        values.append(v)
    return values


def best_chain_length(alphas: Sequence[float], cost, drafter: str, max_depth: int = 16) -> tuple[int, float]:
    """``(k, tokens per second)``: the chain length maximizing expected tokens per second from the per-step
    acceptance ``alphas`` (k = 0 is plain decoding: no drafter call at all)."""
    best = (0, 1.0 / (cost.verify(1, tree=False) + cost.commit_s))
    for k in range(1, max_depth + 1):
        draft = cost.start(drafter) + (k - 1) * cost.expand(drafter, 1)
        rate = expected_tokens(chain_values(alphas, k)) / (
            draft + cost.verify(k + 1, tree=False) + cost.commit_s
        )
        if rate > best[1] * (1 + 1e-12):
            best = (k, rate)
    return best


def best_expansion(
    values: Sequence[float],
    spent_s: float,
    gains: Sequence[float],
    expand_s: Callable[[int], float],
    verify_s: Callable[[int], float],
) -> int:
    """The early stop: how many of the candidate nodes to expand in one drafter call (0: stop drafting).

    ``gains[i]`` is the expected value of what expanding candidate i adds (its value times the expected
    acceptance of its best child), best first; expanding m of them costs ``expand_s(m)``. Each m is judged as if
    its nodes were already drafted, against the best rate reachable now (``spent_s``: drafting already paid
    plus the commit); the m with the best rate wins, and 0 when none beats stopping."""
    _, now = best_size(sorted(values, reverse=True), spent_s, verify_s)
    best_m, best_rate = 0, now
    for m in range(1, len(gains) + 1):
        if gains[m - 1] <= 0:
            break
        merged = sorted([*values, *gains[:m]], reverse=True)
        _, rate = best_size(merged, spent_s + expand_s(m), verify_s)
        if rate > best_rate * (1 + 1e-12):
            best_m, best_rate = m, rate
    return best_m


@dataclass
class AcceptanceModel:
    """P(a draft node is accepted | its parent was), by source, depth group and confidence bin: a Beta
    posterior per cell whose prior mean is the bin's middle confidence (a calibrated drafter's acceptance is
    its confidence), updated online by :meth:`observe` with every verified node whose parent was accepted.
    ``continue_rate`` is the per-depth mean of the same observations: the expected acceptance of a node not yet
    drafted (at temperature 0, the chance the target's argmax is among the drafts)."""

    hits: dict = field(default_factory=dict)  # (source, depth group, bin) -> accepted
    seen: dict = field(default_factory=dict)  # (source, depth group, bin) -> attempted
    depth_hits: dict = field(default_factory=dict)  # (source, depth group) -> parents whose path continued
    depth_seen: dict = field(default_factory=dict)  # (source, depth group) -> parents with drafted children
    prior_continue: float = 0.5

    @staticmethod
    def _bin(q: float) -> int:
        for i, edge in enumerate(Q_EDGES[1:]):
            if q <= edge:
                return i
        return len(Q_EDGES) - 2

    def rate(self, source: str, depth: int, q: float) -> float:
        b = self._bin(q)
        key = (source, min(depth, MAX_DEPTH_GROUP), b)
        prior = 0.5 * (Q_EDGES[b] + Q_EDGES[b + 1])
        return (self.hits.get(key, 0) + PRIOR_WEIGHT * prior) / (self.seen.get(key, 0) + PRIOR_WEIGHT)

    def continue_rate(self, source: str, depth: int) -> float:
        key = (source, min(depth, MAX_DEPTH_GROUP))
        return (self.depth_hits.get(key, 0) + PRIOR_WEIGHT * self.prior_continue) / (
            self.depth_seen.get(key, 0) + PRIOR_WEIGHT
        )

    def observe(self, tree, path: Sequence[int]) -> None:
        """Learn from one verified tree: ``path`` holds the accepted node indices (root to leaf)."""
        if not tree.confs:
            return
        on_path = {-1, *path}
        continued = {}
        for i, parent in enumerate(tree.parents):
            if parent not in on_path:
                continue  # never attempted: its parent was rejected
            source, depth, accepted = tree.sources[i], tree.depths[i], i in on_path
            key = (source, min(depth, MAX_DEPTH_GROUP), self._bin(tree.confs[i]))
            self.seen[key] = self.seen.get(key, 0) + 1
            self.hits[key] = self.hits.get(key, 0) + int(accepted)
            dkey = (source, min(depth, MAX_DEPTH_GROUP))
            continued[dkey] = continued.get(dkey, False) or accepted
        for dkey, hit in continued.items():
            self.depth_seen[dkey] = self.depth_seen.get(dkey, 0) + 1
            self.depth_hits[dkey] = self.depth_hits.get(dkey, 0) + int(hit)


@dataclass
class SpeedModel:
    """What chosen shapes need: the cost model, the drafter whose call costs apply and the acceptance estimates
    (learned across the generations that share this object). ``early_stop=False`` drafts every shape to its caps
    and only then selects the nodes to verify (the ablation ``tests/test_decoding_shapes.py`` compares)."""

    cost: object  # a CostModel
    drafter: str
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)
    early_stop: bool = True

    def verify_fn(self, tree: bool) -> Callable[[int], float]:
        return lambda n: self.cost.verify(n, tree)

    def start_s(self) -> float:
        return self.cost.start(self.drafter) + self.cost.commit_s

    def expand_s(self, n: int) -> float:
        return self.cost.expand(self.drafter, n)
