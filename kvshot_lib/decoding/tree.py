"""Drafting one cycle: a chain of k tokens, or an EAGLE-2 dynamic tree (its attention mask for verification
is :mod:`kvshot_lib.drafters.tree_mask`'s).

Both builders drive a :class:`~kvshot_lib.drafters.base.DraftSession` (``start_cycle`` / ``expand``) and
return a :class:`DraftTree`. A chain is a tree whose node ``i`` has parent ``i - 1``.

**The dynamic tree** (EAGLE-2, Li et al. 2024). Every candidate carries a score, the sum of the draft
log-probabilities along its path from the root. Level 0 is the root's ``top_k`` children. At each
deeper level, the ``top_k`` best-scoring candidates of the previous level are expanded in one
``expand`` call, each proposes its ``top_k`` children, and all of them become candidates. After
``depth`` levels the ``budget`` best candidates form the tree. A child never scores above its parent
(log-probs are <= 0), and ties go to the shallower node, so the selection always contains every
selected node's ancestors.

A session may return all ``-inf`` logits to decline to draft after a node (the n-gram drafter does
when it finds no match): that branch simply ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .sampling import logits_to_probs, sample


@dataclass
class DraftTree:
    """The nodes drafted in one cycle; parents always come before their children.

    tokens[i]: target id; parents[i]: index of the parent node or -1 for the root; depths[i]: 0 for the
    root's children. For a chain sampled at temperature > 0, ``q[i]`` is the draft distribution (over the
    draft vocabulary) that token i was sampled from. Shapes chosen by expected speed (:mod:`.proposal`) also
    keep each node's drafting confidence, its source (``drafter`` or ``lookup``) and its value (the estimated
    probability that it is accepted, :mod:`.shapes`).
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    q: list[Tensor] = field(default_factory=list)
    confs: list[float] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self) -> list[list[int]]:
        """children()[b] lists the nodes under block position b (0 = the root, i + 1 = node i)."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents):
            out[p + 1].append(i)
        return out

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def add(self, token: int, parent: int, depth: int, conf: float, source: str, value: float) -> int:
        """Append a node (its parent already in the tree); returns its index."""
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(depth)
        self.confs.append(conf)
        self.sources.append(source)
        self.values.append(value)
        return len(self.tokens) - 1

    def subset(self, keep: list[int]) -> DraftTree:
        """The nodes ``keep`` (which hold every kept node's parent), parents first, reindexed; ``q`` is kept only
        for a prefix of a chain."""
        keep = sorted(keep, key=lambda i: (self.depths[i], i))
        index = {old: new for new, old in enumerate(keep)}
        out = DraftTree()
        for i in keep:
            out.add(
                self.tokens[i],
                -1 if self.parents[i] < 0 else index[self.parents[i]],
                self.depths[i],
                self.confs[i] if self.confs else 1.0,
                self.sources[i] if self.sources else "drafter",
                self.values[i] if self.values else 1.0,
            )
        if self.q and keep == list(range(len(keep))):
            out.q = self.q[: len(keep)]
        return out


def _to_target(ids: Tensor, d2t: Tensor | None) -> Tensor:
    return ids if d2t is None else d2t[ids]


def draft_chain(
    session,
    committed: Tensor,
    view,
    depth: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    stop_after: Callable[[int, int], bool] | None = None,
) -> DraftTree:
    """Draft up to ``depth`` tokens one after another: argmax at temperature 0, else a sample from
    ``q = logits_to_probs(draft logits)`` (kept for the rejection rule). ``depth - 1`` expand calls, fewer
    if ``stop_after(step, token)`` returns True (the greedy replay stops at the first wrong draft)."""
    tree = DraftTree()
    logits = session.start_cycle(committed, view)  # [V_draft]
    d2t, dev = session.d2t, logits.device
    for d in range(depth):
        if d > 0:
            token, parent = torch.tensor([tree.tokens[-1]], device=dev), torch.tensor([d - 2], device=dev)
            logits = session.expand(token, parent)[0]  # [V_draft]
        if not torch.isfinite(logits.max()):
            break  # the drafter declines
        if temperature == 0:
            j = int(logits.argmax())
        else:
            q = logits_to_probs(logits, temperature, top_k, top_p)  # [V_draft]
            j = int(sample(q, generator))
            tree.q.append(q)
        tree.tokens.append(int(_to_target(torch.tensor(j, device=dev), d2t)))
        tree.parents.append(d - 1)
        tree.depths.append(d)
        if stop_after is not None and stop_after(d, tree.tokens[-1]):
            break
    return tree


def _log_q(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    if temperature == 0:
        return torch.log_softmax(logits.float(), dim=-1)
    return logits_to_probs(logits, temperature, top_k, top_p).log()


def draft_dynamic_tree(
    session,
    committed: Tensor,
    view,
    depth: int,
    top_k: int,
    budget: int,
    temperature: float = 0.0,
    sample_top_k: int = 0,
    top_p: float = 1.0,
) -> DraftTree:
    """EAGLE-2's dynamic tree: ``depth`` levels, ``top_k`` children per expanded node and ``top_k``
    expanded nodes per level, then the ``budget`` best candidates. Scores are draft log-probs (after
    temperature / top-k / top-p when ``temperature > 0``). ``depth - 1`` expand calls."""
    d2t = session.d2t
    logq = _log_q(session.start_cycle(committed, view), temperature, sample_top_k, top_p)  # [V_draft]
    dev = logq.device
    # Candidates: parallel lists. cand_session[c] is c's index among expanded session nodes, or -1.
    tok: list[int] = []
    par: list[int] = []
    dep: list[int] = []
    scores: list[float] = []
    vals, idx = logq.topk(min(top_k, logq.shape[-1]))  # [K]
    keep = torch.isfinite(vals)
    vals, idx = vals[keep], idx[keep]
    tok += _to_target(idx, d2t).tolist()
    par += [-1] * len(vals)
    dep += [0] * len(vals)
    scores += vals.tolist()
    frontier = list(range(len(vals)))  # candidate ids of the level just added
    frontier_scores = vals  # [F]
    n_expanded = 0
    cand_session: dict[int, int] = {}
    for level in range(1, depth):
        if not frontier:
            break
        # Expand the best top_k of the previous level (already at most top_k at level 0).
        best = frontier_scores.topk(min(top_k, len(frontier))).indices.tolist()
        nodes = [frontier[b] for b in best]
        parents = torch.tensor([cand_session.get(par[c], -1) for c in nodes], device=dev)  # [n]
        logits = session.expand(torch.tensor([tok[c] for c in nodes], device=dev), parents)  # [n, V_draft]
        for i, c in enumerate(nodes):
            cand_session[c] = n_expanded + i
        n_expanded += len(nodes)
        child_logq = _log_q(logits, temperature, sample_top_k, top_p)  # [n, V_draft]
        vals, idx = child_logq.topk(min(top_k, child_logq.shape[-1]), dim=-1)  # [n, K]
        cum = torch.tensor([scores[c] for c in nodes], device=vals.device)[:, None] + vals  # [n, K]
        keep = torch.isfinite(cum)
        rows = torch.arange(len(nodes), device=cum.device)[:, None].expand_as(cum)[keep]  # [m]
        cum, idx = cum[keep], idx[keep]  # [m]
        start = len(tok)
        tok += _to_target(idx, d2t).tolist()
        par += [nodes[r] for r in rows.tolist()]
        dep += [level] * len(cum)
        scores += cum.tolist()
        frontier = list(range(start, len(tok)))
        frontier_scores = cum
    # Rerank: the budget best candidates, ties to the shallower node, parents before children.
    order = sorted(range(len(tok)), key=lambda c: (-scores[c], dep[c]))[:budget]
    order.sort(key=lambda c: (dep[c], -scores[c]))
    new_index = {c: i for i, c in enumerate(order)}
    tree = DraftTree()
    for c in order:
        tree.tokens.append(tok[c])
        tree.parents.append(-1 if par[c] < 0 else new_index[par[c]])
        tree.depths.append(dep[c])
    return tree
