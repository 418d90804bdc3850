"""Drafting one cycle without the host: a chain, or EAGLE-2's tree grown as a fixed-width beam, in tensors.

The host path (:mod:`.tree`) reads every draft level back to Python to build its tree. On a GPU that makes each
level wait for the device, and each node a Python call: the H200 check measured 16.6 ms of drafting per chain
cycle and 24.9 ms per tree cycle, more than the target's verify forward. This path, as SGLang's
``eagle_draft_cuda_graph_runner.py`` does, keeps the whole loop on the device at fixed shapes, so that it can be
recorded once as a CUDA graph (:class:`~kvshot_lib.target.graphs.CapturedCall`) and replayed every cycle:

1. ``start_cycle`` runs eagerly (its width is the tokens committed since the last cycle), then the session's
   fixed-shape steps (:mod:`kvshot_lib.drafters.static_steps`) take its root logits and lengths;
2. a **chain** of K drafts: the argmax of the root logits, then K - 1 steps, each the argmax of the one before;
3. a **tree** (EAGLE-2; SGLang's ``select_top_k_tokens`` and ``organize_draft_results``): the root's ``k`` best
   children form the first beam; each step runs the beam's ``k`` nodes, every one proposes its ``k`` best children
   scored by their cumulative draft log-probability, and the ``k`` best of those ``k * k`` form the next beam.
   After ``depth`` levels the ``budget`` best candidates are kept (a stable sort: ties go to the earlier, shallower
   candidate, and a child never scores above its parent, so every kept node's parent is kept), in candidate
   order (parents first), with their parents renumbered and their ancestor matrix built in tensors;
4. the host reads the result once (one ``tolist``), the cycle's one sync before verification.

It is the same tree as the host path's dynamic tree (``draft_dynamic_tree``: the ``top_k`` best of a level
expanded, each with ``top_k`` children, the ``budget`` best kept), grown at fixed width. ``DecodeConfig.draft_loop``
picks this path; on a CPU the same code runs eagerly. ``tests/test_device_draft.py`` checks the beam against a
hand-worked case, the chain and tree against the host path's, greedy decoding with them against plain decoding
for every paradigm, and that nothing reads the device inside the loop.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from ..drafters.base import DraftSession, TargetView
from ..drafters.static_steps import DraftBuffers
from ..target.graphs import CapturedCall
from .tree import DraftTree

_GRAPHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # steps -> {loop key: (signature, call)}


def target_ids(j: Tensor, d2t: Tensor | None) -> Tensor:
    """Draft ids ``j`` as target ids, on the device."""
    return j if d2t is None else d2t[j]


def chain_loop(steps, depth: int, d2t: Tensor | None) -> Tensor:
    """``depth`` greedy drafts from ``steps.root_logits``: ``[depth]`` draft ids, no host read."""
    j = steps.root_logits.argmax(-1, keepdim=True)  # [1]
    out, above = [j], torch.zeros(1, dtype=torch.long, device=j.device)  # [1] the parent: the one node above
    for level in range(depth - 1):
        j = steps.step(target_ids(j, d2t), None if level == 0 else above, level).argmax(-1)  # [1]
        out.append(j)
    return torch.cat(out)  # [depth]


def ancestors(parents: Tensor, depth: int) -> Tensor:
    """``[N+1, N+1]`` bool from ``parents [N]`` (``-1``: the root; parents first), as
    :func:`~kvshot_lib.drafters.tree_mask.ancestor_matrix` gives it, in tensors: ``depth`` rounds of "see what
    your parent sees" reach every ancestor of a tree ``depth`` levels deep."""
    n = parents.shape[0]
    anc = torch.eye(n + 1, dtype=torch.bool, device=parents.device)  # [N+1, N+1]
    anc[1:, 0] = True
    up = parents + 1  # [N] block row of each node's parent (0: the root)
    for _ in range(depth):
        anc[1:] = anc[1:] | anc[up]
    return anc


def beam_loop(steps, depth: int, k: int, budget: int, d2t: Tensor | None) -> tuple[Tensor, Tensor]:
    """EAGLE-2's tree at fixed width ``k`` (module docstring): ``(nodes [3, N], ancestors [N+1, N+1])``, the
    rows of ``nodes`` being target ids, parents (``-1``: the root) and depths, parents before children."""
    logq = torch.log_softmax(steps.root_logits.float(), -1)  # [V]
    score, j = logq.topk(k)  # [k] the first level, best first
    tokens, scores = [j], [score]
    parents = [torch.full((k,), -1, dtype=torch.long, device=j.device)]
    depths = [torch.zeros(k, dtype=torch.long, device=j.device)]
    beam = torch.arange(k, device=j.device)  # [k] the beam's candidate indices
    rows = None  # [k] the rows (of the level just run) the beam's nodes came from
    offset = k
    for level in range(depth - 1):
        logits = steps.step(target_ids(j, d2t), rows, level)  # [k, V]
        cum = torch.log_softmax(logits.float(), -1) + score[:, None]  # [k, V]
        child_score, child_j = cum.topk(k, -1)  # [k, k]
        tokens.append(child_j.reshape(-1))
        scores.append(child_score.reshape(-1))
        parents.append(beam[:, None].expand(k, k).reshape(-1))
        depths.append(torch.full((k * k,), level + 1, dtype=torch.long, device=j.device))
        score, best = child_score.reshape(-1).topk(k)  # [k] the next beam, best first
        j, rows, beam = child_j.reshape(-1)[best], best // k, offset + best
        offset += k * k
    tokens, scores, parents, depths = (torch.cat(x) for x in (tokens, scores, parents, depths))  # [C] each
    n = min(budget, scores.shape[0])
    keep = torch.sort(scores, descending=True, stable=True).indices[:n].sort().values  # [N] candidate order
    index = torch.full_like(parents, -1)  # [C] candidate -> its place among the kept
    index[keep] = torch.arange(n, device=keep.device)
    up = parents[keep]  # [N]
    up = torch.where(up >= 0, index[up.clamp(min=0)], up)  # [N] renumbered; -1 stays the root
    nodes = torch.stack([target_ids(tokens[keep], d2t), up, depths[keep]])  # [3, N]
    return nodes, ancestors(up, depth)


def run_loop(session: DraftSession, steps, key: tuple, loop):
    """``loop()`` on ``steps``: replayed from its CUDA graph on a GPU (captured on first use, and again when the
    session's buffers moved), called as it is elsewhere."""
    if steps.root_logits.device.type != "cuda":
        return loop()
    graphs = _GRAPHS.setdefault(steps, {})
    sig = steps.signature()
    if key not in graphs or graphs[key][0] != sig:
        graphs[key] = (sig, CapturedCall(loop, steps.root_logits.device))
    return graphs[key][1]()


def draft_capture_seconds(drafter) -> float:
    """Seconds spent capturing the draft loops of ``drafter`` (or of a session's) over its kept buffers so far (0 on
    a CPU, or for a drafter without fixed-shape steps)."""
    buffers = getattr(drafter, "draft_buffers", None)  # a drafter's (an nn.Module's .buffers is a method)
    if buffers is None:
        buffers = getattr(drafter, "buffers", None)  # a session's
    every = buffers.steps.values() if isinstance(buffers, DraftBuffers) else ()
    return sum(call.seconds for steps in every for _, call in _GRAPHS.get(steps, {}).values())


def device_chain(
    session: DraftSession, committed: Tensor, view: TargetView, depth: int, cap: int | None = None
) -> DraftTree | None:
    """A greedy chain of ``depth`` drafts on the device, cut to its first ``cap`` (the end of a generation: the loop
    keeps its one captured shape); None where the session has no fixed-shape steps."""
    if getattr(session, "static_steps", None) is None:
        return None
    logits = session.start_cycle(committed, view)  # [V_draft]
    steps = session.static_steps(1, depth)
    depth = min(depth, steps.max_levels)
    steps.begin(session, logits)
    drafts = run_loop(session, steps, ("chain", depth), lambda: chain_loop(steps, depth, session.d2t))
    tokens = target_ids(drafts, session.d2t).tolist()  # the one host read
    n = depth if cap is None else min(depth, cap)
    return DraftTree(tokens[:n], list(range(-1, n - 1)), list(range(n)))


def device_tree(
    session: DraftSession,
    committed: Tensor,
    view: TargetView,
    depth: int,
    top_k: int,
    budget: int,
    cap: int | None = None,
) -> DraftTree | None:
    """EAGLE-2's tree grown at fixed width on the device (:func:`beam_loop`), its nodes deeper than ``cap`` dropped
    (the end of a generation); None where the session has no fixed-shape steps. The tree keeps its ancestor matrix
    (``anc``) for the verify mask."""
    if getattr(session, "static_steps", None) is None:
        return None
    logits = session.start_cycle(committed, view)  # [V_draft]
    k = min(top_k, logits.shape[-1])
    steps = session.static_steps(k, depth)
    depth = min(depth, steps.max_levels)
    steps.begin(session, logits)
    key = ("tree", depth, k, budget)
    nodes, anc = run_loop(session, steps, key, lambda: beam_loop(steps, depth, k, budget, session.d2t))
    tokens, parents, depths = nodes.tolist()  # the one host read
    tree = DraftTree(tokens, parents, depths, anc=anc.clone())
    if (
        cap is not None and depths and max(depths) >= cap
    ):  # parents first: the shallow ones hold their ancestors
        tree = tree.subset([i for i, dd in enumerate(depths) if dd < cap])
    return tree
