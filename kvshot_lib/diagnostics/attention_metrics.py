"""How far one attention distribution is from another over the same keys: the metrics of query-estimation error.

Every function takes a batch of rows (one row = one query: an anchor position, a draft step, a head) and
works on the *reused cache*, the target's key positions ``0..t`` that a drafter reading the KV cache sees.
Positions outside it are masked (``mask`` False). Inputs are log-probabilities over the same ``S`` columns:

* ``logp_star``: the target's attention at ``p = t+1+k`` restricted to ``0..t`` and renormalized;
* ``logp_hat``: the estimate's (the drafter's, a stale query's, the uniform distribution's).

Metrics (all per row; bits where information is measured):

* ``cosine``, ``rel_l2`` ``= |q̂ - q*| / |q*|`` and ``norm_ratio`` ``= |q̂| / |q*|`` (a temperature) of the
  queries themselves, when the estimate is a query in the target's key space;
* ``kl_bits`` ``= KL(p* || p̂)`` and ``js_bits`` (Jensen-Shannon, in ``[0, 1]``);
* ``recall@k``: the share of p*'s top-k positions that are also in p̂'s top-k, and ``mass@k``: the
  target's mass on p̂'s top-k over its mass on its own top-k (k = 1, 4, 16; fewer when fewer positions);
* ``out_err`` ``= |Σ p̂_j v_j - Σ p*_j v_j| / |Σ p*_j v_j|`` over the target's values: what a reader of the
  cache actually consumes, hence the primary metric;
* ``unavailable_mass``: the target's own attention at ``p`` on ``t+1..p``, positions no reused cache holds.

:func:`drop_sink` removes the first key position (the attention sink) and renormalizes, so every metric is
also reported without it. ``tests/test_diagnostics.py`` checks each against values computed by hand.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

TOP_K = (1, 4, 16)
LN2 = math.log(2.0)
DISTRIBUTION_METRICS = (
    "kl_bits",
    "js_bits",
    *(f"recall@{k}" for k in TOP_K),
    *(f"mass@{k}" for k in TOP_K),
)
VECTOR_METRICS = ("cosine", "rel_l2", "norm_ratio")
METRICS = (*VECTOR_METRICS, *DISTRIBUTION_METRICS, "out_err", "out_err_full", "unavailable_mass")


def masked_log_softmax(scores: Tensor, mask: Tensor) -> Tensor:
    """``log softmax`` of ``scores [..., S]`` over the visible columns (``mask`` True); -inf elsewhere."""
    return torch.log_softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)


def uniform_log_probs(mask: Tensor) -> Tensor:
    """The uniform distribution over each row's visible columns, as log-probabilities ``[..., S]``."""
    return masked_log_softmax(torch.zeros(mask.shape, dtype=torch.float32, device=mask.device), mask)


def drop_sink(logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """The same distributions without column 0 (the sink), renormalized: ``([..., S-1], [..., S-1])``."""
    rest, m = logp[..., 1:], mask[..., 1:]
    return masked_log_softmax(rest, m), m


def vector_metrics(q_hat: Tensor, q_star: Tensor) -> dict[str, Tensor]:
    """Cosine, relative L2 and norm ratio of query estimates ``q_hat [n, D]`` against ``q_star [n, D]``."""
    n_hat, n_star = q_hat.norm(dim=-1), q_star.norm(dim=-1)  # [n]
    return {
        "cosine": (q_hat * q_star).sum(-1) / (n_hat * n_star),
        "rel_l2": (q_hat - q_star).norm(dim=-1) / n_star,
        "norm_ratio": n_hat / n_star,
    }


def _plogp_ratio(logp: Tensor, logq: Tensor) -> Tensor:
    """``Σ p (log p - log q)`` per row, with ``0 log 0 = 0``."""
    p = logp.exp()
    diff = torch.where(p > 0, logp - logq, torch.zeros_like(logp))
    return (p * diff).sum(-1)


def _ranks(logp: Tensor, top: int = max(TOP_K)) -> Tensor:
    """Rank of every column in its row by decreasing probability (0 = the largest), for the ``top`` largest;
    every other column gets ``top`` (a top-k membership needs no more, and a full sort costs far more)."""
    k = min(top, logp.shape[-1])
    idx = logp.topk(k, dim=-1).indices  # [n, k]
    ranks = torch.full(logp.shape, top, dtype=torch.long, device=logp.device)
    return ranks.scatter_(-1, idx, torch.arange(k, device=logp.device).expand_as(idx))


def distribution_metrics(logp_hat: Tensor, logp_star: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """KL(p* || p̂), JS, top-k recall and mass recall of rows ``[n, S]`` over the visible columns."""
    p_hat, p_star = logp_hat.exp(), logp_star.exp()
    log_m = torch.log((p_hat + p_star) / 2)
    out = {
        "kl_bits": _plogp_ratio(logp_star, logp_hat) / LN2,
        "js_bits": (0.5 * _plogp_ratio(logp_star, log_m) + 0.5 * _plogp_ratio(logp_hat, log_m)) / LN2,
    }
    n_visible = mask.sum(-1)  # [n]
    rank_hat, rank_star = _ranks(logp_hat), _ranks(logp_star)
    for k in TOP_K:
        k_eff = n_visible.clamp(max=k)[:, None]  # [n, 1]
        in_hat = (rank_hat < k_eff) & mask  # [n, S]
        in_star = (rank_star < k_eff) & mask
        out[f"recall@{k}"] = (in_hat & in_star).sum(-1) / k_eff[:, 0]
        out[f"mass@{k}"] = (p_star * in_hat).sum(-1) / (p_star * in_star).sum(-1)
    return out


def output_error(logp_hat: Tensor, logp_star: Tensor, values: Tensor) -> Tensor:
    """``|Σ p̂ v - Σ p* v| / |Σ p* v|`` per row; ``values [S, D]`` are the target's (same columns)."""
    o_hat = logp_hat.exp() @ values  # [n, D]
    o_star = logp_star.exp() @ values
    return (o_hat - o_star).norm(dim=-1) / o_star.norm(dim=-1)


def unavailable_mass(logp_full: Tensor, anchors: Tensor) -> Tensor:
    """The share of each row's attention (over ``0..p``, ``logp_full [n, S]``) on columns after its anchor t."""
    cols = torch.arange(logp_full.shape[-1], device=logp_full.device)
    return (logp_full.exp() * (cols[None] > anchors[:, None])).sum(-1)  # [n]


def all_metrics(
    logp_hat: Tensor,
    logp_star: Tensor,
    mask: Tensor,
    values: Tensor,
    logp_full: Tensor,
    anchors: Tensor,
    q_hat: Tensor | None = None,
    q_star: Tensor | None = None,
) -> dict[str, dict[str, Tensor]]:
    """Every metric with the sink and without it: ``{"with_sink": {metric: [n]}, "without_sink": {...}}``.

    ``logp_full [n, S]`` is the target's attention over ``0..p`` (for ``unavailable_mass`` and ``out_err_full``,
    the error against the target's real output, unavailable positions included); ``anchors [n]`` holds t."""
    n = logp_hat.shape[0]
    nan = torch.full((n,), float("nan"), device=logp_hat.device)
    vec = vector_metrics(q_hat, q_star) if q_hat is not None else dict.fromkeys(VECTOR_METRICS, nan)
    out = {}
    for variant in ("with_sink", "without_sink"):
        if variant == "with_sink":
            lh, ls, m, v, lf = logp_hat, logp_star, mask, values, logp_full
        else:
            lh, m = drop_sink(logp_hat, mask)
            ls, _ = drop_sink(logp_star, mask)
            lf, _ = drop_sink(logp_full, torch.isfinite(logp_full))
            v = values[1:]
        full_out = lf.exp() @ v  # [n, D] the target's real output (over 0..p)
        rows = dict(vec)
        rows.update(distribution_metrics(lh, ls, m))
        rows["out_err"] = output_error(lh, ls, v)
        rows["out_err_full"] = (lh.exp() @ v - full_out).norm(dim=-1) / full_out.norm(dim=-1)
        rows["unavailable_mass"] = unavailable_mass(lf, anchors - int(variant == "without_sink"))
        out[variant] = rows
    return out
