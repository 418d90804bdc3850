"""Answers that loop: detecting a repetition at an answer's end, and where to cut it.

A greedy small target often ends an answer by repeating a phrase until the token limit (in the committed
on-policy regeneration, 1,653 of 5,699 answers). Such a tail teaches a drafter little and inflates held-out
accuracy. Two rules, one period definition:

* :func:`loop_period`: the answer's last ``tail`` tokens repeat with a period of at most ``max_period`` (the
  smallest such period), else None; :func:`loops` is whether there is one;
* :func:`loop_cut`: how many tokens to keep: up to where the periodic run begins, its first copy, and one
  repetition of it (the text up to the first repeat plus one period), so a drafter still sees that a loop starts.

Standard library only: the vLLM worker (``vllm_worker.py``, which runs in another environment) loads this file by
path to stop generating an answer once it loops, by the same rule.
"""

from __future__ import annotations

TAIL, MAX_PERIOD = 96, 32
CHECK_EVERY = (
    16  # tokens between two loop checks of an answer being generated (a stop costs at most this much)
)


def loop_period(ids: list[int], tail: int = TAIL, max_period: int = MAX_PERIOD) -> int | None:
    """The smallest period ``p <= max_period`` with which the last ``tail`` tokens of ``ids`` repeat, or None."""
    if len(ids) < tail:
        return None
    t = ids[-tail:]
    return next((p for p in range(1, max_period + 1) if all(t[i] == t[i + p] for i in range(tail - p))), None)


def loops(ids: list[int], tail: int = TAIL, max_period: int = MAX_PERIOD) -> bool:
    """Whether an answer ends in a loop: its last ``tail`` tokens repeat with a period of at most ``max_period``."""
    return loop_period(ids, tail, max_period) is not None


def loop_cut(ids: list[int], tail: int = TAIL, max_period: int = MAX_PERIOD) -> int:
    """How many tokens of ``ids`` to keep: all of them if it does not end in a loop; else up to the start ``s`` of
    the periodic run (``ids[i] == ids[i + p]`` for every ``i >= s``), its first period and one repetition:
    ``s + 2p``."""
    p = loop_period(ids, tail, max_period)
    if p is None:
        return len(ids)
    s = len(ids) - tail
    while s > 0 and ids[s - 1] == ids[s - 1 + p]:
        s -= 1
    return min(len(ids), s + 2 * p)
