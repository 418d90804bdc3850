"""At temperature > 0 the engine's output follows the target's distribution, drafts or no drafts; and
the engine hands drafters the right hidden states and draft-vocabulary plumbing.

The distribution test: with top-k 2 the first four new tokens have at most 16 outcomes, whose exact
probabilities come from 15 target forwards. The engine (chain with the rejection rule; tree with
sample-and-match) is run with many seeds and compared with a chi-square test.
"""

import itertools

import pytest
import torch
from conftest import random_prompts
from scipy.stats import chisquare

from kvshot_lib.decoding import DecodeConfig, autoregressive_generate, logits_to_probs, speculative_generate
from kvshot_lib.drafters import SelfDrafter, build_drafter, drafter_config_for

N_RUNS = 300
STRICT = 1e-4


def exact_joint(target, prompt, n_tokens, temperature, top_k):
    """{(t1, .., tn): probability} under the target's processed distribution."""
    out = {(): 1.0}
    with torch.inference_mode():
        for _ in range(n_tokens):
            nxt = {}
            for prefix, prob in out.items():
                logits = target.model(
                    torch.tensor([prompt + list(prefix)], device=target.model.device)
                ).logits[0, -1]
                p = logits_to_probs(logits, temperature, top_k)
                for t in p.nonzero()[:, 0].tolist():
                    nxt[prefix + (t,)] = prob * float(p[t])
            out = nxt
    return out


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_sampled_output_follows_the_target_distribution(llama, mode):
    prompt = random_prompts(1, seed=11)[0]
    temperature, top_k, n = 1.0, 2, 4
    joint = exact_joint(llama, prompt, n, temperature, top_k)
    drafter = SelfDrafter(llama, noise=3.0)  # correlated, not equal: accepts and rejects both happen
    cfg = dict(
        mode=mode,
        temperature=temperature,
        top_k=top_k,
        max_new_tokens=n,
        stop_token_ids=(),
        chain_depth=3,
        tree_depth=3,
        tree_top_k=2,
        tree_budget=6,
    )
    counts = dict.fromkeys(joint, 0)
    accepted = 0
    for seed in range(N_RUNS):
        out = speculative_generate(llama, drafter, prompt, DecodeConfig(seed=seed, **cfg))
        counts[tuple(out.token_ids)] += 1  # a KeyError would mean an impossible output
        accepted += sum(out.step_accepts)
    total = sum(joint.values())
    big = [k for k in sorted(joint) if joint[k] / total * N_RUNS >= 5]  # pool the rare outcomes
    observed = [counts[k] for k in big]
    expected = [joint[k] / total * N_RUNS for k in big]
    if len(big) < len(joint):
        observed.append(N_RUNS - sum(observed))
        expected.append(N_RUNS - sum(expected))
    assert chisquare(observed, expected).pvalue > STRICT
    assert 0 < accepted < N_RUNS * 3, "the test needs both accepted and rejected drafts"


class HiddenProbe:
    """A self-drafting session that also declares hidden layers and records what the engine hands it."""

    name = "probe"

    def __init__(self, target, layers):
        self.inner, self.layers, self.calls = SelfDrafter(target, noise=3.0), layers, []

    def new_session(self):
        session = self.inner.new_session()
        session.hidden_layers = self.layers
        start = session.start_cycle

        def recording_start(committed, view):
            self.calls.append(
                (
                    committed.shape[1],
                    {k: v.clone() for k, v in view.hidden.items()},
                    view.cache.get_seq_length(),
                )
            )
            return start(committed, view)

        session.start_cycle = recording_start
        return session


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_drafters_get_exactly_the_newly_committed_hidden_states(llama, mode):
    layers = (1, 3, 6)
    probe = HiddenProbe(llama, layers)
    prompt = random_prompts(1, seed=3)[0]
    out = speculative_generate(
        llama,
        probe,
        prompt,
        DecodeConfig(mode=mode, max_new_tokens=12, tree_top_k=2, tree_budget=6, stop_token_ids=()),
    )
    full = torch.tensor([prompt + out.token_ids], device=llama.model.device)
    with torch.inference_mode():
        states = llama.model(full, output_hidden_states=True).hidden_states
    seen = 0
    for committed_len, hidden, cached in probe.calls:
        assert cached == committed_len - 1, "the target's cache holds everything but the root"
        for layer in layers:
            got = hidden[layer]  # [1, n_new, H]
            want = states[layer + 1][:, seen : committed_len - 1]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        seen = committed_len - 1
    assert len(probe.calls) > 2


@pytest.mark.parametrize("paradigm", ["hidden", "kv", "hybrid"])
def test_greedy_equality_with_real_drafter_classes(llama, paradigm):
    """Untrained drafters of the three paradigms (reduced draft vocabulary, hidden states, target KV): the
    engine's d2t and hidden-state plumbing keeps decoding lossless. (Trained checkpoints: TODO.)"""
    d2t = torch.sort(torch.randperm(49152, generator=torch.Generator().manual_seed(0))[:1024]).values
    cfg = drafter_config_for(llama, paradigm, draft_vocab_size=1024, name=f"{paradigm}-untrained")
    drafter = build_drafter(cfg, llama, d2t, seed=0)
    for prompt, (mode, temperature) in zip(
        random_prompts(4, seed=8), itertools.product(["chain", "tree"], [0.0, 1.0])
    ):
        dc = DecodeConfig(mode=mode, temperature=temperature, max_new_tokens=10, stop_token_ids=(), seed=1)
        out = speculative_generate(llama, drafter, prompt, dc)
        if temperature == 0:
            ref = autoregressive_generate(
                llama, prompt, DecodeConfig(mode="ar", max_new_tokens=10, stop_token_ids=())
            )
            assert out.token_ids == ref.token_ids
        else:
            assert len(out.token_ids) == 10


def test_rejection_rule_with_a_reduced_draft_vocabulary():
    """Drafts over a draft vocabulary mapped to target ids by d2t: q lives on 4 of 10 target tokens, and p
    puts mass outside them; the engine's chain verification still emits exactly p."""
    from kvshot_lib.decoding import DraftTree, GenerationResult, sample, verify_sampled_chain

    g = torch.Generator().manual_seed(5)
    p = torch.tensor([0.05, 0.2, 0.0, 0.15, 0.1, 0.05, 0.05, 0.3, 0.05, 0.05])  # [V=10]
    q_draft = torch.tensor([0.4, 0.1, 0.3, 0.2])  # [V_draft=4]
    d2t = torch.tensor([1, 3, 5, 7])
    n, counts, result = 10_000, torch.zeros(10), GenerationResult([], 0, "")
    for _ in range(n):
        j = int(sample(q_draft, g))
        tree = DraftTree(tokens=[int(d2t[j])], parents=[-1], depths=[0], q=[q_draft])
        path, bonus = verify_sampled_chain(tree, torch.stack([p, p]), d2t, g, result)
        counts[tree.tokens[0] if path else bonus] += 1
    support = p > 0
    assert counts[~support].sum() == 0
    assert chisquare(counts[support].numpy(), (p[support] * n).numpy()).pvalue > STRICT
    q_target = torch.zeros(10).index_copy_(0, d2t, q_draft)
    rate = result.step_accepts[0] / result.step_attempts[0]
    assert abs(rate - torch.minimum(p, q_target).sum().item()) < 0.02
