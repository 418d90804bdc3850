"""Query-estimation error of a KV-reading drafter, measured against the target's real queries.

Notation: anchor ``t`` (the last position in the target's cache), draft step ``k = 0..K-1``, position
``p = t+1+k``. On target-greedy text (an MT-bench prompt plus the target's own greedy answer) the drafted
prefix equals the real one whenever every earlier step was accepted, so the target's post-RoPE query ``q*`` at
``(layer, head, p)`` is the ground truth for what the drafter's query at step ``k`` should be.

For one sequence (:func:`measure_sequence`):

1. the target runs once over the sequence and :func:`~kvshot_lib.target.capture` keeps the K/V and
   post-RoPE queries of the drafter's KV layers (and the hidden states a hybrid drafter fuses);
2. the drafter is unrolled K steps over every branch at once, as in training (``drafter.forward``): branch
   ``t`` reads the target's KV of ``0..t`` and its step ``k`` sits at ``p``; its target-reading queries are
   recorded (:func:`~.drafter_hooks.drafter_queries`), and its attention on the target's KV recomputed from
   them, the recency bias included, exactly as the drafter scores it;
3. for every (drafter layer, target layer, target head) pair of :func:`~.drafter_hooks.head_map`, every step
   and anchor, four estimates of the target's attention over the reused cache ``0..t`` are scored with
   :mod:`.attention_metrics`: the ``drafter``'s, the ``stale`` query (the target's own query at ``t``), the
   ``uniform`` distribution, and the ``oracle`` q* itself (zero error over the cache; its ``out_err_full``
   is what the unavailable positions alone cost). Group rows compare the GQA group's mean attention.

Each step is also marked accepted or not: the drafter's step-``k`` argmax equals the target's greedy token,
i.e. the event whose rate is α_k. :class:`QueryErrorTables` aggregates sequences into the saved tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..drafters.unroll import TrainBatch
from ..target.forward import sequence_features
from . import attention_metrics as am
from .drafter_hooks import (
    TargetAttentionRecorder,
    check_kv_reader,
    drafter_queries,
    head_map,
    query_in_key_space,
    target_query_in_key_space,
)

ESTIMATORS = ("drafter", "stale", "uniform", "oracle")
VARIANTS = ("with_sink", "without_sink")
EXTRA = ("own_mass",)


@dataclass
class TargetPass:
    """One target forward over a sequence: per layer ``queries [H, T, D]``, ``keys/values [kvH, T, D]``."""

    ids: Tensor  # [T]
    queries: dict[int, Tensor]
    keys: dict[int, Tensor]
    values: dict[int, Tensor]
    hidden: dict[int, Tensor]  # layer -> [T, H]


@torch.no_grad()
def target_pass(target, ids: Tensor, kv_layers, hidden_layers=()) -> TargetPass:
    f = sequence_features(target.model, ids[None], hidden_layers, kv_layers, query_layers=kv_layers)
    return TargetPass(
        ids.cpu(),
        {lay: f.queries[lay][0].float().cpu() for lay in kv_layers},
        {lay: f.keys[lay][0].float().cpu() for lay in kv_layers},
        {lay: f.values[lay][0].float().cpu() for lay in kv_layers},
        {lay: f.hidden[lay][0].float().cpu() for lay in hidden_layers},
    )


def sequence_batch(tp: TargetPass, cfg) -> TrainBatch:
    """The one-sequence training batch the drafter unrolls over (feature-store layout, float32)."""
    keys = torch.cat([tp.keys[lay].transpose(0, 1) for lay in cfg.kv_layers], dim=1)[None]  # [1, T, nI, D]
    values = torch.cat([tp.values[lay].transpose(0, 1) for lay in cfg.kv_layers], dim=1)[None]
    hidden = None
    if cfg.uses_hidden:
        hidden = torch.cat([tp.hidden[lay] for lay in cfg.hidden_layers], dim=-1)[None]  # [1, T, nL*H]
    T = tp.ids.shape[0]
    return TrainBatch(
        tp.ids[None], torch.ones(1, T, dtype=torch.bool), torch.tensor([T]), None, hidden, keys, values
    )


@dataclass
class SequenceErrors:
    """Every metric of one sequence. ``head[variant][metric]``: ``[E, P, K, A]`` (estimators, head pairs, steps,
    anchors); ``group[variant][metric]``: ``[E, Pg, K, A]``; ``valid [K, A]``; ``accepted [K, A]``."""

    seq_id: str
    anchors: Tensor  # [A] anchor positions t
    valid: Tensor  # [K, A] bool: step k of anchor t has a label inside the sequence
    accepted: Tensor  # [K, A] bool
    head: dict[str, dict[str, Tensor]]
    group: dict[str, dict[str, Tensor]]
    pairs: list[
        tuple[int, int, int, int]
    ]  # per head pair: (drafter layer, target layer, target head, kv head)
    groups: list[tuple[int, int, int]]  # per group pair: (drafter layer, target layer, kv head)
    maps: dict | None = None  # keep_maps: {"target": {layer: [H, K, A, T]}, "drafter": {dl: [h, K, A, T]}}


def pick_anchors(T: int, answer_start: int, max_anchors: int | None) -> Tensor:
    """Anchors ``t = answer_start-1 .. T-3`` (the root ``t+1`` is an answer token and step 0 has a label),
    evenly thinned to at most ``max_anchors``."""
    anchors = torch.arange(max(answer_start - 1, 1), T - 2)
    if max_anchors and anchors.numel() > max_anchors:
        anchors = anchors[torch.linspace(0, anchors.numel() - 1, max_anchors).round().long()]
    return anchors


@torch.no_grad()
def measure_sequence(
    target,
    drafter,
    ids: Tensor,
    answer_start: int,
    n_steps: int,
    seq_id: str = "",
    max_anchors=None,
    keep_maps: bool = False,
) -> SequenceErrors:
    """All metrics of ``drafter``'s queries on one target-greedy sequence ``ids [T]`` (see the module doc).

    ``keep_maps`` also keeps the attention distributions themselves (probabilities; the target's over
    ``0..p``, the drafter's over the reused cache ``0..t``), for the attention explorer."""
    check_kv_reader(drafter)
    cfg = drafter.cfg
    if cfg.target_kv != "real":
        raise ValueError(f"drafter {drafter.name!r} reads zeroed target KV: its queries score no real keys.")
    tp = target_pass(target, ids, cfg.kv_layers, cfg.hidden_layers)
    T = ids.shape[0]
    anchors = pick_anchors(T, answer_start, max_anchors)
    A, K = anchors.numel(), n_steps
    valid = (anchors[None] + 2 + torch.arange(K)[:, None]) <= T - 1  # [K, A]
    recorder = TargetAttentionRecorder(rows=anchors)
    batch = sequence_batch(tp, cfg)
    dev = drafter.head.device
    with drafter_queries(drafter) as records:
        un = drafter.forward(batch.to(dev), n_steps, recorder=recorder)
    accepted = torch.zeros(K, A, dtype=torch.bool)
    for k, out in enumerate(un.outs):
        pred = drafter.d2t[drafter.logits(out[0, anchors.to(dev)]).argmax(-1)].cpu()  # [A]
        label = ids[(anchors + 2 + k).clamp(max=T - 1)]
        accepted[k] = (pred == label) & valid[k]
    n_target_heads = tp.queries[cfg.kv_layers[0]].shape[0]
    pairs = head_map(cfg, n_target_heads)
    L = cfg.n_layers
    G = cfg.query_group
    g = n_target_heads // cfg.target_n_kv_heads
    head = {
        v: {m: torch.full((4, L * len(pairs), K, A), float("nan")) for m in (*am.METRICS, *EXTRA)}
        for v in VARIANTS
    }
    group = {
        v: {m: torch.full((4, L * cfg.n_injected_heads, K, A), float("nan")) for m in (*am.METRICS, *EXTRA)}
        for v in VARIANTS
    }
    cols = torch.arange(T)
    D, nI = cfg.target_head_dim, cfg.n_injected_heads
    maps = None
    if keep_maps:
        maps = {
            "target": {lay: torch.zeros(n_target_heads, K, A, T) for lay in cfg.kv_layers},
            "drafter": {dl: torch.zeros(nI * G, K, A, T) for dl in range(L)},
        }
    for dl in range(L):
        layer = drafter.layers[dl]
        k_inj = un.injected[dl][0][0].float().cpu()  # [nI, T, D] the keys as this layer reads them
        recency = getattr(layer, "recency", None)
        for k in range(K):
            ok = valid[k]
            t, p = anchors[ok], anchors[ok] + 1 + k  # [a]
            if t.numel() == 0:
                continue
            q_d = records[k * L + dl].q[0][:, t].float().cpu()  # [h, a, D]
            share = recorder.probs[(dl, k)][0][..., ok, :].float().cpu()  # [nI, G, a, N]
            reused = cols[None] <= t[:, None]  # [a, T]
            upto_p = cols[None] <= p[:, None]
            bias = recency((p[:, None] - cols[None]).to(dev)).float().cpu() if recency is not None else None
            for i in range(nI):
                lay, j = cfg.kv_layers[i // cfg.target_n_kv_heads], i % cfg.target_n_kv_heads
                Kt, Vt = tp.keys[lay][j], tp.values[lay][j]  # [T, D]
                heads = list(range(j * g, (j + 1) * g))
                q_star = tp.queries[lay][heads][:, p]  # [g, a, D]
                q_stale = tp.queries[lay][heads][:, t]
                s_star = q_star @ Kt.T * D**-0.5  # [g, a, T]
                logp_full = am.masked_log_softmax(s_star, upto_p)
                logp_star = am.masked_log_softmax(s_star, reused)
                logp_stale = am.masked_log_softmax(q_stale @ Kt.T * D**-0.5, reused)
                logp_unif = am.uniform_log_probs(reused).expand(g, -1, -1)
                qd = q_d[i * G : (i + 1) * G]  # [G, a, D] the drafter's queries reading injected head i
                s_hat = qd @ k_inj[i].T * D**-0.5  # [G, a, T] the drafter's own scores on the target's keys
                if bias is not None:
                    s_hat = s_hat + bias[i * G : (i + 1) * G]
                logp_hat = am.masked_log_softmax(s_hat, reused)
                if maps is not None:
                    maps["target"][lay][j * g : (j + 1) * g, k, ok] = logp_full.exp()  # [g, a, T]
                    maps["drafter"][dl][i * G : (i + 1) * G, k, ok] = logp_hat.exp()  # [G, a, T]
                own = 1 - share[i].sum(-1)  # [G, a] the drafter's attention on its own K/V (one softmax)
                if getattr(cfg, "kv_softmax", "shared") == "separate":
                    own = torch.full_like(own, float("nan"))  # two softmaxes: no share to report
                mine = [(dl * len(pairs) + pi, pr) for pi, pr in enumerate(pairs) if pr.injected == i]
                scores = GroupScores(i, j * g, t, reused, Vt, logp_hat, logp_star, logp_full, logp_stale, logp_unif,
                                     qd, q_star, q_stale, own)  # fmt: skip
                if mine:
                    _score_pairs(head, mine, layer, nI, k, ok, scores)
                mean = lambda lp: torch.log(lp.exp().mean(0))  # noqa: E731  [g, a, T] -> [a, T]
                stacked = torch.cat(
                    [mean(x) for x in (logp_hat, logp_stale, logp_unif, logp_star)]
                )  # [4a, T]
                n4 = len(ESTIMATORS)
                mets = am.all_metrics(
                    stacked,
                    mean(logp_star).repeat(n4, 1),
                    reused.repeat(n4, 1),
                    Vt,
                    mean(logp_full).repeat(n4, 1),
                    t.repeat(n4),
                )
                _scatter(group, mets, [dl * nI + i], k, ok, own.mean(0)[None])
    return SequenceErrors(
        seq_id,
        anchors,
        valid,
        accepted,
        head,
        group,
        [(dl, pr.layer, pr.target_head, pr.kv_head, pr.drafter_head) for dl in range(L) for pr in pairs],
        [
            (dl, cfg.kv_layers[i // cfg.target_n_kv_heads], i % cfg.target_n_kv_heads)
            for dl in range(L)
            for i in range(nI)
        ],
        maps,
    )


@dataclass
class GroupScores:
    """What the four estimates give for one injected head ``i`` (one GQA group of ``g`` target heads from ``h0``,
    read by ``G`` drafter heads) at one draft step, over the ``a`` anchors valid there."""

    i: int  # the injected head
    h0: int  # the group's first target head
    t: Tensor  # [a] anchor positions
    reused: Tensor  # [a, T] the cache positions a drafter at t can read
    Vt: Tensor  # [T, D] the group's values
    logp_hat: Tensor  # [G, a, T] the drafter's attention (log-probs) over the reused cache
    logp_star: Tensor  # [g, a, T] the target's real query, over the same positions
    logp_full: Tensor  # [g, a, T] ... over 0..p (all it sees)
    logp_stale: Tensor  # [g, a, T] the stale query (the target's at t)
    logp_unif: Tensor  # [g, a, T] uniform attention
    qd: Tensor  # [G, a, D] the drafter's queries
    q_star: Tensor  # [g, a, D] the target's real queries
    q_stale: Tensor  # [g, a, D]
    own: Tensor  # [G, a] the drafter's attention share on its own K/V


def _score_pairs(head, mine, layer, nI: int, k: int, ok: Tensor, s: GroupScores) -> None:
    """Metrics of the four estimates for the head pairs ``mine`` that read injected head ``s.i``, in one batch."""
    i, h0, t, qd, q_star = s.i, s.h0, s.t, s.qd, s.q_star
    lps, qhs, stars, fulls, qstars = [], [], [], [], []
    a = t.numel()
    nan = torch.full((a, nI * q_star.shape[-1]), float("nan"))
    for _, pr in mine:
        r, a_d = pr.target_head - h0, pr.drafter_head - i * qd.shape[0]  # within the group / the drafter's G
        q_hat = query_in_key_space(layer, qd[a_d], i, nI)
        q_s = target_query_in_key_space(q_star[r], i, nI)
        lps += [s.logp_hat[a_d], s.logp_stale[r], s.logp_unif[r], s.logp_star[r]]
        qhs += [nan if q_hat is None else q_hat, target_query_in_key_space(s.q_stale[r], i, nI), nan, q_s]
        stars.append(s.logp_star[r])
        fulls.append(s.logp_full[r])
        qstars.append(q_s)
    n4 = len(ESTIMATORS)
    rep = lambda xs: torch.cat([x.repeat(n4, 1) for x in xs])  # noqa: E731  per pair, once per estimator
    mets = am.all_metrics(
        torch.cat(lps),
        rep(stars),
        s.reused.repeat(n4 * len(mine), 1),
        s.Vt,
        rep(fulls),
        t.repeat(n4 * len(mine)),
        torch.cat(qhs),
        rep(qstars),
    )
    owns = torch.stack([s.own[pr.drafter_head - i * qd.shape[0]] for _, pr in mine])  # [n_pairs, a]
    _scatter(head, mets, [c for c, _ in mine], k, ok, owns)


def _scatter(out, mets, cols: list[int], k: int, ok: Tensor, own: Tensor) -> None:
    """Put rows ordered (column, estimator, anchor) back into ``out[variant][metric][E, col, k, anchors]``."""
    n4, a = len(ESTIMATORS), int(ok.sum())
    for variant, rows in mets.items():
        for name, val in rows.items():
            v = val.float().view(len(cols), n4, a)
            for c, col in enumerate(cols):
                out[variant][name][:, col, k, ok] = v[c]
        for c, col in enumerate(cols):
            out[variant]["own_mass"][0, col, k, ok] = own[c]
