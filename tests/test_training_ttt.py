"""EAGLE-3's TTT attention pattern by hand, and the training losses against references computed directly."""

import pytest
import torch

from kvshot_lib.drafters import (
    Segment,
    TargetView,
    UnrollContext,
    apply_rope,
    build_drafter,
    drafter_config_for,
    segmented_attention,
    ttt_attention_mask,
)
from kvshot_lib.training import TrainConfig, answer_positions, batch_from_target, regime_loss

# Rows: (step k, branch i) step-major for n=3 branches, K=3 steps; columns: own keys (step s, index j).
HAND_HIDDEN = [
    [1, 0, 0, 0, 0, 0, 0, 0, 0],  # step 0, i=0: own context j <= 0
    [1, 1, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 0, 0, 0, 0, 0, 0],
    [1, 0, 0, 1, 0, 0, 0, 0, 0],  # step 1, i=0: context j <= 0, plus its own step-1 key
    [1, 1, 0, 0, 1, 0, 0, 0, 0],
    [1, 1, 1, 0, 0, 1, 0, 0, 0],
    [1, 0, 0, 1, 0, 0, 1, 0, 0],  # step 2, i=0: context, its step-1 and step-2 keys
    [1, 1, 0, 0, 1, 0, 0, 1, 0],
    [1, 1, 1, 0, 0, 1, 0, 0, 1],
]
HAND_KV_ONLY = [  # the KV-only drafter has no own context: its step-0 key is the root only
    [1, 0, 0, 0, 0, 0, 0, 0, 0],
    [0, 1, 0, 0, 0, 0, 0, 0, 0],
    [0, 0, 1, 0, 0, 0, 0, 0, 0],
    [1, 0, 0, 1, 0, 0, 0, 0, 0],
    [0, 1, 0, 0, 1, 0, 0, 0, 0],
    [0, 0, 1, 0, 0, 1, 0, 0, 0],
    [1, 0, 0, 1, 0, 0, 1, 0, 0],
    [0, 1, 0, 0, 1, 0, 0, 1, 0],
    [0, 0, 1, 0, 0, 1, 0, 0, 1],
]


def test_ttt_mask_by_hand():
    assert ttt_attention_mask(3, 3).int().tolist() == HAND_HIDDEN
    assert ttt_attention_mask(3, 3, own_context=False).int().tolist() == HAND_KV_ONLY


@pytest.mark.parametrize("own_context,with_target", [(True, False), (False, True), (True, True)])
def test_segmented_unroll_equals_dense_masked_attention(own_context, with_target):
    """The unroll's segments give exactly softmax attention over all keys under ``ttt_attention_mask``."""
    g = torch.Generator().manual_seed(0)
    B, kvh, grp, n, D, K = 2, 2, 3, 6, 8, 4

    def r(*shape):
        return torch.randn(*shape, generator=g)

    tk, tv = r(B, kvh, n + 1, D), r(B, kvh, n + 1, D)
    ctx = UnrollContext(
        n, "cpu", {0: (tk, tv)} if with_target else None, own_context, target_in_self=with_target
    )
    own_mask = ttt_attention_mask(n, K, own_context)  # [K*n, K*n]
    keys, values = [], []
    for k in range(K):
        ctx.step = k
        q, kk, vv = r(B, kvh * grp, n, D), r(B, kvh, n, D), r(B, kvh, n, D)
        got = segmented_attention(q, ctx.self_segments(0, kk, vv))  # [B, h, n, D]
        keys.append(kk)
        values.append(vv)
        allk, allv = torch.cat(keys, 2), torch.cat(values, 2)  # [B, kvH, (k+1)*n, D]
        mask = own_mask[k * n : (k + 1) * n, : (k + 1) * n]
        if with_target:
            allk, allv = torch.cat([tk[:, :, :n], allk], 2), torch.cat([tv[:, :, :n], allv], 2)
            mask = torch.cat([torch.ones(n, n, dtype=torch.bool).tril(), mask], 1)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, allk.repeat_interleave(grp, 1), allv.repeat_interleave(grp, 1), attn_mask=mask
        )
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_target_segment_equals_dense_attention(with_bias, dtype):
    """The KV drafter's separate target-KV softmax (with its learned recency bias, folded with the mask into
    one pass) and the fused SDPA path (float32, no bias) against dense attention, outputs and gradients."""
    g = torch.Generator().manual_seed(1)
    B, kvh, grp, n, S, D = 2, 3, 2, 7, 9, 8
    q = torch.randn(B, kvh * grp, n, D, generator=g).requires_grad_()
    k, v = torch.randn(B, kvh, S, D, generator=g), torch.randn(B, kvh, S, D, generator=g)
    mask = torch.ones(n, S, dtype=torch.bool).tril(S - n)  # [n, S] causal, the last row sees every key
    bias = torch.randn(kvh * grp, n, S, generator=g).requires_grad_() if with_bias else None
    seg = Segment(k.to(dtype), v.to(dtype), "dense", mask)
    seg.bias = bias
    got = segmented_attention(q.to(dtype), [seg])
    scores = torch.zeros(kvh * grp, n, S) if bias is None else bias
    ref = torch.nn.functional.scaled_dot_product_attention(
        q,
        k.repeat_interleave(grp, 1),
        v.repeat_interleave(grp, 1),
        attn_mask=scores.masked_fill(~mask, -torch.inf),
    )
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.05)
    torch.testing.assert_close(got.float(), ref, **tol)
    w = torch.randn(ref.shape, generator=g)
    grads = torch.autograd.grad((got.float() * w).sum(), [q, *([bias] if with_bias else [])])
    want = torch.autograd.grad((ref * w).sum(), [q, *([bias] if with_bias else [])])
    for a, b in zip(grads, want):
        torch.testing.assert_close(a.float(), b, **tol)


@pytest.fixture(scope="module")
def sequence():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 3000, (14,), generator=g)
    mask = torch.rand(14, generator=g) < 0.7
    return ids, mask


KV_LAYOUTS = [(m, s) for m in ("concat", "linear", "linear_rope") for s in ("separate", "shared")]


@pytest.mark.parametrize(
    "paradigm,kv_mode,kv_softmax",
    [("hidden", "linear_rope", "separate"), ("hybrid", "linear_rope", "separate")]
    + [("kv", m, s) for m, s in KV_LAYOUTS],
)
@pytest.mark.parametrize("regime,K", [("tf", 1), ("ttt", 3), ("ttt_dense", 3)])
def test_loss_matches_direct_reference(tiny_llama, sequence, paradigm, kv_mode, kv_softmax, regime, K):
    """The regime's token loss equals a per-branch, per-step soft cross-entropy computed with decode sessions,
    for every KV injection mode and softmax layout of the KV drafter."""
    ids, lmask = sequence
    T = len(ids)
    recency = 4 if paradigm == "kv" else 0  # the learned recency bias on the target's scores, as trained
    cfg = drafter_config_for(
        tiny_llama, paradigm, kv_mode=kv_mode, draft_vocab_size=512, kv_softmax=kv_softmax, kv_recency=recency
    )
    d = build_drafter(cfg, tiny_llama, torch.arange(512) * 7, seed=0).eval()
    batch = batch_from_target(tiny_llama, ids, lmask, cfg)
    loss, parts = regime_loss(d, batch, d(batch, K), regime, step_decay=0.8)
    with torch.no_grad():
        out = tiny_llama.model(input_ids=ids[None], use_cache=True, output_hidden_states=True)
        p_target = torch.softmax(out.logits[0][:, d.d2t], -1)  # [T, V_draft] the target over the draft vocab
    per_step = [[] for _ in range(K)]
    for i in range(T - 1):
        P = i + 1
        cache = tiny_llama.model(input_ids=ids[None, :P], use_cache=True).past_key_values
        view = TargetView(cache, {j: out.hidden_states[j + 1][:, :P] for j in range(8)})
        s = d.new_session()
        logits = [s.start_cycle(ids[None, : P + 1], view)]
        for k in range(1, K):
            if P + k < T:
                logits.append(s.expand(ids[P + k : P + k + 1], torch.tensor([k - 2]))[0])
        for k, lg in enumerate(logits):
            if P + 1 + k < T and lmask[P + 1 + k]:  # predicted token exists and is an assistant token
                per_step[k].append(-(p_target[P + k] * torch.log_softmax(lg, -1)).sum())
    means = [torch.stack(x).mean() for x in per_step]
    weights = [1.0 if regime == "ttt_dense" else 0.8**k for k in range(K)]
    reference = sum(w * m for w, m in zip(weights, means))
    torch.testing.assert_close(loss, reference, atol=1e-4, rtol=1e-5)
    assert parts["n"] == [len(x) for x in per_step]


def test_answer_positions_by_hand():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1], [1, 1, 0, 1, 0, 0, 0, 1]], dtype=torch.bool)
    assert answer_positions(mask).tolist() == [[-1, -1, 0, 1, 2, -1, 0, 1], [0, 1, -1, 0, -1, -1, -1, 0]]


def test_answer_start_weight_is_the_weighted_mean_of_the_two_parts(tiny_llama):
    """Weighing each answer's first n tokens by w gives, at every step, (w S_a + S_b) / (w n_a + n_b), where
    S_a / n_a and S_b / n_b are the plain losses with the mask cut to the answers' starts and to the rest."""
    ids = torch.randint(0, 3000, (20,), generator=torch.Generator().manual_seed(5))
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    n, w, K = 3, 4.0, 3
    starts = mask & (answer_positions(mask) < n)
    cfg = drafter_config_for(tiny_llama, "hidden", draft_vocab_size=512)
    d = build_drafter(cfg, tiny_llama, torch.arange(512) * 7, seed=0).eval()

    def loss(m, answer_start=(0, 1.0)):
        batch = batch_from_target(tiny_llama, ids, m, cfg)
        return regime_loss(d, batch, d(batch, K), "ttt", 0.8, answer_start=answer_start)

    weighted, parts = loss(mask, (n, w))
    plain, plain_parts = loss(mask)
    _, a = loss(starts)
    _, b = loss(mask & ~starts)
    assert min(a["n"]) > 0 and min(b["n"]) > 0  # both parts count at every step
    want = sum(
        0.8**k * (w * ca * na + cb * nb) / (w * na + nb)
        for k, (ca, na, cb, nb) in enumerate(zip(a["ce"], a["n"], b["ce"], b["n"]))
    )
    weighted, plain = float(weighted.detach()), float(plain.detach())
    assert weighted == pytest.approx(want, rel=1e-5)
    assert weighted != pytest.approx(plain, rel=5e-5)  # the weight moved it (an untrained drafter: a little)
    assert parts["ce"] == pytest.approx(plain_parts["ce"])  # the logged cross-entropy stays the plain mean
    # a config at the default weight saves as runs did before the keys existed; a set one is saved and read back
    assert "answer_start_weight" not in TrainConfig("hidden", "ttt").as_dict()
    starts = TrainConfig("hidden", "ttt", answer_start_weight=w, answer_start_tokens=n)
    assert TrainConfig.from_params(starts.as_dict()) == starts


def test_block_kv_alignment_against_direct_reference(tiny_llama, sequence):
    """TTT-dense: a one-layer KV-only drafter's own key at step s, branch i, is k_proj(norm(emb(x_{i+1+s}))) at
    position i+1+s; the loss regresses it (and the value) onto the target's cached K/V at that position."""
    ids, lmask = sequence
    T, K = len(ids), 3
    cfg = drafter_config_for(tiny_llama, "kv", draft_vocab_size=512)
    d = build_drafter(cfg, tiny_llama, torch.arange(512), seed=0)
    batch = batch_from_target(tiny_llama, ids, torch.zeros(T, dtype=torch.bool), cfg)  # no token loss at all
    loss, parts = regime_loss(d, batch, d(batch, K), "ttt_dense", 1.0, kv_align_weight=1.0)
    layer = d.layers[0]
    with torch.no_grad():
        a = layer.input_norm(d.embed(ids))  # [T, H]
        cos, sin = d.rope(torch.arange(T))
        nh, D = cfg.n_injected_heads, cfg.target_head_dim
        own_k = apply_rope(layer.self_attn.k_proj(a).view(T, nh, D).transpose(0, 1)[None], cos, sin)[
            0
        ]  # [nh, T, D]
        own_v = layer.self_attn.v_proj(a).view(T, nh, D).transpose(0, 1)  # [nh, T, D]
        tgt_k, tgt_v = batch.keys[0].transpose(0, 1), batch.values[0].transpose(0, 1)  # [nh, T, D]
        terms = []
        for s in range(K):
            pos = torch.arange(1 + s, T)  # block positions i+1+s that exist
            for own, tgt in ((own_k, tgt_k), (own_v, tgt_v)):
                terms.append((own[:, pos] - tgt[:, pos]).pow(2).sum() / tgt[:, pos].pow(2).sum())
        reference = torch.stack(terms).mean()
    torch.testing.assert_close(loss, reference, atol=1e-5, rtol=1e-5)
    assert parts["kv_align"] == pytest.approx(float(reference), rel=1e-5)
    loss.backward()
    assert layer.self_attn.k_proj.weight.grad.abs().sum() > 0  # the K/V projections get a direct gradient
