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
   :class:`Scorer` does it per drafter layer and step, then per injected head (one GQA group).

Each step is also marked accepted or not: the drafter's step-``k`` argmax equals the target's greedy token,
i.e. the event whose rate is α_k. :class:`QueryErrorTables` aggregates sequences into the saved tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..drafters import DrafterConfig, TrainBatch
from ..drafters.trainable import TrainableDrafter
from ..target import Target
from ..target.forward import sequence_features
from . import attention_metrics as am
from .drafter_hooks import (
    HeadPair,
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
def target_pass(target: Target, ids: Tensor, kv_layers, hidden_layers=()) -> TargetPass:
    f = sequence_features(target.model, ids[None], hidden_layers, kv_layers, query_layers=kv_layers)
    one = lambda by_layer: {lay: x[0].float().cpu() for lay, x in by_layer.items()}  # noqa: E731
    return TargetPass(ids.cpu(), one(f.queries), one(f.keys), one(f.values), one(f.hidden))


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
    pairs: list[tuple[int, ...]]  # per head pair: (drafter layer, target layer, head, kv head, drafter head)
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
    target: Target,
    drafter: TrainableDrafter,
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
    K, A, L, nI, kvh = n_steps, anchors.numel(), cfg.n_layers, cfg.n_injected_heads, cfg.target_n_kv_heads
    valid = (anchors[None] + 2 + torch.arange(K)[:, None]) <= T - 1  # [K, A]
    recorder = TargetAttentionRecorder(rows=anchors)
    dev = drafter.head.device
    with drafter_queries(drafter) as records:
        un = drafter.forward(sequence_batch(tp, cfg).to(dev), n_steps, recorder=recorder)
    accepted = torch.zeros(K, A, dtype=torch.bool)
    for k, out in enumerate(un.outs):
        pred = drafter.d2t[drafter.logits(out[0, anchors.to(dev)]).argmax(-1)].cpu()  # [A]
        accepted[k] = (pred == ids[(anchors + 2 + k).clamp(max=T - 1)]) & valid[k]
    n_target_heads = tp.queries[cfg.kv_layers[0]].shape[0]
    pairs = head_map(cfg, n_target_heads)
    maps = None
    if keep_maps:
        maps = {
            "target": {lay: torch.zeros(n_target_heads, K, A, T) for lay in cfg.kv_layers},
            "drafter": {dl: torch.zeros(nI * cfg.query_group, K, A, T) for dl in range(L)},
        }
    se = SequenceErrors(
        seq_id=seq_id,
        anchors=anchors,
        valid=valid,
        accepted=accepted,
        head=unscored(L * len(pairs), K, A),
        group=unscored(L * nI, K, A),
        pairs=[
            (dl, pr.layer, pr.target_head, pr.kv_head, pr.drafter_head) for dl in range(L) for pr in pairs
        ],
        groups=[(dl, cfg.kv_layers[i // kvh], i % kvh) for dl in range(L) for i in range(nI)],
        maps=maps,
    )
    scorer = Scorer(se, tp, cfg, pairs)
    for dl, layer in enumerate(drafter.layers):
        k_inj = un.injected[dl][0][0].float().cpu()  # [nI, T, D] the keys as this layer reads them
        for k in range(K):
            if valid[k].any():
                scorer.step(layer, dl, k, records[k * L + dl].q[0], recorder.probs[(dl, k)][0], k_inj)
    return se


def unscored(n_cols: int, K: int, A: int) -> dict[str, dict[str, Tensor]]:
    """``[variant][metric]``: ``[E, n_cols, K, A]`` of NaN, for the :class:`Scorer` to fill."""
    shape = (len(ESTIMATORS), n_cols, K, A)
    return {v: {m: torch.full(shape, float("nan")) for m in (*am.METRICS, *EXTRA)} for v in VARIANTS}


@dataclass
class Step:
    """Drafter layer ``dl`` at draft step ``k``, over the ``a`` anchors valid there."""

    dl: int
    k: int
    ok: Tensor  # [A] bool: the anchors whose step k has a label
    t: Tensor  # [a] their positions
    p: Tensor  # [a] the drafted positions t+1+k
    reused: Tensor  # [a, T] the cache positions a drafter at t can read: 0..t
    upto_p: Tensor  # [a, T] the positions the target's query at p sees: 0..p


@dataclass
class Scorer:
    """Fills a :class:`SequenceErrors` one drafter layer and draft step at a time (:meth:`step`), one injected
    head there at a time (:meth:`head`: the four estimates of the target's attention), each head pair and GQA
    group in one batch of rows (:meth:`columns`)."""

    se: SequenceErrors
    tp: TargetPass
    cfg: DrafterConfig
    pairs: list[HeadPair]  # head_map's

    def step(self, layer: nn.Module, dl: int, k: int, q: Tensor, share: Tensor, k_inj: Tensor) -> None:
        """Every injected head of ``layer`` at step ``k``, from its target-reading queries ``q [h, N, D]``,
        its attention on the target's keys ``share [nI, G, A, N]`` and those keys as it reads them
        ``k_inj [nI, T, D]``."""
        cfg, anchors, ok = self.cfg, self.se.anchors, self.se.valid[k]
        G, D = cfg.query_group, cfg.target_head_dim
        t, p = anchors[ok], anchors[ok] + 1 + k  # [a]
        cols = torch.arange(self.tp.ids.numel())
        st = Step(dl, k, ok, t, p, reused=cols[None] <= t[:, None], upto_p=cols[None] <= p[:, None])
        q_d = q[:, t].float().cpu()  # [h, a, D]
        share = share[..., ok, :].float().cpu()  # [nI, G, a, N]
        recency = getattr(layer, "recency", None)
        bias = recency((p[:, None] - cols[None]).to(q.device)).float().cpu() if recency is not None else None
        for i in range(cfg.n_injected_heads):
            qd = q_d[i * G : (i + 1) * G]  # [G, a, D] the drafter's queries reading injected head i
            s_hat = qd @ k_inj[i].T * D**-0.5  # [G, a, T] the drafter's own scores on the target's keys
            if bias is not None:
                s_hat = s_hat + bias[i * G : (i + 1) * G]
            own = 1 - share[i].sum(-1)  # [G, a] the drafter's attention on its own K/V (one softmax)
            if cfg.kv_softmax == "separate":
                own = torch.full_like(own, float("nan"))  # two softmaxes: no share to report
            self.head(layer, st, i, qd, s_hat, own)

    def head(self, layer: nn.Module, st: Step, i: int, qd: Tensor, s_hat: Tensor, own: Tensor) -> None:
        """Injected head ``i``: one GQA group of ``g`` target heads, read by the ``G`` drafter queries
        ``qd [G, a, D]`` with scores ``s_hat [G, a, T]``; ``own [G, a]``: their attention on their own K/V."""
        cfg, tp, maps = self.cfg, self.tp, self.se.maps
        kvh, D, nI, G = cfg.target_n_kv_heads, cfg.target_head_dim, cfg.n_injected_heads, cfg.query_group
        lay, j = cfg.kv_layers[i // kvh], i % kvh
        g = tp.queries[lay].shape[0] // kvh
        Kt, Vt = tp.keys[lay][j], tp.values[lay][j]  # [T, D]
        heads = list(range(j * g, (j + 1) * g))
        q_star = tp.queries[lay][heads][:, st.p]  # [g, a, D] the target's real queries
        q_stale = tp.queries[lay][heads][:, st.t]  # its queries at t
        s_star = q_star @ Kt.T * D**-0.5  # [g, a, T]
        logp_full = am.masked_log_softmax(s_star, st.upto_p)  # [g, a, T] all the target sees at p: 0..p
        # estimator -> [n, a, T] over the reused cache: the drafter's per drafter head, the others per target head
        logp = {
            "drafter": am.masked_log_softmax(s_hat, st.reused),
            "stale": am.masked_log_softmax(q_stale @ Kt.T * D**-0.5, st.reused),
            "uniform": am.uniform_log_probs(st.reused).expand(g, -1, -1),
            "oracle": am.masked_log_softmax(s_star, st.reused),
        }
        if maps is not None:
            maps["target"][lay][j * g : (j + 1) * g, st.k, st.ok] = logp_full.exp()  # [g, a, T]
            maps["drafter"][st.dl][i * G : (i + 1) * G, st.k, st.ok] = logp["drafter"].exp()  # [G, a, T]
        mine = [(st.dl * len(self.pairs) + c, pr) for c, pr in enumerate(self.pairs) if pr.injected == i]
        if mine:
            nan = torch.full((st.t.numel(), nI * D), float("nan"))
            rows = []
            for _, pr in mine:
                r, a_d = pr.target_head - j * g, pr.drafter_head - i * G  # within the group / the drafter's G
                q_hat = query_in_key_space(layer, qd[a_d], i, nI)
                q_s = target_query_in_key_space(q_star[r], i, nI)
                lps = [logp[e][a_d if e == "drafter" else r] for e in ESTIMATORS]
                qs = [nan if q_hat is None else q_hat, target_query_in_key_space(q_stale[r], i, nI), nan, q_s]
                rows.append((lps, logp["oracle"][r], logp_full[r], qs, q_s))
            owns = torch.stack([own[pr.drafter_head - i * G] for _, pr in mine])  # [n_pairs, a]
            self.columns(self.se.head, [c for c, _ in mine], st, Vt, rows, owns)
        mean = lambda lp: torch.log(lp.exp().mean(0))  # noqa: E731  [n, a, T] -> [a, T]
        group = ([mean(logp[e]) for e in ESTIMATORS], mean(logp["oracle"]), mean(logp_full), None, None)
        self.columns(self.se.group, [st.dl * nI + i], st, Vt, [group], own.mean(0)[None])

    @staticmethod
    def columns(out, cols: list[int], st: Step, Vt: Tensor, rows: list[tuple], own: Tensor) -> None:
        """Every metric of ``rows`` in one batch, put into ``out[variant][metric][:, cols, st.k, st.ok]``. Per
        column: the estimators' log-probs, the target's over the reused cache and over ``0..p`` (each ``[a, T]``),
        the estimators' and the target's queries in the key space (or None); ``own [len(cols), a]``."""
        n4, n = len(ESTIMATORS), len(rows)
        rep = lambda xs: torch.cat([x.repeat(n4, 1) for x in xs])  # noqa: E731  per column, once per estimator
        lps, stars, fulls, qs, q_stars = zip(*rows)
        mets = am.all_metrics(
            torch.cat([lp for col in lps for lp in col]),
            rep(stars),
            st.reused.repeat(n4 * n, 1),
            Vt,
            rep(fulls),
            st.t.repeat(n4 * n),
            None if qs[0] is None else torch.cat([q for col in qs for q in col]),
            None if q_stars[0] is None else rep(q_stars),
        )
        _scatter(out, mets, cols, st.k, st.ok, own)


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
