"""Acceptance and speed metrics, defined once. Pure functions of counts; no model in sight.

For draft step k (0 = the first drafted token after the root), over all verification cycles:

* ``attempts[k]``: cycles in which draft step k was tested, i.e. steps 0..k-1 were all accepted and a
  step-k draft existed; ``accepts[k]``: ... and it was accepted.
* ``alpha_k = accepts[k] / attempts[k]``: acceptance at step k *conditional* on every earlier step
  being accepted.
* ``p_reach_k = alpha_0 * ... * alpha_k``: the *unconditional* probability that the first k+1 drafts
  are all accepted. (Taking the product, not ``accepts[k] / attempts[0]``, keeps it right when some
  cycles drafted fewer steps, e.g. near ``max_new_tokens``.)
* MAT (tau): mean tokens committed per cycle, the bonus token included: ``mean(accepted + 1)``.
* Retention: ``alpha_6 / alpha_0``, how much of its first-step acceptance a drafter keeps at step 6.
* Speedup: tokens/s over the tokens/s of plain decoding measured in the same run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def sum_step_counts(
    per_generation: Iterable[tuple[Sequence[int], Sequence[int]]],
) -> tuple[list[int], list[int]]:
    """Add up ``(attempts, accepts)`` lists of different lengths, step by step."""
    attempts: list[int] = []
    accepts: list[int] = []
    for att, acc in per_generation:
        if len(att) != len(acc):
            raise ValueError(f"attempts and accepts differ in length: {len(att)} vs {len(acc)}.")
        for k, (a, b) in enumerate(zip(att, acc)):
            if b > a:
                raise ValueError(f"step {k}: {b} accepts out of {a} attempts.")
            if k == len(attempts):
                attempts.append(0)
                accepts.append(0)
            attempts[k] += a
            accepts[k] += b
    return attempts, accepts


def alpha_conditional(attempts: Sequence[int], accepts: Sequence[int]) -> list[float]:
    """alpha_k = accepts[k] / attempts[k]; NaN where step k was never attempted."""
    return [b / a if a > 0 else math.nan for a, b in zip(attempts, accepts)]


def p_reach(alpha: Sequence[float]) -> list[float]:
    """P(drafts 0..k all accepted) = the running product of the conditional alphas."""
    out, running = [], 1.0
    for a in alpha:
        running *= a
        out.append(running)
    return out


def mat_from_counts(n_accepted: float, n_cycles: float) -> float:
    """MAT (tau) from totals: ``(accepted drafts + one bonus token per cycle) / cycles``; NaN without cycles."""
    return (n_accepted + n_cycles) / n_cycles if n_cycles else math.nan


def mean_accepted_tokens(accepted_per_cycle: Iterable[int]) -> float:
    """MAT (tau): mean of accepted drafts + 1 (the bonus token) over cycles; NaN without cycles."""
    values = list(accepted_per_cycle)
    return mat_from_counts(sum(values), len(values))


MIN_ATTEMPTS = 20  # a conditional alpha measured on fewer attempts is noise, not a rate


def retention(
    alpha: Sequence[float],
    late: int = 6,
    early: int = 0,
    attempts: Sequence[int] | None = None,
    min_attempts: int = MIN_ATTEMPTS,
) -> float:
    """alpha_late / alpha_early; NaN if either step is missing, alpha_early is 0, or (given ``attempts``)
    either step was attempted fewer than ``min_attempts`` times."""
    if len(alpha) <= max(late, early) or not alpha[early] or math.isnan(alpha[early]):
        return math.nan
    if attempts is not None and min(attempts[late], attempts[early]) < min_attempts:
        return math.nan
    return alpha[late] / alpha[early]


def mat_from_alpha(alpha: Sequence[float]) -> float:
    """The MAT implied by the conditional alphas of a chain: 1 + sum_k p_reach_k (NaN steps count as 0)."""
    return 1.0 + sum(0.0 if math.isnan(p) else p for p in p_reach(alpha))


def tokens_per_second(n_tokens: int, seconds: float) -> float:
    return n_tokens / seconds if seconds > 0 else math.nan


def speedup(tokens_per_s: float, baseline_tokens_per_s: float) -> float:
    """A ratio of throughputs taken in the same run on the same machine."""
    return tokens_per_s / baseline_tokens_per_s if baseline_tokens_per_s > 0 else math.nan


def acceptance_by_step(
    attempts: Sequence[int], accepts: Sequence[int], max_steps: int | None = None
) -> list[dict]:
    """One record per step: ``step, alpha_conditional, p_reach, n_attempts, n_accepts``."""
    alpha = alpha_conditional(attempts, accepts)
    reach = p_reach(alpha)
    n = len(alpha) if max_steps is None else min(max_steps, len(alpha))
    return [
        dict(
            step=k, alpha_conditional=alpha[k], p_reach=reach[k], n_attempts=attempts[k], n_accepts=accepts[k]
        )
        for k in range(n)
    ]
