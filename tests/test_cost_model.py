"""The cost model prices a cycle at what a typical repetition costs (``decoding/cost_model.py``): the median of its
timings, not the fastest, which the engine seldom reaches on a shared CPU (docs/onpolicy-results.md)."""

from __future__ import annotations

import pytest

from kvshot_lib.decoding import cost_model as cm


class ScriptedClock:
    """A clock that only the scripted forwards advance: repetition ``r`` of a ``k``-token block takes ``r * k``
    ms causal and twice that tree-masked; the warm-up round (r = 0) 100 times as long."""

    def __init__(self):
        self.now, self.calls = 0.0, {}

    def clock(self, device):
        return self.now

    def forward(self, model, block, cache, positions=None, mask=None, **kw):
        k = block.shape[1]
        if positions is None:  # the prompt's forward, before any timing
            return
        tree = mask is not None or (k == 1 and self.calls.get((k, False), 0) > self.calls.get((k, True), 0))
        rep = self.calls.get((k, tree), 0)
        self.calls[k, tree] = rep + 1
        self.now += 1e-3 * k * (100 if rep == 0 else rep) * (2 if tree else 1)


@pytest.mark.parametrize("reps", [12, 5])
def test_verification_is_priced_at_the_median_repetition(tiny_llama, monkeypatch, reps):
    script = ScriptedClock()
    monkeypatch.setattr(cm, "_clock", script.clock)
    monkeypatch.setattr(cm, "forward", script.forward)
    monkeypatch.setattr(cm, "crop", lambda cache, n: None)
    monkeypatch.setattr(cm, "keep_block_positions", lambda cache, start, keep: None)
    chain, tree, commit = cm.measure_verification(
        tiny_llama, context=8, sizes=(1, 2, 4), reps=reps, static=False
    )
    # repetitions 1..reps take k, 2k, ..., reps * k ms: the median is (reps + 1) / 2 * k ms (6.5k of 12, 3k of 5);
    # the fastest, k ms, is what the engine seldom pays
    middle = (reps + 1) / 2
    assert chain == pytest.approx({k: 1e-3 * middle * k for k in (1, 2, 4)})
    assert tree == pytest.approx({k: 2e-3 * middle * k for k in (1, 2, 4)})
    assert commit == 0.0  # the scripted commit takes no time
