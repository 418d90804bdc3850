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
selected node's ancestors. :func:`grow_tree` is the one builder, level by level: for this fixed shape
(:func:`draft_dynamic_tree`) and for shapes chosen by expected speed (:func:`~.proposal.chosen_tree`).

A session may return all ``-inf`` logits to decline to draft after a node (the n-gram drafter does
when it finds no match): that branch simply ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..drafters.base import DraftSession, TargetView
from ..drafters.tree_mask import ancestor_matrix
from .sampling import logits_to_probs, sample


@dataclass
class DraftTree:
    """The nodes drafted in one cycle; parents always come before their children.

    tokens[i]: target id; parents[i]: index of the parent node or -1 for the root; depths[i]: 0 for the
    root's children. For a chain sampled at temperature > 0, ``q[i]`` is the draft distribution (over the
    draft vocabulary) that token i was sampled from. Shapes chosen by expected speed (:mod:`.proposal`) also
    keep each node's drafting confidence, its source (``drafter`` or ``lookup``) and its value (the estimated
    probability that it is accepted, :mod:`.speed_model`).
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    q: list[Tensor] = field(default_factory=list)
    confs: list[float] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    anc: Tensor | None = None  # [N+1, N+1] its ancestor matrix where the device built it (.device_draft)

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self) -> list[list[int]]:
        """children()[b] lists the nodes under block position b (0 = the root, i + 1 = node i)."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents):
            out[p + 1].append(i)
        return out

    def ancestors(self) -> Tensor:
        """``[N+1, N+1]`` bool, block row b sees column c (:func:`~kvshot_lib.drafters.tree_mask.ancestor_matrix`):
        the one the device built with the tree, else built from ``parents``."""
        return self.anc if self.anc is not None else ancestor_matrix(self.parents)

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def add(self, token: int, parent: int, depth: int, conf: float, source: str, value: float) -> int:
        """Append a node (its parent already in the tree); returns its index."""
        self.anc = None  # no longer the tree it was built for
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


def to_target(j: int, d2t: Tensor | None) -> int:
    """Draft id ``j`` as a target id."""
    return j if d2t is None else int(d2t[j])


def draft_probs(logits: Tensor, temperature: float, top_k: int, top_p: float, log: bool = False) -> Tensor:
    """The drafter's distribution (its log if ``log``) that drafts are ranked by: a softmax at temperature 0,
    else the processed sampling distribution."""
    if temperature == 0:
        return (torch.log_softmax if log else torch.softmax)(logits.float(), -1)
    probs = logits_to_probs(logits, temperature, top_k, top_p)
    return probs.log() if log else probs


def draft_chain(
    session: DraftSession,
    committed: Tensor,
    view: TargetView,
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
    dev = logits.device
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
        tree.tokens.append(to_target(j, session.d2t))
        tree.parents.append(d - 1)
        tree.depths.append(d)
        if stop_after is not None and stop_after(d, tree.tokens[-1]):
            break
    return tree


def grow_tree(
    session: DraftSession,
    committed: Tensor,
    view: TargetView,
    depth: int,
    add_children: Callable[[DraftTree, Tensor, list[int], int], list[int]],
    pick: Callable[[DraftTree, list[int], int], list[int]],
) -> DraftTree:
    """EAGLE-2's dynamic tree, level by level; returns every candidate, parents before children.

    ``add_children(tree, logits, nodes, level)`` adds the children of ``nodes`` (``[-1]``: the root) from their
    draft ``logits`` (``[V_draft]`` for the root, ``[n, V_draft]`` below) and returns the new nodes; at each
    deeper level, ``pick(tree, frontier, level)`` chooses the frontier nodes to expand in one ``expand`` call
    (none: drafting stops). At most ``depth - 1`` expand calls."""
    tree = DraftTree()
    in_session: dict[int, int] = {}  # node -> its index among the session's expanded nodes
    logits = session.start_cycle(committed, view)  # [V_draft]
    dev = logits.device
    frontier = add_children(tree, logits, [-1], 0)
    for level in range(1, depth):
        nodes = pick(tree, frontier, level) if frontier else []
        if not nodes:
            break
        parents = torch.tensor([in_session.get(tree.parents[c], -1) for c in nodes], device=dev)  # [n]
        tokens = torch.tensor([tree.tokens[c] for c in nodes], device=dev)  # [n]
        logits = session.expand(tokens, parents)  # [n, V_draft]
        for c in nodes:
            in_session[c] = len(in_session)
        frontier = add_children(tree, logits, nodes, level)
    return tree


def draft_dynamic_tree(
    session: DraftSession,
    committed: Tensor,
    view: TargetView,
    depth: int,
    top_k: int,
    budget: int,
    temperature: float = 0.0,
    sample_top_k: int = 0,
    top_p: float = 1.0,
) -> DraftTree:
    """EAGLE-2's dynamic tree: ``depth`` levels, ``top_k`` children per expanded node and ``top_k``
    expanded nodes per level, then the ``budget`` best candidates. Scores (a candidate's ``values``) are draft
    log-probs (after temperature / top-k / top-p when ``temperature > 0``). ``depth - 1`` expand calls."""
    scores: Tensor | None = None  # [F] the scores of the level just added

    def add_children(cand: DraftTree, logits: Tensor, nodes: list[int], level: int) -> list[int]:
        nonlocal scores
        logq = draft_probs(logits, temperature, sample_top_k, top_p, log=True)  # [n, V_draft] or [V_draft]
        vals, idx = logq.topk(min(top_k, logq.shape[-1]), dim=-1)
        vals, idx = vals.reshape(len(nodes), -1), idx.reshape(len(nodes), -1)  # [n, K]
        if level > 0:
            vals = torch.tensor([cand.values[c] for c in nodes], device=vals.device)[:, None] + vals  # [n, K]
        keep = torch.isfinite(vals)
        rows = torch.arange(len(nodes), device=vals.device)[:, None].expand_as(vals)[keep]  # [m]
        scores, idx = vals[keep], idx[keep]  # [m]
        new = zip(rows.tolist(), idx.tolist(), scores.tolist())
        return [cand.add(to_target(j, session.d2t), nodes[r], level, s, "drafter", s) for r, j, s in new]

    def pick(cand: DraftTree, frontier: list[int], level: int) -> list[int]:
        return [frontier[b] for b in scores.topk(min(top_k, len(frontier))).indices.tolist()]

    cand = grow_tree(session, committed, view, depth, add_children, pick)
    # Rerank: the budget best candidates, ties to the shallower node, parents before children.
    order = sorted(range(len(cand)), key=lambda c: (-cand.values[c], cand.depths[c]))[:budget]
    order.sort(key=lambda c: (cand.depths[c], -cand.values[c]))
    new_index = {c: i for i, c in enumerate(order)}
    return DraftTree(
        [cand.tokens[c] for c in order],
        [-1 if cand.parents[c] < 0 else new_index[cand.parents[c]] for c in order],
        [cand.depths[c] for c in order],
    )
