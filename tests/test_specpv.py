"""SpecPV: the partial KV cache, compact attention and the partial-verification loop (tiny targets, CPU).

The spread tiny targets (``conftest.spread_target``) have varied greedy outputs with wide logit gaps and
attend everywhere, so a small partial cache changes their choices: ``specpv`` mode diverges from plain
decoding there, which the strict-mode test shows before it shows ``strict`` equal to plain decoding.
"""

from dataclasses import replace

import pytest
import torch
from conftest import spread_target
from transformers import DynamicCache

from kvshot_lib.decoding import (
    BlockSummaries,
    DecodeConfig,
    PartialKVCache,
    PartialKVConfig,
    SpecPVConfig,
    autoregressive_generate,
    block_scores,
    compact_attention,
    generate,
    layout,
    selected_positions,
    specpv_generate,
    speculative_generate,
)
from kvshot_lib.drafters import (
    NgramDrafter,
    SelfDrafter,
    ancestor_matrix,
    resolve_drafter,
    tree_attention_mask,
)
from kvshot_lib.evaluation import FidelityProbe, rouge_l, shadow_full, specpv_fidelity
from kvshot_lib.target import forward as seam

SMALL = dict(budget=96, sink=32, window=32)  # R = 2 retrieved blocks of 16


@pytest.fixture(scope="module")
def qwen3():
    return spread_target("tiny-qwen3")


def long_prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 49152, (n,), generator=g).tolist()


def greedy(target, prompt, n):
    return autoregressive_generate(
        target, prompt, DecodeConfig(mode="ar", max_new_tokens=n, stop_token_ids=())
    ).token_ids


# ------------------------------------------------------------------------------------------ compact attention


class _Module:
    pass


@pytest.mark.parametrize("parents", [[], [-1, 0, 1], [-1, -1, 0, 0, 1, 3]])
def test_compact_attention_over_a_complete_selection_equals_sdpa(parents):
    """Every past position selected, in a different shuffled order per KV head: sdpa over the full K/V
    with the tree mask (GQA by repeating K/V heads) equals compact attention to 1e-6 in fp32."""
    g = torch.Generator().manual_seed(0)
    H, kvH, D, T = 6, 2, 16, 40
    q_len = len(parents) + 1
    past_k, past_v = torch.randn(2, 1, kvH, T, D, generator=g)  # [1, kvH, T, D] each
    new_k, new_v = torch.randn(2, 1, kvH, q_len, D, generator=g)
    query = torch.randn(1, H, q_len, D, generator=g)
    mask = tree_attention_mask(ancestor_matrix(parents), T, torch.float32)  # [1, 1, q, T + q]
    full_k = torch.cat([past_k, new_k], 2).repeat_interleave(H // kvH, 1)  # [1, H, T + q, D]
    full_v = torch.cat([past_v, new_v], 2).repeat_interleave(H // kvH, 1)
    want = torch.nn.functional.scaled_dot_product_attention(
        query, full_k, full_v, attn_mask=mask
    )  # [1, H, q, D]
    perm = torch.stack([torch.randperm(T, generator=g) for _ in range(kvH)])  # [kvH, T]
    idx = perm[None, :, :, None].expand(1, kvH, T, D)
    ck, cv = torch.cat([past_k.gather(2, idx), new_k], 2), torch.cat([past_v.gather(2, idx), new_v], 2)
    got, _ = compact_attention(_Module(), query, ck, cv, mask, scaling=D**-0.5)  # [1, q, H, D]
    assert (got.transpose(1, 2) - want).abs().max() <= 1e-6
    dropped = (
        torch.cat([past_k.gather(2, idx)[:, :, 1:], new_k], 2),
        torch.cat([past_v.gather(2, idx)[:, :, 1:], new_v], 2),
    )
    partial, _ = compact_attention(_Module(), query, *dropped, mask[..., 1:], scaling=D**-0.5)
    assert (partial.transpose(1, 2) - want).abs().max() > 1e-4  # the comparison can fail
    with pytest.raises(RuntimeError, match="explicit mask"):
        compact_attention(_Module(), query, ck, cv, None)


@pytest.mark.parametrize("length", [5, 32, 47, 48, 63, 100, 257])
def test_layout_covers_every_position_without_gap(length):
    cfg = PartialKVConfig(budget=96, sink=32, window=32)
    lay = layout(length, cfg)
    everything = selected_positions(lay, torch.arange(lay.n_candidates)[None], 16)[0]
    assert everything.tolist() == list(range(length))
    assert (lay.window_start - lay.sink_end) % 16 == 0
    if length >= 32 + 32:
        assert 32 <= length - lay.window_start < 32 + 16  # the window plus the incomplete tail block


def test_block_scores_bound_the_true_dot_products():
    """Quest's per-channel score is an upper bound of q·k over a block's keys; SpecPV's whole-vector score
    lies below it; both are averaged over the GQA group's queries."""
    g = torch.Generator().manual_seed(1)
    kvH, H, D, nb = 2, 4, 8, 5
    keys = torch.randn(1, kvH, 16 * nb, D, generator=g)
    q = torch.randn(H, 1, D, generator=g)
    s = BlockSummaries(0, 16)
    kmax, kmin = s.update(0, keys, nb)
    quest, vector = block_scores(q, kmax, kmin, "quest"), block_scores(q, kmax, kmin, "vector")
    blocks = keys[0].reshape(kvH, nb, 16, D)
    for h in range(H):
        true_max = (blocks[h // 2] @ q[h, 0]).amax(-1)  # [nb]
        per_head = (q[h, 0].clamp(min=0) * kmax[h // 2] + q[h, 0].clamp(max=0) * kmin[h // 2]).sum(-1)
        assert (per_head >= true_max - 1e-5).all()

    def group(k):  # the mean of Quest's bound over the two query heads of KV head k
        bounds = [
            (q[2 * k + j, 0].clamp(min=0) * kmax[k] + q[2 * k + j, 0].clamp(max=0) * kmin[k]).sum(-1)
            for j in range(2)
        ]
        return torch.stack(bounds).mean(0)

    assert torch.allclose(quest, torch.stack([group(0), group(1)]), atol=1e-5)
    assert (vector <= quest + 1e-5).all()
    more = torch.cat([keys, torch.randn(1, kvH, 16, D, generator=g)], 2)  # a block completes: incremental
    kmax2, _ = s.update(0, more, nb + 1)
    assert torch.equal(kmax2[:, :nb], kmax) and torch.allclose(kmax2[:, nb], more[0, :, -16:].amax(1))


# ------------------------------------------------------------------------------------------------ the loop


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_complete_budget_gives_full_logits_and_plain_output(name, llama, qwen3):
    """A budget of at least the context, verified partially anyway (``always_partial``): at every step the
    compact cache's logits equal a full verification's (the shadow forward), and the greedy output is
    plain decoding's; in tree mode too (tree masks on the compact cache)."""
    target = {"llama": llama, "qwen3": qwen3}[name]
    prompt = long_prompt(70, seed=3)
    ref = greedy(target, prompt, 24)
    for mode, drafter in (
        ("tree", SelfDrafter(target, noise=2.0)),
        ("chain", resolve_drafter("early-exit-4", target)),
    ):
        steps = []

        def probe(step, steps=steps):
            full_logits, _ = shadow_full(step)
            scale = full_logits.abs().max().item()
            steps.append((step.logits - full_logits).abs().max().item() / scale)

        cfg = DecodeConfig(
            mode=mode,
            max_new_tokens=24,
            stop_token_ids=(),
            tree_depth=3,
            tree_top_k=2,
            tree_budget=5,
            small_batch_kernel=False,  # the same matmul for every block size
        )
        pv = SpecPVConfig(budget=256, sink=32, window=32, full_every=8, always_partial=True)
        out = specpv_generate(target, drafter, prompt, cfg, pv, on_partial=probe)
        assert out.token_ids == ref
        assert out.n_partial >= 5 and len(steps) == out.n_partial
        # relative to the largest logit: the full pass runs more rows (the re-fed pending tokens), so BLAS
        # sums in another order; a partial cache that missed one position is off by orders more
        assert max(steps) <= 1e-5


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_full_every_zero_is_lossless_decoding(llama, mode, temperature):
    prompt = long_prompt(150, seed=4)
    cfg = DecodeConfig(mode=mode, max_new_tokens=30, stop_token_ids=(), temperature=temperature, seed=7)
    # a fresh drafter each: a noisy self-drafter's noise stream is seeded per session it has opened
    want = speculative_generate(llama, SelfDrafter(llama, noise=2.0), prompt, cfg)
    got = specpv_generate(
        llama, SelfDrafter(llama, noise=2.0), prompt, cfg, SpecPVConfig(full_every=0, **SMALL)
    )
    assert got.token_ids == want.token_ids
    assert got.accepted_per_cycle == want.accepted_per_cycle
    assert got.n_partial == 0 and set(got.cycle_kind) == {"full"}


@pytest.mark.parametrize("strict", [False, True])
def test_full_cache_equals_a_fresh_prefill_after_every_full_pass(llama, strict):
    prompt = long_prompt(200, seed=5)
    checked = []

    def on_full(committed, cache):
        fresh = seam.new_cache(llama.model)
        seam.forward(llama.model, committed, fresh)
        assert cache.get_seq_length() == committed.shape[1]
        for a, b in zip(cache.layers, fresh.layers):  # float noise relative to the largest entry: the re-fed
            # block and the fresh prefill run different row counts, so BLAS (and the small-batch kernel) sum in
            # another order; a wrong or missing position is off by orders more
            for x, y in ((a.keys, b.keys), (a.values, b.values)):
                assert (x - y).abs().max() <= 1e-5 * y.abs().max()
        checked.append(committed.shape[1])

    cfg = DecodeConfig(mode="chain", max_new_tokens=40, stop_token_ids=(), chain_depth=3)
    out = specpv_generate(
        llama,
        SelfDrafter(llama, noise=2.0),
        prompt,
        cfg,
        SpecPVConfig(full_every=6, strict=strict, **SMALL),
        on_full=on_full,
    )
    assert out.n_partial > 0 and len(checked) >= 3


@pytest.mark.parametrize("drafter_name", ["none", "ngram", "self"])
def test_strict_equals_plain_decoding_where_specpv_diverges(llama, drafter_name):
    prompt = long_prompt(300, seed=0)
    n = 48
    ref = greedy(llama, prompt, n)
    drafter = {"none": None, "ngram": NgramDrafter(49152), "self": SelfDrafter(llama, noise=2.0)}[
        drafter_name
    ]
    cfg = DecodeConfig(
        mode="ar" if drafter is None else "chain", max_new_tokens=n, stop_token_ids=(), chain_depth=4
    )
    loose = specpv_generate(llama, drafter, prompt, cfg, SpecPVConfig(full_every=8, **SMALL))
    assert loose.n_partial > 0 and loose.token_ids != ref  # partial verification alone drifts here
    strict = specpv_generate(llama, drafter, prompt, cfg, SpecPVConfig(full_every=8, strict=True, **SMALL))
    assert strict.token_ids == ref
    assert strict.rollbacks and all(1 <= r <= 8 + 4 for r in strict.rollbacks)
    # SpecPV builds its partial cache from a DynamicCache: asked for the static one (a GPU's default), it keeps to it
    static, kinds = replace(cfg, target_cache="static"), set()
    pv = SpecPVConfig(full_every=8, strict=True, **SMALL)
    out = specpv_generate(llama, drafter, prompt, static, pv, on_full=lambda c, cache: kinds.add(type(cache)))
    assert out.token_ids == ref and kinds == {DynamicCache}


def test_strict_checks_output_that_ends_on_partially_verified_tokens(llama):
    """A stop token chosen on partial logits is checked before generation ends. The premise is asserted: the
    loose run with the same stop token ends on it, after tokens verified only partially, and differs from
    plain decoding among those tokens (after its last full pass); so a strict run that skipped the final
    check would end there too."""
    prompt = long_prompt(300, seed=0)
    ref = greedy(llama, prompt, 40)
    loose = specpv_generate(
        llama,
        None,
        prompt,
        DecodeConfig(mode="ar", max_new_tokens=40, stop_token_ids=()),
        SpecPVConfig(full_every=8, **SMALL),
    )
    stop = loose.token_ids[5]  # a token the partial verifier emits early but plain decoding may not
    cfg = DecodeConfig(mode="ar", max_new_tokens=40, stop_token_ids=(stop,))
    want = autoregressive_generate(llama, prompt, cfg).token_ids
    exact = []  # tokens generated with exact K/V at each full pass (the prefill's token is the first)
    pv = SpecPVConfig(full_every=8, **SMALL)
    stopped = specpv_generate(
        llama, None, prompt, cfg, pv, on_full=lambda c, _: exact.append(c.shape[1] - 300)
    )
    assert stopped.token_ids[-1] == stop and stopped.stop_reason == "stop_token"
    diverges_at = specpv_fidelity.first_divergence(stopped.token_ids, want)
    assert stopped.token_ids != want and diverges_at >= max(exact, default=1), (
        "premise: a wrong unchecked tail"
    )
    got = specpv_generate(llama, None, prompt, cfg, SpecPVConfig(full_every=8, strict=True, **SMALL))
    assert got.token_ids == want and ref[: len(want)] == want[: len(ref)]
    assert got.rollbacks  # the final check rolled back the wrong tail


def test_fidelity_probe_and_rouge(llama):
    assert rouge_l("the cat sat on the mat", "the cat sat on the mat") == 1.0
    assert rouge_l("a b c d", "a x c y") == pytest.approx(0.5)  # LCS "a c": P = R = 1/2
    assert rouge_l("", "a") == 0.0
    probe = FidelityProbe()
    cfg = DecodeConfig(mode="chain", max_new_tokens=20, stop_token_ids=(), chain_depth=3)
    pv = SpecPVConfig(budget=1024, full_every=8, always_partial=True)
    specpv_generate(llama, SelfDrafter(llama, noise=2.0), long_prompt(60), cfg, pv, on_partial=probe)
    assert probe.rows and all(r["top1_agree"] and r["kl"] < 1e-6 and r["cosine"] > 0.9999 for r in probe.rows)
    assert {r["distance"] for r in probe.rows} >= {1, 2}  # rows at several distances since the full pass
    small = FidelityProbe()
    specpv_generate(
        llama,
        None,
        long_prompt(300),
        DecodeConfig(mode="ar", max_new_tokens=20, stop_token_ids=()),
        SpecPVConfig(full_every=8, **SMALL),
        on_partial=small,
    )
    assert min(r["cosine"] for r in small.rows) < 0.999  # a small budget moves the hidden states


def test_generate_dispatches_partial_verification(llama):
    prompt = long_prompt(120)
    cfg = DecodeConfig(mode="chain", max_new_tokens=12, stop_token_ids=())
    out = generate(
        llama, prompt, cfg, SelfDrafter(llama), partial=SpecPVConfig(full_every=4, strict=True, **SMALL)
    )
    assert out.token_ids == greedy(llama, prompt, 12) and out.n_partial > 0


# ------------------------------------------------------------------------------------------------ settings


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(budget=-16), "non-negative"),
        (dict(budget=100), "must divide"),
        (dict(block_size=24), "must divide"),
        (dict(full_every=-1), "full_every"),
        (dict(budget=32), "below sink"),
        (dict(score="dot"), "score"),
        (dict(block_size=0), "at least 1"),
    ],
)
def test_bad_settings_fail_with_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpecPVConfig(**kwargs).validate()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--budget", "-16"], "non-negative"),
        (["--budget", "1000"], "must divide"),
        (["--full-every", "-1"], "full_every"),
        (["--block-size", "24"], "must divide"),
    ],
)
def test_cli_rejects_bad_partial_settings_before_loading(monkeypatch, flags, message):
    from kvshot_lib import cli
    from kvshot_lib.decoding import cli as decoding_cli

    monkeypatch.setattr(decoding_cli, "load_cli_target", lambda args: pytest.fail("the target was loaded"))
    with pytest.raises(SystemExit, match=message):
        cli.main(["generate", "--drafter", "ngram", "--verify", "partial", "--prompt", "hi", *flags])
    with pytest.raises(SystemExit, match="needs --verify partial"):
        cli.main(["generate", "--drafter", "ngram", "--strict", "--prompt", "hi"])


def test_partial_cache_refresh_selects_top_blocks(llama):
    """With more candidate blocks than R, each KV head keeps the R best-scoring blocks, sorted, between the
    sinks and the window; the compact K/V are the full cache's at those positions. The expected blocks are
    worked out here from the raw keys, not from the code's summaries: 250 tokens, 32 sinks, blocks of 16,
    a 32-token window. After the sinks, 13 complete blocks (positions 32..239) and a tail of 10; the last 2
    complete blocks and the tail are the window (208..249), so the candidates are the 11 blocks of
    positions 32 + 16 b .. 47 + 16 b, b = 0..10, of which R = 2 are kept."""
    model = llama.model
    cache = seam.new_cache(model)
    seam.forward(model, torch.tensor([long_prompt(250)], device=model.device), cache)
    cfg = PartialKVConfig(**SMALL)
    g = torch.Generator().manual_seed(0)
    H, D = model.config.num_attention_heads, model.config.head_dim
    queries = {
        li: torch.randn(1, H, 3, D, generator=g).to(model.device)
        for li in range(model.config.num_hidden_layers)
    }
    partial = PartialKVCache(cfg)
    partial.refresh(cache, queries, model.config)
    lay = layout(250, cfg)
    assert (lay.sink_end, lay.n_candidates, lay.window_start) == (32, 11, 208)
    for li, layer in enumerate(cache.layers):
        keys = layer.keys[0]  # [kvH, 250, D]
        kvh = keys.shape[0]
        group = H // kvh
        for h in range(kvh):
            scores = []
            for b in range(11):
                block = keys[h, 32 + 16 * b : 48 + 16 * b]  # [16, D]: the raw keys of candidate b
                kmax, kmin = block.amax(0), block.amin(0)
                q = queries[li][0, h * group : (h + 1) * group].reshape(-1, D)  # the group's queries [g*3, D]
                scores.append(torch.maximum(q * kmax, q * kmin).sum(-1).mean())  # Quest's bound, averaged
            best = sorted(torch.stack(scores).topk(2).indices.tolist())
            want = [*range(32), *(p for b in best for p in range(32 + 16 * b, 48 + 16 * b)), *range(208, 250)]
            assert partial.positions[li][h].tolist() == want, (li, h)
            assert torch.equal(partial.cache.layers[li].keys[0, h], keys[h, want])
            assert torch.equal(partial.cache.layers[li].values[0, h], layer.values[0, h, want])
    assert partial.n_static == 32 + 2 * 16 + 42
