"""The rejection rule reproduces the target distribution exactly, and accepts with probability
sum min(p, q); logits_to_probs matches Hugging Face's warpers. Chi-square tests at a strict level
(p-value > 1e-4) on seeded draws, so a failure means a real bias, not bad luck."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from kvshot_lib.decoding import check_sampling_args, logits_to_probs, rejection_sample, residual_probs, sample

N = 200_000
STRICT = 1e-4


def _dist(values, generator=None) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64) if not isinstance(values, torch.Tensor) else values.double()
    return (t / t.sum()).float()


def _cases():
    g = torch.Generator().manual_seed(0)
    v = 6
    rand = lambda: _dist(torch.rand(v, generator=g) ** 2)  # noqa: E731
    p1, q1 = rand(), rand()
    p2 = rand()
    return {
        "random p, q": (p1, q1),
        "p == q": (p2, p2.clone()),
        "one-hot p": (_dist([0, 0, 1, 0, 0, 0]), rand()),
        "q has no mass where p has": (_dist([0.3, 0.3, 0.2, 0.2, 0, 0]), _dist([0, 0, 0.1, 0.2, 0.4, 0.3])),
        "one-hot q": (rand(), _dist([0, 1, 0, 0, 0, 0])),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_rejection_rule_outputs_the_target_distribution(case):
    p, q = _cases()[case]
    g = torch.Generator().manual_seed(42)
    P, Q = p.expand(N, -1), q.expand(N, -1)  # [N, V]
    x = sample(Q, g)  # [N] drafts from q
    accepted, emitted = rejection_sample(P, Q, x, g)
    counts = torch.bincount(emitted, minlength=len(p)).double().numpy()
    expected = p.double().numpy() * N
    support = expected > 0
    assert counts[~support].sum() == 0, "emitted a token the target gives probability 0"
    if support.sum() > 1:
        stat = chisquare(counts[support], expected[support] * counts[support].sum() / expected[support].sum())
        assert stat.pvalue > STRICT, f"{case}: chi-square p-value {stat.pvalue:.2e}"
    rate, want = accepted.double().mean().item(), torch.minimum(p, q).sum().item()
    assert abs(rate - want) < 5 * np.sqrt(max(want * (1 - want), 1e-12) / N) + 1e-6, (case, rate, want)


def test_acceptance_rate_is_one_when_p_equals_q():
    p = _dist([0.1, 0.2, 0.3, 0.4])
    accepted, emitted = rejection_sample(p.expand(1000, -1), p.expand(1000, -1), sample(p.expand(1000, -1)))
    assert accepted.all()


def test_residual_is_normalized_and_falls_back_to_p():
    p, q = _dist([0.5, 0.5, 0.0]), _dist([0.25, 0.25, 0.5])
    torch.testing.assert_close(residual_probs(p, q), _dist([0.5, 0.5, 0.0]))
    torch.testing.assert_close(residual_probs(p, p), p)


def test_logits_to_probs_matches_hugging_face_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 3
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 10, 0.9)]:
        scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(None, scores)
        torch.testing.assert_close(logits_to_probs(logits, temperature, top_k, top_p), scores.softmax(-1))


def test_top_k_and_top_p_supports():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert (logits_to_probs(logits, 1.0, top_k=2) > 0).sum() == 2
    probs = logits.softmax(-1)  # ~ .64, .24, .09, .03, .01
    assert (logits_to_probs(logits, 1.0, top_p=0.5) > 0).tolist() == [True, False, False, False, False]
    assert (logits_to_probs(logits, 1.0, top_p=float(probs[0] + 0.01)) > 0).sum() == 2


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-0.1),
        dict(temperature=1, top_k=-1),
        dict(temperature=1, top_p=0),
        dict(temperature=1, top_p=1.5),
        dict(temperature=float("nan")),
    ],
)
def test_nonsense_sampling_settings_are_rejected(bad):
    with pytest.raises(ValueError):
        check_sampling_args(**bad)
