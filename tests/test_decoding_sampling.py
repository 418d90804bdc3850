"""At temperature > 0 the engine's output follows the target's distribution, drafts or no drafts; and
the engine hands drafters the right hidden states and draft-vocabulary plumbing.

The distribution tests: with top-k 2 the first five new tokens have at most 32 outcomes, whose exact
probabilities come from 31 target forwards. Five, so that the drafted depths the tests name are reached: the
prefill gives the first token, then the first cycle drafts 3 deep (chain depth 3, tree depth 3) and the
tests assert that third drafts were verified. The engine is run with many seeds and its outcome counts are
compared with those probabilities by a chi-square test at level 1e-4 (outcomes expected fewer than 5 times
pooled). An output outside the 32 outcomes (a token outside the target's top 2) fails at once.

The target is a small random Llama (2 layers, a 32-token vocabulary, untied head): without a 49k-token LM
head a generation costs a few ms, so a test can afford a thousand of them; and its next-token distributions
over the top 2 are close to even, so every outcome is frequent. **Power**: what these tests can see is stated
as the power of the chi-square test against a *5% distortion*, i.e. an engine whose output moves 0.05 of
probability from one outcome to another, for the pair of outcomes where it is hardest to see (the two most
likely); scipy's noncentral chi-square gives it. Each test runs the smallest number of seeds that gives
power 0.8 against that 5% distortion (:func:`runs_for_power`, recomputed from the exact distribution), for
the sampling rule (chain and tree, drafting with the target plus noise) and for the trained drafter classes
(hidden, KV, hybrid checkpoints, a 16-token draft vocabulary; chain and tree alternately).

The combined proposal (prompt lookup's continuation in the drafter's tree, the shape chosen by expected speed
on a synthetic cost model) is tested the same way, on a prompt that repeats a span so that lookup proposes.

(300 runs of the first version of this test, on a target with less even outcomes, had power 0.02 against
the same 5%; 500 runs of the trained drafters over four tokens had 0.59.)
"""

import itertools

import pytest
import torch
from conftest import random_prompts
from scipy.stats import chi2, chisquare, ncx2
from transformers import LlamaConfig, LlamaForCausalLM

from kvshot_lib.decoding import (
    CostModel,
    DecodeConfig,
    DrafterCost,
    SpeedModel,
    autoregressive_generate,
    logits_to_probs,
    speculative_generate,
)
from kvshot_lib.drafters import (
    NgramDrafter,
    SelfDrafter,
    build_drafter,
    drafter_config_for,
    load_drafter,
    save_drafter,
)
from kvshot_lib.target import TINY_CONFIG, Target, TargetInfo
from kvshot_lib.target import forward as seam
from kvshot_lib.training import Objective, TrainConfig, batch_from_target

POWER = 0.8  # against a 5% distortion (module docstring)
STRICT = 1e-4
VOCAB, TOP_K, N_TOKENS = 32, 2, 5
PROMPT = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(4)).tolist()
SAMPLED = dict(temperature=1.0, top_k=TOP_K, max_new_tokens=N_TOKENS, stop_token_ids=())
SHAPES = dict(chain_depth=3, tree_depth=3, tree_top_k=2, tree_budget=6)


@pytest.fixture(scope="module")
def small():
    """A 2-layer Llama with a 32-token vocabulary, weights drawn with std 0.1, untied head."""
    config = LlamaConfig(
        **{**TINY_CONFIG, "num_hidden_layers": 2, "vocab_size": VOCAB, "tie_word_embeddings": False}
    )
    g = torch.Generator().manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.config._attn_implementation = "sdpa"
    model.eval().requires_grad_(False)
    info = TargetInfo(
        name="small-vocab",
        family="llama",
        n_layers=2,
        hidden_size=config.hidden_size,
        n_heads=config.num_attention_heads,
        n_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        vocab_size=VOCAB,
        max_context=config.max_position_embeddings,
        eos_token_ids=(),
        dtype="float32",
        device="cpu",
        n_params=sum(p.numel() for p in model.parameters()),
        fingerprint="small-vocab-2x32",
    )
    return Target(model, None, info)


def exact_joint(target, prompt, n_tokens, temperature, top_k):
    """{(t1, .., tn): probability} under the target's processed distribution."""
    out = {(): 1.0}
    with torch.inference_mode():
        for _ in range(n_tokens):
            nxt = {}
            for prefix, prob in out.items():
                ids = torch.tensor([prompt + list(prefix)], device=target.model.device)
                logits = seam.forward(target.model, ids).logits[0, -1]
                p = logits_to_probs(logits, temperature, top_k)
                for t in p.nonzero()[:, 0].tolist():
                    nxt[prefix + (t,)] = prob * float(p[t])
            out = nxt
    return out


def pooled(joint: dict, n_runs: int) -> list[tuple]:
    """The outcomes expected at least 5 times in ``n_runs`` (the rest are pooled into one cell)."""
    total = sum(joint.values())
    return [k for k in sorted(joint) if joint[k] / total * n_runs >= 5]


def power_against_shift(joint: dict, n_runs: int, shift: float = 0.05) -> float:
    """Power of the test below against moving ``shift`` of probability between the two most likely outcomes."""
    p = sorted(joint.values(), reverse=True)
    cells = len(pooled(joint, n_runs)) + (len(pooled(joint, n_runs)) < len(joint))
    if cells < 2:
        return 0.0  # one cell: nothing to test
    noncentrality = n_runs * shift**2 * (1 / p[0] + 1 / p[1])
    return float(ncx2.sf(chi2.isf(STRICT, cells - 1), cells - 1, noncentrality))


def runs_for_power(joint: dict, power: float, shift: float = 0.05, step: int = 10) -> int:
    """The smallest number of runs (a multiple of ``step``) whose test has ``power`` against ``shift``."""
    n = step
    while power_against_shift(joint, n, shift) < power:
        n += step
    return n


def assert_follows(counts: dict, joint: dict, n_runs: int) -> None:
    total = sum(joint.values())
    big = pooled(joint, n_runs)
    observed = [counts[k] for k in big]
    expected = [joint[k] / total * n_runs for k in big]
    if len(big) < len(joint):
        observed.append(n_runs - sum(observed))
        expected.append(n_runs - sum(expected))
    assert chisquare(observed, expected).pvalue > STRICT


def sample_outcomes(
    target, drafter, cfgs, n_runs: int, joint: dict, prompt=PROMPT
) -> tuple[dict, int, int, list[int]]:
    """Counts of the first N_TOKENS new tokens over seeds 0..n_runs-1 (config ``cfgs[seed % len(cfgs)]``),
    the accepted and verified drafts, and the drafts verified at each draft step."""
    counts = dict.fromkeys(joint, 0)
    accepted = drafted = 0
    by_step = [0] * 8
    for seed in range(n_runs):
        out = speculative_generate(target, drafter, prompt, DecodeConfig(seed=seed, **cfgs[seed % len(cfgs)]))
        key = tuple(out.token_ids)
        assert key in counts, f"an impossible output (a token outside the target's top {TOP_K}): {key}"
        counts[key] += 1
        accepted, drafted = accepted + sum(out.step_accepts), drafted + sum(out.step_attempts)
        for k, n in enumerate(out.step_attempts):
            by_step[k] += n
    return counts, accepted, drafted, by_step


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_sampled_output_follows_the_target_distribution(small, mode):
    joint = exact_joint(small, PROMPT, N_TOKENS, 1.0, TOP_K)
    n_runs = runs_for_power(joint, POWER)
    drafter = SelfDrafter(small, noise=0.6)  # correlated, not equal: about half the drafts are accepted
    counts, accepted, drafted, by_step = sample_outcomes(
        small, drafter, [dict(mode=mode, **SAMPLED, **SHAPES)], n_runs, joint
    )
    assert_follows(counts, joint, n_runs)
    assert 0.2 < accepted / drafted < 0.8, "the test needs both accepted and rejected drafts"
    assert by_step[2] >= 10, "the test needs third drafts verified (draft depth 3)"


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
        states = seam.forward(llama.model, full, hidden_states=True).hidden_states
    seen = 0
    for committed_len, hidden, cached in probe.calls:
        assert cached == committed_len - 1, "the target's cache holds everything but the root"
        for layer in layers:
            got = hidden[layer]  # [1, n_new, H]
            want = states[layer + 1][:, seen : committed_len - 1]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        seen = committed_len - 1
    assert len(probe.calls) > 2


D2T = torch.arange(0, VOCAB, 2)  # a 16-token draft vocabulary: half the target's tokens
LAYERS = (0, 1)  # the small target has 2 layers: the drafters read both


def real_drafter(target, paradigm: str):
    cfg = drafter_config_for(
        target, paradigm, draft_vocab_size=len(D2T), hidden_layers=LAYERS, kv_layers=LAYERS, regime="ttt"
    )
    return build_drafter(cfg, target, D2T, seed=0)


def train_and_reload(target, paradigm: str, folder):
    """A drafter trained (TTT, 60 steps) on 16 sampled continuations of the target, saved and loaded back."""
    d = real_drafter(target, paradigm)
    g = torch.Generator().manual_seed(0)
    batches = []
    for i in range(16):
        prompt = torch.randint(0, VOCAB, (12,), generator=g).tolist()
        cfg = DecodeConfig(mode="ar", temperature=1.0, max_new_tokens=12, stop_token_ids=(), seed=i)
        ids = torch.tensor(prompt + autoregressive_generate(target, prompt, cfg).token_ids)
        batches.append(batch_from_target(target, ids, torch.arange(len(ids)) >= len(prompt), d.cfg))
    tc = TrainConfig(paradigm=paradigm, regime="ttt", ttt_steps=3, draft_vocab_size=len(D2T))
    objective, optimizer = Objective(d, tc), torch.optim.Adam(d.parameters(), lr=3e-3)
    for step in range(60):
        loss, _ = objective(batches[step % len(batches)])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    save_drafter(d, folder)
    return load_drafter(folder, target).eval()


@pytest.mark.parametrize("paradigm", ["hidden", "kv", "hybrid"])
def test_real_drafter_classes_are_lossless(small, paradigm, tmp_path):
    """Untrained drafters and trained checkpoints of the three paradigms (a 16-of-32 draft vocabulary, hidden
    states, target KV). Temperature 0: chain and tree reproduce plain greedy decoding. Temperature 1: the
    trained checkpoint's outputs follow the target's distribution (500 runs, chain and tree alternately;
    power 0.59 against a 5% distortion, 1.00 against 10%), with both accepted and rejected drafts."""
    untrained, trained = real_drafter(small, paradigm), train_and_reload(small, paradigm, tmp_path / paradigm)
    for drafter, (prompt, mode) in itertools.product(
        (untrained, trained), zip(random_prompts(4, seed=8, vocab=VOCAB), ["chain", "tree"] * 2)
    ):
        ref = autoregressive_generate(
            small, prompt, DecodeConfig(mode="ar", max_new_tokens=10, stop_token_ids=())
        )
        dc = DecodeConfig(mode=mode, max_new_tokens=10, stop_token_ids=(), **SHAPES)
        assert speculative_generate(small, drafter, prompt, dc).token_ids == ref.token_ids
    joint = exact_joint(small, PROMPT, N_TOKENS, 1.0, TOP_K)
    n_runs = runs_for_power(joint, POWER)
    # depth 2: at its acceptance (about 0.3 at step 0) a trained drafter's first cycle almost never gets two
    # drafts accepted, so a third would never be verified; the sampling rule's test reaches depth 3
    cfgs = [
        {**SAMPLED, **SHAPES, "chain_depth": 2, "tree_depth": 2, "mode": mode} for mode in ("chain", "tree")
    ]
    counts, accepted, drafted, by_step = sample_outcomes(small, trained, cfgs, n_runs, joint)
    assert_follows(counts, joint, n_runs)
    assert by_step[1] >= n_runs // 10, "the test needs second drafts verified (draft depth 2)"
    assert 0.05 < accepted / drafted < 0.95, "the test needs both accepted and rejected drafts"


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


def combined_config(drafter_name: str, **kw) -> DecodeConfig:
    """A chosen tree with prompt lookup joined in, on a synthetic machine where drafting is cheap (1 ms a call)
    and verification costs ``10 + k`` ms: the shapes stay small but are not empty."""
    table = {k: (10 + k) * 1e-3 for k in (1, 2, 4, 8, 16, 64)}
    costs = {drafter_name: DrafterCost(1e-3, {1: 1e-3, 8: 2e-3})}
    speed = SpeedModel(CostModel("synthetic", "fp32", 64, table, dict(table), 0.0, costs), drafter_name)
    caps = dict(tree_depth=4, tree_top_k=2, tree_budget=8, lookup_tokens=4)
    return DecodeConfig(mode="tree", shape="chosen", lookup=True, speed=speed, **{**caps, **kw})


def lookup_prompt(target) -> list[int]:
    """A prompt after which prompt lookup proposes whatever the target's first token: it starts with the bigrams
    (last token, t) for each t of the target's top 2 after it (found by a few rounds of putting the current top 2
    in front of a random 20-token body, seeds 0, 1, ...)."""
    session = NgramDrafter(VOCAB).new_session()

    def firsts(prompt):
        with torch.inference_mode():
            logits = seam.forward(target.model, torch.tensor([prompt])).logits[0, -1]
        return logits_to_probs(logits, 1.0, TOP_K).nonzero()[:, 0].tolist()

    for seed in range(50):
        body = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(seed)).tolist()
        prompt = body
        for _ in range(10):
            top = firsts(prompt)
            if all(torch.isfinite(session.next_token_logits(torch.tensor(prompt + [t])).max()) for t in top):
                return prompt
            prompt = [x for t in top for x in (body[-1], t)] + body
    raise AssertionError("no prompt found")


def test_combined_proposal_is_lossless(small):
    """Prompt lookup in the drafter's chosen tree. Greedy: plain decoding token for token on prompts whose
    continuation repeats (a 32-token vocabulary), with lookup nodes verified and accepted. Sampled (temperature 1,
    top-k 2): the first five new tokens follow the target's distribution (runs for power 0.8 against a 5%
    distortion), on a prompt after which lookup proposes at the first cycle whatever the first token."""
    drafter = SelfDrafter(small, noise=0.6)
    cfg = combined_config(drafter.name, max_new_tokens=24, stop_token_ids=())
    for prompt in random_prompts(4, seed=21, vocab=VOCAB):
        ref = autoregressive_generate(
            small, prompt, DecodeConfig(mode="ar", max_new_tokens=24, stop_token_ids=())
        )
        assert speculative_generate(small, drafter, prompt, cfg).token_ids == ref.token_ids
    lookup_hits = sum(v for k, v in cfg.speed.acceptance.hits.items() if k[0] == "lookup")
    assert lookup_hits > 0, "no lookup node was ever accepted"
    prompt = lookup_prompt(small)
    joint = exact_joint(small, prompt, N_TOKENS, 1.0, TOP_K)
    n_runs = runs_for_power(joint, POWER)
    sampled = combined_config(drafter.name, **SAMPLED)
    cfgs = [
        {
            k: getattr(sampled, k)
            for k in (
                "mode",
                "shape",
                "lookup",
                "speed",
                "tree_depth",
                "tree_top_k",
                "tree_budget",
                "lookup_tokens",
                "temperature",
                "top_k",
                "max_new_tokens",
                "stop_token_ids",
            )
        }
    ]
    counts, accepted, drafted, _ = sample_outcomes(small, drafter, cfgs, n_runs, joint, prompt)
    assert_follows(counts, joint, n_runs)
    assert 0.05 < accepted / drafted < 0.95, "the test needs both accepted and rejected drafts"
    assert sum(v for k, v in sampled.speed.acceptance.seen.items() if k[0] == "lookup") > 0
