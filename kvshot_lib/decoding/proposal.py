"""One cycle's proposal with a shape chosen by expected speed, and prompt lookup joined into it.

* :func:`chosen_chain`: a chain drafted one token at a time while :func:`~.shapes.best_expansion` says the next
  token can pay for its drafter call;
* :func:`chosen_tree`: EAGLE-2's dynamic tree (candidates ranked by value, the best frontier nodes expanded
  level by level), where each level expands only as many nodes as pay for the call (none: drafting stops);
* :func:`select_by_value`: the best ``n`` candidates by value, ``n`` chosen by :func:`~.shapes.best_size` (the
  expected tokens per second of the cycle, drafting already paid) up to the budget;
* :func:`add_lookup`: prompt lookup's continuation (the n-gram drafter of :mod:`kvshot_lib.drafters.baselines`,
  its argmax chain) merged into the drafter's tree as a path from the root: where it agrees with drafted nodes
  it follows them, where it departs it adds nodes. Verification stays one forward over the union.

Values are acceptance estimates (:class:`~.shapes.AcceptanceModel`), so a shape changes which tokens are
verified, never which are committed: verification is the engine's lossless rule. At temperature > 0 a merged
tree is verified by sampling the target and descending into a matching child (drafts that do not depend on
that sample: lossless); only an untouched sampled chain keeps the rejection rule.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .sampling import logits_to_probs, sample
from .shapes import SpeedModel, best_expansion, best_size
from .tree import DraftTree


def _probs(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """The drafter's distribution the confidences are read from: softmax at temperature 0, else the processed
    sampling distribution."""
    if temperature == 0:
        return torch.softmax(logits.float(), -1)
    return logits_to_probs(logits, temperature, top_k, top_p)


def _to_target(j: int, d2t) -> int:
    return j if d2t is None else int(d2t[j])


def chosen_chain(
    session,
    committed: Tensor,
    view,
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
        q = _probs(logits, temperature, top_k, top_p)  # [V_draft]
        j = int(q.argmax()) if temperature == 0 else int(sample(q, generator))
        conf = float(q[j])
        value *= acc.rate(source, d, conf)
        tree.add(_to_target(j, d2t), d - 1, d, conf, source, value)
        if temperature > 0:
            tree.q.append(q)
    return tree, spent


def chosen_tree(
    session,
    committed: Tensor,
    view,
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
    d2t = session.d2t
    cand = DraftTree()  # every candidate; parents before children
    in_session: dict[int, int] = {}  # candidate -> its index among the session's expanded nodes
    q = _probs(session.start_cycle(committed, view), temperature, sample_top_k, top_p)  # [V_draft]
    spent, dev = speed.start_s(), q.device
    frontier = _add_children(cand, q, -1, 0, 1.0, top_k, acc, source, d2t)
    for level in range(1, max_depth):
        ranked = sorted(frontier, key=lambda c: -cand.values[c])[:top_k]
        rate = acc.continue_rate(source, level)
        m = best_expansion(
            cand.values, spent, [cand.values[c] * rate for c in ranked], speed.expand_s, verify
        )
        if m == 0:
            break
        nodes = ranked[:m]
        parents = torch.tensor([in_session.get(cand.parents[c], -1) for c in nodes], device=dev)  # [m]
        tokens = torch.tensor([cand.tokens[c] for c in nodes], device=dev)  # [m]
        logits = session.expand(tokens, parents)  # [m, V_draft]
        for c in nodes:
            in_session[c] = len(in_session)
        spent += speed.expand_s(m)
        probs = _probs(logits, temperature, sample_top_k, top_p)  # [m, V_draft]
        frontier = []
        for i, c in enumerate(nodes):
            frontier += _add_children(cand, probs[i], c, level, cand.values[c], top_k, acc, source, d2t)
    return cand, spent


def _add_children(
    tree: DraftTree, q: Tensor, parent: int, depth: int, value: float, k: int, acc, source, d2t
):
    """Add the ``k`` most likely tokens of ``q [V_draft]`` below ``parent``; returns their indices."""
    vals, idx = q.topk(min(k, q.shape[-1]))  # [k]
    added = []
    for p, j in zip(vals.tolist(), idx.tolist()):
        if not p > 0:
            continue  # impossible, or NaN where the drafter declined (all logits -inf)
        v = value * acc.rate(source, depth, p)
        added.append(tree.add(_to_target(j, d2t), parent, depth, p, source, v))
    return added


@torch.inference_mode()
def lookup_chain(session, committed: Tensor, length: int) -> tuple[list[int], list[float]]:
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
