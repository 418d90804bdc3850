"""The training objectives of the three regimes, and per-step accuracy.

All three share the unrolled forward of :mod:`kvshot_lib.drafters.unroll` (step ``k`` of branch ``i``
predicts token ``i+2+k``; its label is the target's distribution at position ``i+1+k``) and the soft
cross-entropy against the target's distribution over the draft vocabulary (EAGLE-3: the target's logits
restricted to the draft vocabulary, then softmax). A step's loss averages over the branches whose
predicted token is an assistant token inside the sequence.

* **Teacher forcing** (``tf``): step 0 only; optionally EAGLE's feature regression for the drafters that
  fuse hidden states (``feature_loss_weight``): the output hidden state is regressed onto the fused
  target feature of the next position (what step 1 would read in its place).
* **TTT** (``ttt``): ``K`` steps (7) on the drafter's own outputs with EAGLE-3's masks; step ``i`` weighs
  ``step_decay**i`` (0.8).
* **TTT with dense per-position losses** (``ttt_dense``): TTT's sequential unroll of ``K`` steps, with the same
  attention pattern, and *every unrolled position has its own direct target*, with weight 1 at every step:
  - the token: soft cross-entropy at every unrolled position (no 0.8^i decay);
  - the drafter's own **K/V at every unrolled position**, for every layer (``kv_align_weight``): KV-only
    drafters regress their own K/V of a drafted position onto the target's KV at that same position (as
    their injector presents it; a linear injector's output is detached), because the two sit in the same
    softmax; hidden and hybrid drafters regress the K/V of drafted position ``i+1+k`` onto the (detached)
    K/V their step 0 computed at that position from the target's real features. The K/V projections thus
    get a dense gradient at every unrolled position, not only what trickles back through attention;
  - the output hidden state of every unrolled position (hidden, hybrid; ``feature_loss_weight``) onto the
    fused target feature of the next position, i.e. what the next unrolled position should be reading.
  All regressions are relative MSEs (squared error over the target's mean square), so they are scale-free.
* **Parallel** (``parallel``, the block drafter of ``drafters/block.py``): one forward drafts a whole block of
  ``K`` mask positions after each *anchor*; branch ``i``'s step ``k`` is the block's position ``i+2+k``, so
  the same soft cross-entropy applies, at every block position, weighted ``step_decay**k`` (0.8; DFlash's
  ``exp(-(k-1)/gamma)`` with gamma = 4.5). The anchors are random per sequence and step
  (:func:`sample_anchors`), among the positions whose next token is an assistant token, as in DFlash.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..drafters.trainable import TrainableDrafter
from ..drafters.unroll import TrainBatch, Unrolled, shifted


def target_probs(final_hidden: Tensor, head: Tensor) -> Tensor:
    """The target's next-token distribution restricted to the draft vocabulary: ``[B, T, V_draft]``. Always
    in float32, outside any autocast: these are the labels, and a bf16 logit of 20 is off by up to 0.06."""
    with torch.autocast(final_hidden.device.type, enabled=False):
        return torch.softmax(final_hidden.float() @ head.float().T, dim=-1)


def answer_positions(loss_mask: Tensor) -> Tensor:
    """``[..., T]``: each assistant token's index within its own answer (a run of the mask), -1 elsewhere."""
    m = loss_mask.bool()
    idx = torch.arange(m.shape[-1], device=m.device).expand(m.shape)
    prev = torch.cat([torch.zeros_like(m[..., :1]), m[..., :-1]], dim=-1)
    run_start = torch.where(m & ~prev, idx, torch.zeros_like(idx)).cummax(dim=-1).values
    return torch.where(m, idx - run_start, torch.full_like(idx, -1))


def answer_start_weights(batch: TrainBatch, tokens: int, weight: float) -> Tensor | None:
    """``[B, T]``: ``weight`` on each answer's first ``tokens`` tokens, 1 elsewhere (None when ``weight`` is 1)."""
    if weight == 1.0:
        return None
    pos = answer_positions(batch.loss_mask)  # [B, T]
    return torch.where((pos >= 0) & (pos < tokens), float(weight), 1.0)


def step_mask(batch: TrainBatch, k: int) -> Tensor:
    """``[B, N]``: branch ``i`` counts at step ``k`` if token ``i+2+k`` exists and is an assistant token."""
    B, T = batch.ids.shape
    inside = torch.arange(T, device=batch.ids.device)[None] < batch.lengths[:, None].to(
        batch.ids.device
    )  # [B, T]
    return shifted(batch.loss_mask & inside, 2 + k, T - 1, fill=False)


def branch_valid(batch: TrainBatch, offset: int = 0) -> Tensor:
    """``[B, N]``: index ``i + offset`` is a real branch (``i + offset < length - 1``)."""
    N = batch.ids.shape[1] - 1
    idx = torch.arange(N, device=batch.ids.device)[None] + offset
    return idx < (batch.lengths[:, None].to(batch.ids.device) - 1)


def sample_branches(n: int, fraction: float, seed: int) -> Tensor | None:
    """A sorted random subset of ``ceil(fraction * n)`` branch indices (None when ``fraction >= 1``)."""
    if fraction >= 1.0:
        return None
    g = torch.Generator().manual_seed(int(seed))
    m = max(1, math.ceil(fraction * n))
    return torch.randperm(n, generator=g)[:m].sort().values


def sample_anchors(valid: Tensor, fraction: float, seed: int, rows_per_anchor: int = 1) -> Tensor:
    """``[B, M]`` sorted random anchors per sequence, ``M = ceil(fraction * N)``, drawn among ``valid [B, N]``
    first (a sequence with fewer valid positions fills up with others, which the loss masks out).

    ``M * rows_per_anchor`` is kept off ``N`` and ``N + 1``: the gradient probes tell a drafter's rows apart
    by their length, and ``N + 1`` is the context's."""
    B, N = valid.shape
    m = min(N, max(1, math.ceil(fraction * N)))
    if m > 1 and m * rows_per_anchor in (N, N + 1):
        m -= 1
    g = torch.Generator().manual_seed(int(seed))
    score = torch.rand(B, N, generator=g).to(valid.device) + (~valid).float()  # valid first, in random order
    return score.topk(m, dim=1, largest=False).indices.sort(dim=1).values  # [B, M]


def relative_mse(x: Tensor, target: Tensor, valid: Tensor) -> Tensor:
    """``sum ||x - t||^2 / sum ||t||^2`` over valid rows; ``x, target [B, N, ...]``, ``valid [B, N]``."""
    w = valid.to(x.dtype).view(*valid.shape, *([1] * (x.dim() - 2)))
    den = (target.pow(2) * w).sum().clamp_min(1e-12)
    return ((x - target).pow(2) * w).sum() / den


def at_rows(x: Tensor, rows: Tensor | None) -> Tensor:
    """The unrolled branches ``rows`` of ``x [B, N, ...]`` (all of them when ``rows`` is None): ``[M]`` shared
    by every sequence, or ``[B, M]`` per sequence (the parallel regime's anchors)."""
    if rows is None:
        return x
    if rows.dim() == 1:
        return x[:, rows]
    return x[torch.arange(x.shape[0], device=x.device)[:, None], rows]  # [B, M, ...]


def _kv_align(drafter: TrainableDrafter, un: Unrolled, batch: TrainBatch) -> Tensor:
    """Relative MSE of the drafter's own K/V at every unrolled position against that position's reference."""
    terms = []
    N = batch.ids.shape[1] - 1
    for li, steps in un.ctx.own.items():
        for s, rows in enumerate(un.rows):
            k, v = (x.transpose(1, 2) for x in steps[s])  # [B, n, kvH, D]
            if drafter.paradigm == "kv":  # the target's KV at the unrolled position i+1+s
                tk, tv = (
                    shifted(x.detach().transpose(1, 2), 1 + s, N) for x in un.injected[li]
                )  # [B, N, kvH, D]
            elif s == 0:
                continue  # step 0 of a hidden/hybrid drafter is its own reference
            else:  # what step 0 computed at the same position from the target's real feature
                tk, tv = (shifted(x.detach().transpose(1, 2), s, N) for x in steps[0])  # [B, N, kvH, D]
            valid = at_rows(branch_valid(batch, s), rows)  # position i+1+s lies inside the sequence
            terms.append(relative_mse(k, at_rows(tk, rows), valid))
            terms.append(relative_mse(v, at_rows(tv, rows), valid))
    return torch.stack(terms).mean() if terms else torch.zeros((), device=batch.ids.device)


def _feature_regression(un: Unrolled, batch: TrainBatch) -> Tensor:
    N = batch.ids.shape[1] - 1
    terms = []
    for s, rows in enumerate(un.rows):
        target = shifted(un.fused.detach(), s + 1, N)  # [B, N, H] fused target feature of position i+1+s
        terms.append(
            relative_mse(un.outs[s], at_rows(target, rows), at_rows(branch_valid(batch, s + 1), rows))
        )
    return torch.stack(terms).mean()


def regime_loss(
    drafter: TrainableDrafter,
    batch: TrainBatch,
    un: Unrolled,
    regime: str,
    step_decay: float,
    feature_loss_weight: float = 0.0,
    kv_align_weight: float = 0.0,
    answer_start: tuple[int, float] = (0, 1.0),
) -> tuple[Tensor, dict]:
    """The regime's total loss and its parts (per-step CE and top-1 agreement with the target).

    Logits are computed only for the rows that count (assistant tokens), which is most of the cost saved
    on a CPU: the draft LM head and its softmax dominate a one-layer drafter. ``answer_start = (n, w)`` weighs
    the predicted tokens among each answer's first ``n`` by ``w`` in each step's cross-entropy (a weighted mean,
    so the loss keeps its scale); the logged ``ce`` stays the plain mean.
    """
    N = batch.ids.shape[1] - 1
    weights = answer_start_weights(batch, *answer_start)  # [B, T] or None
    with torch.no_grad():  # the target's side, once per batch (not once per unrolled step)
        probs = target_probs(batch.final_hidden, drafter.head)  # [B, T, V_draft]
        top = probs.argmax(-1)  # [B, T] the target's greedy draft-vocabulary token
        ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1)  # [B, T] its entropy
    total = torch.zeros((), device=probs.device)
    parts: dict = {"ce": [], "kl": [], "acc": [], "n": []}
    for k, (h, rows) in enumerate(zip(un.outs, un.rows)):
        mask = at_rows(step_mask(batch, k), rows)  # [B, n]
        logits = drafter.logits(h[mask])  # [M, V_draft]
        p_k = at_rows(shifted(probs, 1 + k, N), rows)[mask]  # [M, V_draft]
        n = int(mask.sum())
        logp = torch.log_softmax(logits.float(), dim=-1)  # [M, V_draft]
        ce_rows = -(p_k * logp).sum(-1)  # [M]
        ce = ce_rows.sum() / max(n, 1)
        trained = ce  # what this step's term of the loss is: the mean, or the answer-start weighted mean
        if weights is not None:
            w = at_rows(shifted(weights, 2 + k, N), rows)[mask]  # [M] each predicted token's weight
            trained = (w * ce_rows).sum() / w.sum().clamp_min(1e-12)
        weight = 1.0 if regime == "ttt_dense" else step_decay**k
        total = total + weight * trained
        with torch.no_grad():
            agree = int((logp.argmax(-1) == at_rows(shifted(top, 1 + k, N), rows)[mask]).sum())
            entropy = float(at_rows(shifted(ent, 1 + k, N), rows)[mask].sum()) / max(n, 1)
        parts["kl"].append(float(ce.detach()) - entropy)  # CE minus the target's entropy: 0 at a perfect fit
        parts["ce"].append(float(ce.detach()))
        parts["acc"].append(agree / max(n, 1))
        parts["n"].append(n)
    if feature_loss_weight and un.fused is not None:
        feat = _feature_regression(un, batch)
        total = total + feature_loss_weight * feat
        parts["feature"] = float(feat.detach())
    if kv_align_weight:
        align = _kv_align(drafter, un, batch)
        total = total + kv_align_weight * align
        parts["kv_align"] = float(align.detach())
    return total, parts
