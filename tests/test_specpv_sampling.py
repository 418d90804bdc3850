"""SpecPV's strict mode is lossless under sampling: its output follows the full model's distribution.

In strict mode the pending tokens were sampled on partial logits, so at the next full pass each is put to the
rejection rule with the partial distribution as the proposal ``q`` and the full model's as the target ``p``;
the first rejected one is replaced by a sample of the residual ``norm(max(0, p - q))`` and generation rolls
back to it (``decoding/specpv.py``). If the rule, the residual or the bookkeeping of ``q`` were wrong, the
output would drift toward the partial model's distribution.

The test: the engine tests' small target (2 layers, a 32-token vocabulary, ``test_decoding_sampling``) on a
40-token prompt, with a partial cache of 12 tokens (4 sinks, one retrieved block of 4, a 4-token window) and a
full pass once 2 tokens are pending, so partial and full distributions differ and rollbacks are frequent.
The first 4 new tokens at temperature 1, top-k 2 (16 outcomes) are counted over seeds and compared with the
full model's exact joint distribution by a chi-square test at level 1e-4. The number of runs is the smallest
that gives power 0.8 against a 5% distortion (the power computation of ``test_decoding_sampling``), for the
root alone (``mode="ar"``) and for a noisy self-drafter's chains of 2, whose accepted drafts' ``q`` rows are
the bookkeeping under test.
"""

import pytest
import torch
from test_decoding_sampling import (
    TOP_K,
    VOCAB,
    assert_follows,
    exact_joint,
    runs_for_power,
    small,  # noqa: F401 (the fixture)
)

from kvshot_lib.decoding import DecodeConfig, Prefill, SpecPVConfig, specpv_generate
from kvshot_lib.drafters import SelfDrafter

PROMPT = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(4)).tolist()
PARTIAL = dict(budget=12, sink=4, window=4, block_size=4, full_every=2)
N_TOKENS = 4
SAMPLED = dict(temperature=1.0, top_k=TOP_K, max_new_tokens=N_TOKENS, stop_token_ids=())


@pytest.mark.slow  # ~9 s each: make test-slow, which CI runs
@pytest.mark.parametrize("mode", ["ar", "chain"])
def test_strict_mode_follows_the_full_distribution_under_sampling(small, mode):  # noqa: F811
    joint = exact_joint(small, PROMPT, N_TOKENS, 1.0, TOP_K)
    n_runs = runs_for_power(joint, 0.8)
    drafter = SelfDrafter(small, noise=0.6) if mode == "chain" else None
    pre = Prefill.run(small, PROMPT)  # shared by every run
    pv = SpecPVConfig(strict=True, **PARTIAL)
    counts, rollbacks, partial, accepted, drafted = dict.fromkeys(joint, 0), 0, 0, 0, 0
    for seed in range(n_runs):
        cfg = DecodeConfig(mode=mode, seed=seed, chain_depth=2, **SAMPLED)
        out = specpv_generate(small, drafter, PROMPT, cfg, pv, prefill=pre)
        key = tuple(out.token_ids)
        assert key in counts, f"an impossible output (a token outside the full model's top {TOP_K}): {key}"
        counts[key] += 1
        rollbacks, partial = rollbacks + len(out.rollbacks), partial + out.n_partial
        accepted, drafted = accepted + sum(out.step_accepts), drafted + sum(out.step_attempts)
    assert_follows(counts, joint, n_runs)
    # the premises: tokens were chosen on partial logits, and the full model rejected many of them
    assert partial >= n_runs // 2 and rollbacks >= n_runs // 5, (partial, rollbacks, n_runs)
    if mode == "chain":
        assert 0.2 < accepted / drafted < 0.9, "the test needs both accepted and rejected drafts"
