"""One cycle's proposal with a shape chosen by expected speed, and prompt lookup joined into it.

* :func:`chosen_chain`: a chain drafted one token at a time while :func:`~.speed_model.best_expansion` says the next
  token can pay for its drafter call;
* :func:`chosen_tree`: EAGLE-2's dynamic tree (:func:`~.tree.grow_tree`; candidates ranked by value, the best
  frontier nodes expanded level by level), where each level expands only as many nodes as pay for the call (none:
  drafting stops);
* :func:`select_by_value`: the best ``n`` candidates by value, ``n`` chosen by :func:`~.speed_model.best_size` (the
  expected tokens per second of the cycle, drafting already paid) up to the budget;
* :func:`add_lookup`: prompt lookup's continuation (the n-gram drafter of :mod:`kvshot_lib.drafters.baselines`,
  its argmax chain) merged into the drafter's tree as a path from the root: where it agrees with drafted nodes
  it follows them, where it departs it adds nodes. Verification stays one forward over the union.

Values are acceptance estimates (:class:`~.speed_model.AcceptanceModel`), so a shape changes which tokens are
verified, never which are committed: verification is the engine's lossless rule. At temperature > 0 a merged
tree is verified by sampling the target and descending into a matching child (drafts that do not depend on
that sample: lossless); only an untouched sampled chain keeps the rejection rule.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..drafters.base import DraftSession, TargetView
from .sampling import sample
from .speed_model import SpeedModel, best_expansion, best_size
from .tree import DraftTree, draft_probs, grow_tree, to_target


def chosen_chain(
    session: DraftSession,
    committed: Tensor,
    view: TargetView,
    max_depth: int,
    speed: SpeedModel,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator=None,
    source: str = "drafter",
) -> tuple[DraftTree, float]:
    """Draft up to ``max_depth`` tokens, stopping early when the next one is not worth its drafter call. Returns
    the candidates and the modeled seconds spent drafting (with the commit): :func:`select_by_value` cuts them."""
    tree = DraftTree()
    acc, verify = speed.acceptance, speed.verify_fn(tree=False)
    logits = session.start_cycle(committed, view)  # [V_draft]
    spent, d2t, dev = speed.start_s(), session.d2t, logits.device
    value = 1.0
    for d in range(max_depth):
        if d > 0:
            gain = value * acc.continue_rate(source, d)
            if speed.early_stop and not best_expansion(tree.values, spent, [gain], speed.expand_s, verify):
                break
            token, parent = torch.tensor([tree.tokens[-1]], device=dev), torch.tensor([d - 2], device=dev)
            logits = session.expand(token, parent)[0]  # [V_draft]
            spent += speed.expand_s(1)
        if not torch.isfinite(logits.max()):
            break  # the drafter declines
        q = draft_probs(logits, temperature, top_k, top_p)  # [V_draft]
        j = int(q.argmax()) if temperature == 0 else int(sample(q, generator))
        conf = float(q[j])
        value *= acc.rate(source, d, conf)
        tree.add(to_target(j, d2t), d - 1, d, conf, source, value)
        if temperature > 0:
            tree.q.append(q)
    return tree, spent


def chosen_tree(
    session: DraftSession,
    committed: Tensor,
    view: TargetView,
    max_depth: int,
    top_k: int,
    speed: SpeedModel,
    temperature: float = 0.0,
    sample_top_k: int = 0,
    top_p: float = 1.0,
    source: str = "drafter",
) -> tuple[DraftTree, float]:
    """EAGLE-2's dynamic tree with values for scores and an early stop per level. Returns every candidate and
    the modeled seconds spent drafting (with the commit): :func:`select_by_value` picks the nodes to verify."""
    acc, verify = speed.acceptance, speed.verify_fn(tree=True)
    spent = speed.start_s()

    def add_children(cand: DraftTree, logits: Tensor, nodes: list[int], level: int) -> list[int]:
        """The ``top_k`` most likely children of each node; their value is the parent's times their acceptance."""
        probs = draft_probs(logits, temperature, sample_top_k, top_p).reshape(len(nodes), -1)  # [n, V_draft]
        added = []
        for q, c in zip(probs, nodes):
            value = cand.values[c] if c >= 0 else 1.0
            vals, idx = q.topk(min(top_k, q.shape[-1]))  # [k]
            for p, j in zip(vals.tolist(), idx.tolist()):
                if p > 0:  # not impossible, nor NaN where the drafter declined (all logits -inf)
                    v = value * acc.rate(source, level, p)
                    added.append(cand.add(to_target(j, session.d2t), c, level, p, source, v))
        return added

    def pick(cand: DraftTree, frontier: list[int], level: int) -> list[int]:
        """The best frontier nodes by value, as many as pay for the call."""
        nonlocal spent
        ranked = sorted(frontier, key=lambda c: -cand.values[c])[:top_k]
        rate = acc.continue_rate(source, level)
        m = best_expansion(
            cand.values, spent, [cand.values[c] * rate for c in ranked], speed.expand_s, verify
        )
        if m:
            spent += speed.expand_s(m)
        return ranked[:m]

    cand = grow_tree(session, committed, view, max_depth, add_children, pick)
    return cand, spent


@torch.inference_mode()
def lookup_chain(session: DraftSession, committed: Tensor, length: int) -> tuple[list[int], list[float]]:
    """Prompt lookup's continuation of ``committed [1, P+1]``: up to ``length`` argmax tokens of an n-gram
    session and their confidences; empty where the context has no match."""
    tokens, confs = [], []
    logits = session.start_cycle(committed, None)  # [V]
    for d in range(length):
        if d > 0:
            logits = session.expand(torch.tensor([tokens[-1]]), torch.tensor([d - 2]))[0]
        if not torch.isfinite(logits.max()):
            break
        q = torch.softmax(logits.float(), -1)
        j = int(q.argmax())
        tokens.append(j)
        confs.append(float(q[j]))
    session.end_cycle()
    return tokens, confs


def add_lookup(tree: DraftTree, tokens: list[int], confs: list[float], speed: SpeedModel | None) -> DraftTree:
    """Merge the lookup continuation ``tokens`` into ``tree`` as a path from the root (shared nodes are reused,
    and keep the higher value); ``speed`` gives the new nodes' values (1.0 without one)."""
    if not tokens:
        return tree
    if not tree.confs:  # a fixed-shape tree: give its nodes the fields a merge needs
        n = len(tree)
        tree.confs, tree.sources, tree.values = [1.0] * n, ["drafter"] * n, [1.0] * n
    child = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens))}
    parent, value, added = -1, 1.0, False
    for d, (tok, conf) in enumerate(zip(tokens, confs)):
        v = value * (speed.acceptance.rate("lookup", d, conf) if speed is not None else 1.0)
        node = child.get((parent, tok))
        if node is None:
            node = tree.add(tok, parent, d, conf, "lookup", v)
            added = True
        else:
            tree.values[node] = max(tree.values[node], v)
        parent, value = node, tree.values[node]
    if added:
        tree.q = []  # no longer the sampled chain the rejection rule needs
    return tree


def select_by_value(tree: DraftTree, spent_s: float, speed: SpeedModel, budget: int) -> DraftTree:
    """The best nodes of ``tree`` by value, as many as maximize expected tokens per second (at most ``budget``).
    Ranked by value, ties to the shallower node: a child is never worth more than its parent, so every prefix of
    the ranking holds its nodes' ancestors."""
    order = sorted(range(len(tree)), key=lambda c: (-tree.values[c], tree.depths[c]))[:budget]
    n, _ = best_size([tree.values[c] for c in order], spent_s, speed.verify_fn(tree=not tree.is_chain()))
    return tree.subset(order[:n])
