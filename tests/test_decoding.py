"""The decoding engine is lossless at temperature 0 and keeps its KV caches exact.

Tiny random targets in fp32 on the CPU. A freshly initialized tiny model with tied embeddings mostly
repeats its input token, which makes a weak test; ``spread_target`` re-draws its weights with a larger
spread and unties the LM head, so that greedy outputs are varied and the top-2 logit gaps are far above
float noise. Comparisons stay exact (token equality, caches to 1e-5).

Drafters: the target itself (everything accepted), a random drafter (nearly everything rejected), the
target's first 4 layers (``early-exit-4``), drafters of the three paradigms trained here on the
target's own greedy continuations of the 50 test prompts (TTT), and scripted drafters that accept exactly
up to a chosen position. The trained drafters memorize those continuations (a drafter with its target KV
zeroed does as well on them), so their acceptance on the same prompts only shows that the equality test
runs through accepted drafts; whether a KV drafter *learns from the KV* is measured on held-out prompts of
a task that needs it, against its zeroed-KV control (``test_kv_drafter_beats_its_zeroed_kv_control...``).
"""

import pytest
import torch
from conftest import TEST_DEVICE, random_prompts, spread_target

from kvshot_lib import decoding
from kvshot_lib.decoding import DecodeConfig, autoregressive_generate, engine, speculative_generate
from kvshot_lib.drafters import (
    NgramDrafter,
    RandomDrafter,
    SelfDrafter,
    build_drafter,
    drafter_config_for,
    resolve_drafter,
)
from kvshot_lib.evaluation import metrics
from kvshot_lib.target import forward as seam
from kvshot_lib.training import Objective, TrainConfig, batch_from_target

N_PROMPTS = 50
MAX_NEW = 12
GREEDY_NEW = 8  # tokens per prompt in the 50-prompt equality test


@pytest.fixture(scope="module")
def qwen3():
    return spread_target("tiny-qwen3")


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(N_PROMPTS, seed=123)


@pytest.fixture(scope="module")
def reference(llama, prompts):
    """Plain greedy decoding of every prompt, without stop tokens."""
    cfg = DecodeConfig(mode="ar", max_new_tokens=MAX_NEW, stop_token_ids=())
    return [autoregressive_generate(llama, p, cfg).token_ids for p in prompts]


def train_on_reference(target, prompts, reference, paradigm: str, steps: int = 250):
    """A real drafter of ``paradigm`` trained (TTT, 3 steps) on the target's greedy continuations."""
    seqs = [torch.tensor(p + r) for p, r in zip(prompts, reference)]
    d2t = torch.unique(torch.cat([torch.tensor(r) for r in reference]))  # sorted draft vocabulary
    dcfg = drafter_config_for(target, paradigm, draft_vocab_size=len(d2t))
    drafter = build_drafter(dcfg, target, d2t, seed=0)
    batches = []
    for p, ids in zip(prompts, seqs):
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[len(p) - 1 :] = True  # positions that predict the continuation
        batches.append(batch_from_target(target, ids, mask, dcfg).to(target.model.device))
    objective = Objective(drafter, TrainConfig(paradigm=paradigm, regime="ttt", ttt_steps=3))
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for step in range(steps):
        loss, _ = objective(batches[step % len(batches)])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def trained(llama, prompts, reference):
    return {
        f"trained-{paradigm}": train_on_reference(llama, prompts, reference, paradigm)
        for paradigm in ("hidden", "kv", "hybrid")
    }


class ScriptedSession:
    """Drafts the reference continuation, except a wrong token at draft step ``wrong_at`` of every cycle."""

    d2t = None
    hidden_layers = ()

    def __init__(self, full: list[int], vocab: int, wrong_at: int | None):
        self.full, self.vocab, self.wrong_at = full, vocab, wrong_at

    def _logits(self, pos: int, step: int) -> torch.Tensor:
        logits = torch.zeros(self.vocab, device=TEST_DEVICE)
        token = self.full[pos] if pos < len(self.full) else 0
        if step == self.wrong_at:
            token = (token + 1) % self.vocab
        logits[token] = 10.0
        return logits

    def start_cycle(self, committed, view):
        self.P1, self.depths = committed.shape[1], []
        return self._logits(self.P1, 0)

    def expand(self, tokens, parents):
        rows = []
        for p in parents.tolist():
            self.depths.append(0 if p < 0 else self.depths[p] + 1)
            rows.append(self._logits(self.P1 + self.depths[-1] + 1, self.depths[-1] + 1))
        return torch.stack(rows)

    def end_cycle(self):
        pass


class Scripted:
    name = "scripted"

    def __init__(self, full, vocab, wrong_at=None):
        self.full, self.vocab, self.wrong_at = full, vocab, wrong_at

    def new_session(self):
        return ScriptedSession(self.full, self.vocab, self.wrong_at)


MODES = [("chain", dict(chain_depth=k)) for k in (1, 2, 3, 5, 8)] + [
    ("tree", dict(tree_depth=5, tree_top_k=3, tree_budget=12))
]


@pytest.mark.parametrize(
    "drafter_name",
    # the drafters that accept next to nothing, or that tests/test_static_cache.py and
    # test_decoding_sampling.py's real drafter classes also hold to plain decoding, run in make test-slow (CI runs
    # it), so that make test keeps within its 10 minutes
    ["self"]
    + [
        pytest.param(d, marks=pytest.mark.slow)
        for d in ("random", "early-exit-4", "trained-hidden", "trained-kv", "trained-hybrid")
    ],
)
def test_greedy_equals_plain_decoding_on_50_prompts(llama, prompts, reference, drafter_name, request):
    if drafter_name.startswith("trained-"):
        drafter = request.getfixturevalue("trained")[drafter_name]
    else:
        drafter = resolve_drafter(drafter_name, llama, seed=7)
    for mode, kw in MODES:
        cfg = DecodeConfig(mode=mode, max_new_tokens=GREEDY_NEW, stop_token_ids=(), **kw)
        accepted = drafted = 0
        for prompt, ref in zip(prompts, reference):
            out = speculative_generate(llama, drafter, prompt, cfg)
            assert out.token_ids == ref[:GREEDY_NEW], (
                f"{drafter_name} {mode} {kw}: differs from plain greedy decoding"
            )
            accepted += sum(out.step_accepts)
            drafted += sum(out.step_attempts)
        rate = accepted / drafted
        if drafter_name == "self":
            assert rate >= 0.98, f"self-drafting accepted only {rate:.3f}"
        elif drafter_name == "random":
            assert rate < 0.02
        elif drafter_name.startswith("trained-"):  # not evidence of learning (see the module docstring)
            assert rate > 0.2, (
                f"{drafter_name} accepted {rate:.3f}: the test hardly exercises accepted drafts"
            )
        else:
            assert 0.02 < rate < 0.98, f"the stand-in drafter should be partly right, got {rate:.3f}"


@pytest.mark.parametrize("mode,kw", [MODES[3], MODES[5]])
def test_greedy_equality_on_qwen3(qwen3, mode, kw):
    drafter = resolve_drafter("early-exit-4", qwen3)
    for prompt in random_prompts(10, seed=5):
        ref = autoregressive_generate(
            qwen3, prompt, DecodeConfig(mode="ar", max_new_tokens=MAX_NEW)
        ).token_ids
        cfg = DecodeConfig(mode=mode, max_new_tokens=MAX_NEW, **kw)
        assert speculative_generate(qwen3, drafter, prompt, cfg).token_ids == ref


def test_ngram_drafter_is_lossless_and_helps_on_repetitive_text(llama, tiny_llama):
    """Lossless on the spread target (whose varied output gives prompt lookup nothing to find), and a help on
    the plain tiny target, whose greedy output repeats a token for a while: there prompt lookup drafts the
    repetition and most cycles accept several drafts."""
    prompt = random_prompts(1, seed=9)[0] * 3  # repeated text: prompt lookup has something to find
    for target, helps in ((llama, False), (tiny_llama, True)):
        ref = autoregressive_generate(target, prompt, DecodeConfig(mode="ar", max_new_tokens=24)).token_ids
        for mode in ("chain", "tree"):
            out = speculative_generate(
                target,
                NgramDrafter(target.info.vocab_size),
                prompt,
                DecodeConfig(mode=mode, max_new_tokens=24),
            )
            assert out.token_ids == ref
            if helps:  # 24 tokens in at most 10 cycles (plain decoding takes 23 after the prefill's)
                assert metrics.mean_accepted_tokens(out.accepted_per_cycle) >= 2.5 and out.n_cycles <= 10, (
                    mode,
                    out.accepted_per_cycle,
                )


def test_all_accepted_plus_bonus(llama, prompts, reference):
    k = 4
    for prompt, ref in zip(prompts[:10], reference[:10]):
        out = speculative_generate(
            llama,
            Scripted(prompt + ref, 49152),
            prompt,
            DecodeConfig(mode="chain", chain_depth=k, max_new_tokens=MAX_NEW, stop_token_ids=()),
        )
        assert out.token_ids == ref
        # 1 token from the prefill, then full cycles of k drafts + the bonus; the last cycle is capped
        full, rest = divmod(MAX_NEW - 1, k + 1)
        assert out.accepted_per_cycle == [k] * full + ([rest - 1] if rest > 1 else [])
        assert out.step_attempts == out.step_accepts


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_rejection_at_every_position(llama, prompts, reference, mode):
    k = 5
    for wrong_at in range(k):
        for prompt, ref in zip(prompts[:4], reference[:4]):
            cfg = DecodeConfig(
                mode=mode,
                chain_depth=k,
                tree_depth=k,
                tree_top_k=1,
                tree_budget=k,
                max_new_tokens=MAX_NEW,
                stop_token_ids=(),
            )
            out = speculative_generate(llama, Scripted(prompt + ref, 49152, wrong_at), prompt, cfg)
            assert out.token_ids == ref
            expected, produced = [], 1
            while produced < MAX_NEW:
                depth = min(k, MAX_NEW - produced - 1)
                if depth > 0:
                    expected.append(min(wrong_at, depth))
                produced += (expected[-1] if depth > 0 else 0) + 1
            assert out.accepted_per_cycle == expected
            assert out.step_accepts[wrong_at] == 0 and out.step_attempts[wrong_at] > 0


def test_stop_token_at_every_index_of_a_block(llama, prompts, reference):
    k = 4
    block_start = 1 + (k + 1)  # prefill token, then one full cycle; the second cycle's block starts here
    tested = [0] * (k + 1)
    for prompt, ref in zip(prompts, reference):
        for i in range(k + 1):  # index in the block; i == k is the bonus token
            stop = ref[block_start + i]
            if stop in ref[: block_start + i] or tested[i] >= 2:
                continue
            expected = ref[: block_start + i + 1]
            for mode in ("chain", "tree"):
                cfg = DecodeConfig(
                    mode=mode,
                    chain_depth=k,
                    tree_depth=k,
                    tree_top_k=1,
                    tree_budget=k,
                    max_new_tokens=MAX_NEW,
                    stop_token_ids=(stop,),
                )
                out = speculative_generate(llama, Scripted(prompt + ref, 49152), prompt, cfg)
                assert out.token_ids == expected and out.stop_reason == "stop_token"
            ar = autoregressive_generate(
                llama, prompt, DecodeConfig(mode="ar", max_new_tokens=MAX_NEW, stop_token_ids=(stop,))
            )
            assert ar.token_ids == expected
            tested[i] += 1
    assert tested == [2] * (k + 1)


def test_max_new_tokens_reached_inside_a_block(llama, prompts, reference):
    prompt, ref = prompts[0], reference[0]
    for max_new in range(0, MAX_NEW + 1):
        for mode in ("chain", "tree"):
            cfg = DecodeConfig(
                mode=mode,
                chain_depth=5,
                tree_depth=5,
                tree_top_k=2,
                tree_budget=8,
                max_new_tokens=max_new,
                stop_token_ids=(),
            )
            out = speculative_generate(llama, SelfDrafter(llama), prompt, cfg)
            assert out.token_ids == ref[:max_new]


def test_context_limit_is_respected(llama, prompts, reference):
    prompt, ref = prompts[0], reference[0]
    limit = len(prompt) + 7
    info = llama.info
    small = type(llama)(llama.model, llama.tokenizer, type(info)(**{**info.as_dict(), "max_context": limit}))
    for mode in ("ar", "chain", "tree"):
        out = speculative_generate(
            small,
            SelfDrafter(llama),
            prompt,
            DecodeConfig(mode=mode, max_new_tokens=MAX_NEW, stop_token_ids=()),
        )
        assert out.token_ids == ref[: limit - len(prompt)] and out.stop_reason == "context"


def _assert_cache_matches_prefill(model, cache, committed):
    assert cache.get_seq_length() == committed.shape[1]
    fresh = seam.new_cache(model)
    seam.forward(model, committed, fresh)
    for got, want in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=0)


class Recording:
    """Wraps a factory and keeps its sessions, to inspect the drafter's cache."""

    def __init__(self, inner):
        self.inner, self.name, self.sessions = inner, inner.name, []

    def new_session(self):
        self.sessions.append(self.inner.new_session())
        return self.sessions[-1]


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_caches_hold_exactly_the_committed_tokens_after_every_cycle(prompts, monkeypatch, mode):
    # A milder spread keeps activations O(1), so that 1e-5 is an absolute tolerance worth the name
    # (with std 0.2 the keys reach ~6 and float noise across 8 layers reaches ~1.5e-5).
    llama = spread_target("tiny-llama", std=0.1)
    compacted = []
    original = engine.keep_block_positions

    def spy(cache, start, keep):
        compacted.append(keep != list(range(len(keep))))
        original(cache, start, keep)

    monkeypatch.setattr(engine, "keep_block_positions", spy)
    drafter = Recording(resolve_drafter("early-exit-4", llama))
    checked = 0

    def check(committed, cache):
        nonlocal checked
        _assert_cache_matches_prefill(llama.model, cache, committed)
        session = drafter.sessions[-1]  # the drafter's cache: the committed tokens it has seen
        _assert_cache_matches_prefill(session.model, session.cache, committed[:, : session.n_committed])
        checked += 1

    cfg = DecodeConfig(
        mode=mode, chain_depth=4, tree_depth=4, tree_top_k=3, tree_budget=10, max_new_tokens=MAX_NEW
    )
    with torch.inference_mode():
        for prompt in prompts[:8]:
            speculative_generate(llama, drafter, prompt, cfg, on_cycle=check)
    assert checked > 20
    if mode == "tree":
        assert any(compacted), "no cycle accepted an off-first-branch path; compaction was not exercised"


def test_self_drafting_accepts_at_least_98_percent(llama, prompts):
    for mode, kw in [
        ("chain", dict(chain_depth=8)),
        ("tree", dict(tree_depth=6, tree_top_k=4, tree_budget=24)),
    ]:
        for temperature in (0.0, 1.0):
            acc = att = 0
            for prompt in prompts[:10]:
                out = speculative_generate(
                    llama,
                    SelfDrafter(llama),
                    prompt,
                    DecodeConfig(mode=mode, temperature=temperature, max_new_tokens=MAX_NEW, **kw),
                )
                acc, att = acc + sum(out.step_accepts), att + sum(out.step_attempts)
            if mode == "chain" or temperature == 0:  # a top-k tree at T=1 is not the draft distribution
                assert acc / att >= 0.98, f"{mode} T={temperature}: {acc / att:.3f}"


def test_random_drafter_sessions_are_reproducible(llama, prompts):
    """The same seed gives the same drafts and output; another seed gives other drafts (the output would not
    show it: at temperature 1 on a 49k vocabulary a random draft is almost never accepted)."""
    cfg = DecodeConfig(mode="chain", chain_depth=3, max_new_tokens=8, temperature=1.0, seed=3)
    a = speculative_generate(llama, RandomDrafter(49152, seed=1), prompts[0], cfg)
    b = speculative_generate(llama, RandomDrafter(49152, seed=1), prompts[0], cfg)
    assert a.token_ids == b.token_ids

    def drafts(drafter, sessions=1):
        s = [drafter.new_session() for _ in range(sessions)][-1]
        root = s.start_cycle(torch.tensor([prompts[0]]), None)  # [V]
        return torch.cat([root[None], s.expand(torch.tensor([5, 6]), torch.tensor([-1, 0]))])  # [3, V]

    one = drafts(RandomDrafter(49152, seed=1))
    assert torch.equal(one, drafts(RandomDrafter(49152, seed=1)))
    assert not torch.equal(one, drafts(RandomDrafter(49152, seed=2)))
    assert not torch.equal(one, drafts(RandomDrafter(49152, seed=1), sessions=2))  # a stream per session


def test_bad_inputs_fail_early(llama):
    with pytest.raises(ValueError, match="mode"):
        DecodeConfig(mode="beam").validate()
    with pytest.raises(ValueError, match="temperature"):
        DecodeConfig(temperature=-1).validate()
    with pytest.raises(ValueError, match="chain_depth"):
        DecodeConfig(chain_depth=0).validate()
    with pytest.raises(ValueError, match="Unknown drafter"):
        resolve_drafter("eagle-typo", llama)
    with pytest.raises(ValueError, match="needs a drafter"):
        decoding.generate(llama, [1, 2, 3], DecodeConfig(mode="chain"))
    with pytest.raises(ValueError, match="empty"):
        autoregressive_generate(llama, [], DecodeConfig(mode="ar"))


def zero_rooted_first_drafts(out) -> tuple[int, int]:
    """(cycles whose root is filler 0, how many of them accepted their first draft): there the target says
    the secret, which the drafter can only know from the target's K/V."""
    n = accepted = 0
    committed = 1  # the prefill's token
    for a in out.accepted_per_cycle:
        if out.token_ids[committed - 1] == 0:
            n, accepted = n + 1, accepted + (a >= 1)
        committed += a + 1
    return n, accepted


@pytest.mark.slow  # ~100 s; test_kv_copy_task.py holds the same control on the training side in make test
def test_kv_drafter_beats_its_zeroed_kv_control_on_held_out_prompts():
    """The hand-built secret-copy target (``secret_task.py``): after filler 0 it says the secret of its prompt.
    A KV-only drafter trained on 48 prompts, decoding 16 held-out ones through the engine (chain of 3):
    lossless, and its first draft after root 0 is accepted >= 90% of the time; the same architecture trained
    with the target KV zeroed (``target_kv="zeroed"``) stays near chance (1 in 8)."""
    from secret_task import greedy, secret_prompts, secret_target, trained_kv_drafter

    target, prompts = secret_target(), secret_prompts(16, seed=2)
    cfg = DecodeConfig(mode="chain", chain_depth=3, max_new_tokens=12, stop_token_ids=())
    rates = {}
    for target_kv in ("real", "zeroed"):
        n = accepted = 0
        for prompt, ref in zip(prompts, greedy(prompts)):
            out = speculative_generate(target, trained_kv_drafter(target_kv), prompt, cfg)
            assert out.token_ids == ref, f"{target_kv}: differs from plain greedy decoding"
            a, b = zero_rooted_first_drafts(out)
            n, accepted = n + a, accepted + b
        assert n >= 16  # every prompt has at least its first cycle rooted at 0
        rates[target_kv] = accepted / n
    assert rates["real"] >= 0.9, f"the KV-only drafter did not learn to draft the secret: {rates}"
    assert rates["zeroed"] <= 0.3, f"without the target's KV the control drafts the secret: {rates}"
