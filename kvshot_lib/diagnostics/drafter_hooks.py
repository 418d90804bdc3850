"""What a KV-reading drafter's attention does to the target's cache, seen from outside the drafter.

* :func:`head_map`: which target (layer, query head) each drafter query head stands for. The drafter's
  injected KV heads are the target's KV heads of ``kv_layers`` side by side (injected head ``i`` = target layer
  ``kv_layers[i // kvH]``, KV head ``i % kvH``); it has ``query_group`` query heads per injected head. With
  ``query_group`` equal to the target's GQA group ``g``, drafter head ``a`` of injected head ``i`` is target
  query head ``(i % kvH) * g + a % g``. With ``query_group = 1`` its one query serves the whole group, so it
  is compared with each of the group's ``g`` heads (and, for the causal check, with the one it matches best).
* :func:`drafter_queries`: a context manager that records the post-RoPE query of every attention that reads
  the target's KV (KV-only: the layer's self-attention; hybrid: its cross-attention), per drafter layer and
  call, with the positions it ran at; given ``replace``, it substitutes the query before the drafter uses it
  (the causal check of :mod:`.causal_check`). Everything is undone in ``finally``.
* :class:`TargetAttentionRecorder`: the drafter's attention recorder (``segmented_attention`` calls it) that
  keeps the weights on the target's KV segment, for chosen rows only.
* :func:`query_in_key_space`: the drafter's query taken into the target's key space, ``q̂ = Wᵀ q_d``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import Tensor, nn


@dataclass(frozen=True)
class HeadPair:
    drafter_head: int  # query head index in the drafter's target-reading attention
    injected: int  # injected KV head it reads
    layer: int  # target layer
    kv_head: int  # target KV head within the layer
    target_head: int  # target query head within the layer


def check_kv_reader(drafter) -> None:
    cfg = drafter.cfg
    if not cfg.uses_target_kv:
        raise ValueError(
            f"drafter {drafter.name!r} ({cfg.paradigm}) reads no target KV; query-estimation error is defined "
            "for KV-only and hybrid drafters."
        )


def head_map(cfg, n_target_heads: int) -> list[HeadPair]:
    """Every (drafter query head, target query head) pair that corresponds; see the module docstring.

    A ``query_group`` other than 1 or the target's group has no per-head correspondence: the list is then
    empty and only group-level metrics apply."""
    kvh = cfg.target_n_kv_heads
    g = n_target_heads // kvh
    G = cfg.query_group
    pairs = []
    for i in range(cfg.n_injected_heads):
        layer, j = cfg.kv_layers[i // kvh], i % kvh
        for r in range(g):
            if G == g:
                pairs.append(HeadPair(i * G + r, i, layer, j, j * g + r))
            elif G == 1:
                pairs.append(HeadPair(i, i, layer, j, j * g + r))
    return pairs


def reading_attention(layer: nn.Module):
    """The attention of a drafter layer whose queries score the target's keys."""
    return layer.cross_attn if hasattr(layer, "cross_attn") else layer.self_attn


@dataclass
class QueryRecord:
    layer: int  # drafter layer
    q: Tensor  # [B, h, n, D] post-RoPE, as the drafter used it
    positions: Tensor  # [n]


@contextmanager
def drafter_queries(
    drafter, replace: Callable[[int, Tensor, Tensor], Tensor] | None = None, keep: bool = True
) -> Iterator[list[QueryRecord]]:
    """Record (and optionally replace) the target-reading queries of ``drafter`` in every forward inside.

    ``replace(layer, q [B, h, n, D], positions [n]) -> q`` returns the query the drafter should use instead.
    Positions are those of the drafter's last ``rope`` call, which both the training unroll and the decode
    session make right before running the layers."""
    check_kv_reader(drafter)
    records: list[QueryRecord] = []
    last = {"positions": None}
    rope = drafter.rope
    patched = []

    def rope_hook(positions, bound=None):
        last["positions"] = positions
        return rope(positions, bound)

    def make_query_hook(li, attn):
        query = attn.query

        def query_hook(x, cos, sin):
            q = query(x, cos, sin)  # [B, h, n, D]
            pos = last["positions"]
            if replace is not None:
                q = replace(li, q, pos)
            if keep:
                records.append(QueryRecord(li, q.detach(), pos))
            return q

        return query_hook

    try:
        drafter.rope = rope_hook
        for li, layer in enumerate(drafter.layers):
            attn = reading_attention(layer)
            attn.query = make_query_hook(li, attn)
            patched.append(attn)
        yield records
    finally:
        if "rope" in drafter.__dict__:
            del drafter.rope
        for attn in patched:
            if "query" in attn.__dict__:
                del attn.query


class TargetAttentionRecorder:
    """Keeps the drafter's attention weights on the target's KV, ``rows`` of every (drafter layer, step).

    ``probs[(layer, step)]``: ``[B, kvH, G, len(rows), S]``, normalized over everything the query saw (its own
    K/V too); their sum over S is the share of attention that went to the target's cache."""

    def __init__(self, rows: Tensor | None = None):
        self.rows = rows
        self.step: dict[int, int] = defaultdict(int)
        self.probs: dict[tuple[int, int], Tensor] = {}

    def own_kv(self, layer: int, step: int, k: Tensor, v: Tensor) -> None:
        self.step[layer] = step

    def attention(self, segments: list, probs: list[Tensor]) -> None:
        for seg, p in zip(segments, probs):
            if seg.tag is not None and seg.tag[0] == "target":
                layer = seg.tag[1]
                rows = p if self.rows is None else p[:, :, :, self.rows]
                self.probs[(layer, self.step[layer])] = rows.detach()


def query_in_key_space(layer: nn.Module, q: Tensor, injected: int, n_injected: int) -> Tensor | None:
    """``q̂``: the drafter query ``q [n, D]`` of a head reading injected head ``injected``, as a query on the
    target's keys of *all* injected heads side by side ``[n, n_inj * D]``, so that ``q̂ · k_all = q · k'`` is
    the drafter's own score. Head concatenation: ``q`` in block ``injected``. Linear key map ``k' = W k``:
    ``q̂ = W_iᵀ q`` (rows of ``W`` for that head). With RoPE undone and redone around the map there is no such
    single vector (the effective query changes with the key position): ``None``.
    ``tests/test_diagnostics.py`` checks that ``q̂`` reproduces the drafter's scores exactly."""
    inject = layer.inject
    n, D = q.shape
    if inject.mode == "concat":
        return target_query_in_key_space(q, injected, n_injected)
    if inject.mode == "linear":
        W = inject.k_map.weight  # [n_inj*D, n_inj*D]: k'_all = W k_all
        return q @ W[injected * D : (injected + 1) * D].to(q.dtype)  # [n, n_inj*D]
    return None


def target_query_in_key_space(q: Tensor, injected: int, n_injected: int) -> Tensor:
    """A target query ``q [n, D]`` of injected head ``injected`` in the same side-by-side key space."""
    n, D = q.shape
    out = q.new_zeros(n, n_injected * D)
    out[:, injected * D : (injected + 1) * D] = q
    return out
