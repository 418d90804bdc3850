"""Has a drafter memorized its training answers? Its accuracy on conversations it trained on against ones it never saw.

A drafter limited by its data, not its compute, fits the answers it has seen better than new ones from the same
source: the gap between the two opens as the passes over the data grow. So the measure is per-step teacher-forced
accuracy and cross-entropy (:func:`kvshot_lib.training.branch_outcomes`, the held-out set's rule) on a sample of
the drafter's own training conversations (``seen``) and on conversations of the same source it never trained on
(``unseen``: later conversations of the same seeded training split, or the held-out split). :func:`per_sequence`
sums each conversation's outcomes; :func:`seen_unseen_gap` gives seen minus unseen with a 95% bootstrap interval,
conversations resampled independently in each set. Conversations differ so much that those intervals are wide, so
:func:`paired_difference` sets two drafters side by side on the same conversations (one saw them more often),
where that variation cancels. ``tests/test_memorization.py`` checks all three on hand-made cases.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..training import EvalSet, branch_outcomes


def per_sequence(drafter, evals: EvalSet, n_steps: int, batch_size: int) -> pd.DataFrame:
    """One row per conversation (index into the evaluated split) and draft step ``k``: ``hits``, the counted
    branches ``n`` and the summed cross-entropy ``ce_sum``."""
    parts = []
    for o in branch_outcomes(drafter, evals, n_steps):
        parts.append(
            pd.DataFrame(
                dict(
                    sequence=(o.sequence.cpu() + o.batch_index * batch_size).numpy(),
                    k=o.k,
                    hits=(o.guess == o.want).cpu().numpy().astype(int),
                    n=1,
                    ce_sum=o.cross_entropy.double().cpu().numpy(),
                )
            )
        )
    return pd.concat(parts).groupby(["sequence", "k"], as_index=False)[["hits", "n", "ce_sum"]].sum()


def _rates(table: pd.DataFrame, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Step ``k``'s per-conversation hits, summed cross-entropy and branches, in conversation order."""
    t = table[table["k"] == k].sort_values("sequence")
    return t["hits"].to_numpy(float), t["ce_sum"].to_numpy(float), t["n"].to_numpy(float)


def _pooled(rates, col: int, pick=slice(None)):
    """Accuracy (``col`` 0) or cross-entropy (1) pooled over the conversations ``pick`` (an index array: one value
    per bootstrap replicate; none: all of them)."""
    return rates[col][pick].sum(-1) / rates[2][pick].sum(-1)


def seen_unseen_gap(
    seen: pd.DataFrame, unseen: pd.DataFrame, n_boot: int = 2000, seed: int = 0
) -> pd.DataFrame:
    """Per draft step ``k`` and measure (``acc``, ``ce``): the value on ``seen`` and on ``unseen`` (tables of
    :func:`per_sequence`), ``gap`` = seen - unseen, its 95% bootstrap interval (``lo``, ``hi``) and the branch
    counts. Memorization shows as a positive accuracy gap and a negative cross-entropy gap."""
    rng = np.random.default_rng(seed)
    rows = []
    for k in sorted(set(seen["k"]) & set(unseen["k"])):
        s, u = _rates(seen, k), _rates(unseen, k)
        pick_s = rng.integers(0, len(s[2]), (n_boot, len(s[2])))  # [n_boot, sequences]
        pick_u = rng.integers(0, len(u[2]), (n_boot, len(u[2])))
        for name, col in (("acc", 0), ("ce", 1)):
            boot = _pooled(s, col, pick_s) - _pooled(u, col, pick_u)
            rows.append(
                dict(
                    k=k,
                    measure=name,
                    seen=_pooled(s, col),
                    unseen=_pooled(u, col),
                    gap=_pooled(s, col) - _pooled(u, col),
                    lo=float(np.quantile(boot, 0.025)),
                    hi=float(np.quantile(boot, 0.975)),
                    n_seen=int(s[2].sum()),
                    n_unseen=int(u[2].sum()),
                    conversations_seen=len(s[2]),
                    conversations_unseen=len(u[2]),
                )
            )
    return pd.DataFrame(rows)


def paired_difference(
    seen_x: pd.DataFrame,
    seen_y: pd.DataFrame,
    unseen_x: pd.DataFrame,
    unseen_y: pd.DataFrame,
    n_boot: int = 2000,
    seed: int = 0,
) -> pd.DataFrame:
    """Did drafter ``x`` memorize more than drafter ``y``? Both measured on the same conversations (tables of
    :func:`per_sequence`): ``seen`` ones that ``x`` trained on more often than ``y`` and ``unseen`` ones that
    neither saw. Per step ``k`` and measure: ``x - y`` on each set (``on_seen``, ``on_unseen``) and their
    difference ``did`` (seen minus unseen), each with a 95% bootstrap interval (``lo``/``hi`` for ``did``,
    ``on_seen_lo``... for the others) that resamples conversations within each set, the same ones for both
    drafters, so that what varies from conversation to conversation cancels."""
    rng = np.random.default_rng(seed)
    rows = []
    for k in sorted(set(seen_x["k"]) & set(unseen_x["k"])):
        sets = [(_rates(seen_x, k), _rates(seen_y, k)), (_rates(unseen_x, k), _rates(unseen_y, k))]
        for x, y in sets:
            if len(x[2]) != len(y[2]):
                raise ValueError("paired_difference needs both drafters measured on the same conversations.")
        picks = [rng.integers(0, len(x[2]), (n_boot, len(x[2]))) for x, _ in sets]  # [n_boot, sequences]
        for name, col in (("acc", 0), ("ce", 1)):
            on_seen, on_unseen = (_pooled(x, col) - _pooled(y, col) for x, y in sets)
            b_seen, b_unseen = (_pooled(x, col, p) - _pooled(y, col, p) for (x, y), p in zip(sets, picks))
            ci = {
                f"{what}{end}": float(np.quantile(b, q))
                for what, b in (("", b_seen - b_unseen), ("on_seen_", b_seen), ("on_unseen_", b_unseen))
                for end, q in (("lo", 0.025), ("hi", 0.975))
            }
            rows.append(
                dict(
                    k=k,
                    measure=name,
                    on_seen=on_seen,
                    on_unseen=on_unseen,
                    did=on_seen - on_unseen,
                    **ci,
                    conversations_seen=len(sets[0][0][2]),
                    conversations_unseen=len(sets[1][0][2]),
                )
            )
    return pd.DataFrame(rows)
