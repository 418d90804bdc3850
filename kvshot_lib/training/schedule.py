"""The learning-rate schedule: cosine, or warmup-stable-decay with decay branches for in-run learning curves.

A held-out point in the middle of a cosine schedule measures a drafter whose learning rate is still high,
not what that budget can train. So the learning-curve runs use **warmup-stable-decay** (WSD,
``schedule: wsd``): a linear warmup, a constant learning rate, and a linear decay to ``lr * min_lr_ratio``
over the last ``decay_fraction`` of the steps. At each of ``curve_points`` log-spaced budgets before the end
(:func:`curve_steps`: ``train_steps / 2^j``), the loop runs a short **decay branch** (``loop.py``): from a
copy of the drafter and its optimizer it takes ``decay_fraction`` of that budget's steps more, on the batches
that come next, with the learning rate decaying the same way, evaluates the held-out slice, and goes back.
Each curve point is thus an annealed drafter trained for that budget, as a separate run would give,
for about ``decay_fraction * (1/2 + 1/4 + ...)`` ≈ 10% more compute. The last point is the run's own end.

**Training to a plateau** (``plateau_stop: 0.01``, the reference run's rule): ``train_steps`` is then a cap.
At each held-out evaluation of the stable phase, if acc_0 moved by less than ``plateau_stop`` over the last
quarter of the steps (:func:`~.convergence.plateau_step`), the stable phase ends there and the run ends after
its WSD decay (:func:`run_end`). The decision is a function of the evaluation log, so a resumed run takes it
at the same step without any state of its own (:class:`~.convergence.Stopping`).

``tests/test_learning_curves.py`` checks that the main run is the same with and without branches, and
that a branch's point equals a separate run of ``b + d`` steps whose own final decay is those ``d`` steps.
"""

from __future__ import annotations

import math

SCHEDULES = ("cosine", "wsd")


def lr_factor(cfg, step: int, decay_from: int | None = None) -> float:
    """The learning-rate multiplier of optimizer step ``step`` (0-based) under ``cfg.schedule``. Under WSD,
    ``decay_from`` (the plateau rule's decision, :func:`run_end`) starts the decay early."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "wsd":
        start = decay_start(cfg, decay_from)
        length = max(1, run_end(cfg, decay_from) - start)
        into = step - start
        return 1.0 if into < 0 else linear_decay(cfg, min(into, length - 1), length)
    t = (step - cfg.warmup_steps) / max(1, cfg.train_steps - cfg.warmup_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


def decay_start(cfg, decay_from: int | None = None) -> int:
    """The step a WSD run's decay starts at, the end of its stable phase: ``decay_from`` where the plateau rule
    ended it there, else the planned start, the last ``decay_fraction`` of ``train_steps``."""
    if decay_from is not None:
        return decay_from
    return cfg.train_steps - decay_length(cfg.train_steps, cfg.decay_fraction)


def run_end(cfg, decay_from: int | None = None) -> int:
    """The step count a run ends at: ``train_steps``, or, once the plateau rule decided to stop the stable phase
    after ``decay_from`` steps (``plateau_stop``), that many plus their WSD decay, at most ``train_steps``."""
    if decay_from is None:
        return cfg.train_steps
    return min(cfg.train_steps, decay_from + decay_length(decay_from, cfg.decay_fraction))


def linear_decay(cfg, i: int, length: int, start: float = 1.0) -> float:
    """Step ``i`` of a linear decay of ``length`` steps from ``start`` down to ``min_lr_ratio``."""
    return start - (start - cfg.min_lr_ratio) * (i + 1) / length


def decay_length(budget: int, fraction: float) -> int:
    return max(1, round(fraction * budget))


def curve_steps(train_steps: int, n_points: int) -> list[int]:
    """The budgets, in optimizer steps, of a learning curve of ``n_points`` log-spaced points ending at
    ``train_steps`` (``[T/16, T/8, T/4, T/2, T]`` for 5); empty when ``n_points`` is 0."""
    return sorted({max(1, round(train_steps / 2**j)) for j in range(n_points)})
