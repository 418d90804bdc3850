"""Drafters on tiny models: shapes, frozen target parts, no later position reaching an earlier draft (bitwise),
the draft vocabulary, bitwise checkpoint round trips, wrong-target loads."""

import json
from dataclasses import replace

import pytest
import torch

from kvshot_lib.drafters import (
    DrafterConfigError,
    DrafterTargetMismatch,
    Segment,
    SessionFactory,
    build_drafter,
    coverage,
    draft_vocab_from_counts,
    drafter_config_for,
    load_drafter,
    save_drafter,
    segmented_attention,
    target_to_draft,
    vocab_hash,
)
from kvshot_lib.target import load_target
from kvshot_lib.training import batch_from_target, grouped_parameters

VARIANTS = [
    ("hidden", "concat", 1),
    ("hidden", "concat", 2),
    ("kv", "concat", 1),
    ("kv", "linear", 2),
    ("kv", "linear_rope", 4),
    ("hybrid", "concat", 1),
    ("hybrid", "linear_rope", 2),
]
D2T = torch.arange(0, 2 * 1024, 2)  # a 1024-token draft vocabulary


def make(target, paradigm, mode="concat", n_layers=1, seed=0, **kw):
    cfg = drafter_config_for(
        target,
        paradigm,
        n_layers=n_layers,
        kv_mode=mode,
        draft_vocab_size=len(D2T),
        name=f"{paradigm}-{mode}-{n_layers}",
        regime="ttt",
        **kw,
    )
    d = build_drafter(cfg, target, D2T, seed=seed)
    with torch.no_grad():  # move every parameter off its initial value so a round trip is a real test
        for p in d.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return d


@pytest.fixture(scope="module")
def seq(tiny_llama):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4000, (20,), generator=g)
    mask = torch.ones(20, dtype=torch.bool)
    mask[:5] = False
    return ids, mask


@pytest.mark.parametrize("paradigm,mode,n_layers", VARIANTS)
def test_shapes_and_groups(tiny_llama, seq, paradigm, mode, n_layers):
    d = make(tiny_llama, paradigm, mode, n_layers)
    assert isinstance(d, SessionFactory) and d.paradigm == paradigm and d.regime == "ttt" and d.name
    batch = batch_from_target(tiny_llama, *seq, d.cfg)
    T, H = 20, tiny_llama.info.hidden_size
    un = d(batch, 3)
    assert [tuple(h.shape) for h in un.outs] == [(1, T - 1, H)] * 3
    assert d.logits(un.outs[0]).shape == (1, T - 1, len(D2T))
    sel = torch.tensor([0, 7, 11])
    assert d(batch, 3, branches=sel).outs[2].shape == (1, 3, H)
    groups = set(grouped_parameters(d))
    assert {"kv_proj", "q_proj", "o_proj", "mlp"} <= groups
    assert ("fusion" in groups) == (paradigm != "kv")
    assert ("gate" in groups) == (paradigm == "hybrid")
    assert ("kv_inject" in groups) == (mode != "concat" and paradigm != "hidden")
    assert "other" not in groups
    # the target's embedding and head are frozen and not part of the drafter's parameters or state: the
    # trainable parameters are the same for another draft vocabulary, and none has a vocabulary-sized axis
    vocab_sizes = {len(D2T), tiny_llama.info.vocab_size}
    assert all(not vocab_sizes & set(p.shape) for p in d.parameters())
    other_vocab = build_drafter(
        drafter_config_for(tiny_llama, paradigm, n_layers=n_layers, kv_mode=mode, draft_vocab_size=512),
        tiny_llama,
        D2T[:512],
        seed=0,
    )
    assert other_vocab.n_trainable() == d.n_trainable() == sum(p.numel() for p in d.parameters())
    target_storage = {p.untyped_storage().data_ptr() for p in tiny_llama.model.parameters()}
    assert all(p.untyped_storage().data_ptr() not in target_storage for p in d.parameters())
    assert set(d.state_dict()) == {n for n, _ in d.named_parameters()} | {"d2t", "target_probe"}


EAGLE31 = dict(fc_norm=True, norm_output=True)


@pytest.mark.parametrize(
    "paradigm,mode,n_layers,flags",
    [(*v, {}) for v in VARIANTS] + [("hidden", "concat", 1, EAGLE31), ("hybrid", "concat", 1, EAGLE31)],
)
def test_no_later_position_reaches_an_earlier_draft(tiny_llama, seq, paradigm, mode, n_layers, flags):
    """Step ``k`` of branch ``i`` may read the target's features and K/V of positions ``0..i`` and the tokens
    ``x_1..x_{i+1+k}``. Changing everything the batch holds at position ``j`` (the token, the hidden states,
    the K/V) leaves the branches ``i < j-1-k`` *bitwise* unchanged and changes every later one. With EAGLE 3.1's
    switches (``flags``) too."""
    d = make(tiny_llama, paradigm, mode, n_layers, **flags).eval()
    batch = batch_from_target(tiny_llama, *seq, d.cfg)
    K, g = 3, torch.Generator().manual_seed(5)

    def noisy(x, j):
        if x is None:
            return None
        x = x.clone()
        x[:, j] = torch.randn(x[:, j].shape, generator=g) * 2 * x.std()
        return x

    with torch.no_grad():
        base = [d.logits(h)[0] for h in d(batch, K).outs]  # per step [N, V_draft]
        for j in (3, 9, 16):
            ids = batch.ids.clone()
            ids[:, j] = (ids[:, j] + 1) % 4000
            moved = replace(batch, ids=ids, hidden=noisy(batch.hidden, j), keys=noisy(batch.keys, j))
            moved = replace(moved, values=noisy(batch.values, j))
            out = [d.logits(h)[0] for h in d(moved, K).outs]
            for k in range(K):
                first = max(j - 1 - k, 0)  # the first branch that reads position j at step k
                assert torch.equal(out[k][:first], base[k][:first]), f"step {k}: position {j} leaked earlier"
                changed = (out[k][first:] - base[k][first:]).abs().amax(-1) > 1e-3  # seen: >= 0.02
                assert changed.all(), f"step {k}: branches {first}.. do not all read position {j}"


def test_draft_vocab_mapping():
    counts = torch.zeros(50, dtype=torch.int64)
    counts[[7, 3, 40, 12, 9]] = torch.tensor([5, 9, 9, 1, 5])
    d2t = draft_vocab_from_counts(counts, 4)
    # most frequent first: 3 and 40 (9 each), then 7 and 9 (5 each, tie broken by the smaller id); sorted by id
    assert d2t.tolist() == [3, 7, 9, 40]
    assert draft_vocab_from_counts(counts, 4, always=(0,)).tolist() == [0, 3, 7, 40]  # 0 forced in, 9 drops
    filled = draft_vocab_from_counts(counts, 8)  # only 5 ids were seen: filled with the smallest unused ids
    assert filled.tolist() == [0, 1, 2, 3, 7, 9, 12, 40]
    t2d = target_to_draft(d2t, 50)
    assert t2d[d2t].tolist() == [0, 1, 2, 3] and (t2d >= 0).sum() == 4 and t2d[12] == -1
    assert coverage(d2t, counts) == pytest.approx(28 / 29)
    assert vocab_hash(d2t) == vocab_hash(d2t.clone()) != vocab_hash(filled)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        draft_vocab_from_counts(counts, 51)


@pytest.mark.parametrize("paradigm,mode,n_layers", VARIANTS)
def test_checkpoint_round_trip_is_bitwise(tiny_llama, seq, tmp_path, paradigm, mode, n_layers):
    d = make(tiny_llama, paradigm, mode, n_layers)
    save_drafter(d, tmp_path / "ck")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["paradigm"] == paradigm and cfg["regime"] == "ttt" and cfg["target_name"] == "tiny-llama"
    assert cfg["vocab_hash"] == vocab_hash(D2T) and cfg["hidden_layers"] == list(d.cfg.hidden_layers)
    e = load_drafter(tmp_path / "ck", tiny_llama)
    a, b = d.state_dict(), e.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    batch = batch_from_target(tiny_llama, *seq, d.cfg)
    assert all(torch.equal(x, y) for x, y in zip(d(batch, 2).outs, e(batch, 2).outs))


def test_wrong_target_raises(tiny_llama, tiny_qwen3, tmp_path):
    save_drafter(make(tiny_llama, "hybrid"), tmp_path / "ck")
    with pytest.raises(DrafterTargetMismatch, match="tiny-llama.*tiny-qwen3"):
        load_drafter(tmp_path / "ck", tiny_qwen3)
    other_weights = load_target("tiny-llama", device="cpu", seed=1)  # same architecture, other weights
    with pytest.raises(DrafterTargetMismatch, match="different embedding weights"):
        load_drafter(tmp_path / "ck", other_weights)


def test_bad_checkpoints_raise_clearly(tiny_llama, tmp_path):
    with pytest.raises(FileNotFoundError, match="No drafter checkpoint"):
        load_drafter(tmp_path / "nowhere", tiny_llama)
    path = save_drafter(make(tiny_llama, "kv"), tmp_path / "ck")
    (path / "model.safetensors").rename(path / "gone")
    with pytest.raises(FileNotFoundError, match="lacks model.safetensors"):
        load_drafter(path, tiny_llama)
    (path / "gone").rename(path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "paradigm": "telepathy"}))
    with pytest.raises(DrafterConfigError, match="paradigm must be one of"):
        load_drafter(path, tiny_llama)
    (path / "config.json").write_text(json.dumps({**cfg, "vocab_hash": "0" * 16}))
    with pytest.raises(DrafterConfigError, match="draft vocabulary"):
        load_drafter(path, tiny_llama)
    (path / "config.json").write_text(json.dumps({**cfg, "n_layers": 2}))  # weights of a 1-layer drafter
    with pytest.raises(DrafterConfigError, match="does not fit its config"):
        load_drafter(path, tiny_llama)


def test_config_validation(tiny_llama):
    with pytest.raises(DrafterConfigError, match="n_layers must be an integer in 1..4"):
        drafter_config_for(tiny_llama, "kv", n_layers=5)
    with pytest.raises(DrafterConfigError, match="kv_mode"):
        drafter_config_for(tiny_llama, "kv", kv_mode="sideways")
    with pytest.raises(DrafterConfigError, match="hidden_layers"):
        drafter_config_for(tiny_llama, "hidden", hidden_layers=(1, 99))


def test_recency_bias_gathers_and_backpropagates_as_indexing_does():
    """BucketGather (a histogram backward) against plain indexing's values and gradient, distances of both
    signs and past the window included, in float32 and with a bf16 upstream gradient."""
    from kvshot_lib.drafters import kv

    BucketGather = kv.BucketGather
    g = torch.Generator().manual_seed(0)
    table = torch.randn(5, 9, generator=g)  # [h, W + 1]
    dist = torch.randint(-4, 20, (7, 30), generator=g)  # [n, S]
    bucket = (dist - 1).clamp(0, 8)
    for dtype in (torch.float32, torch.bfloat16):
        upstream = torch.randn(5, 7, 30, generator=g).to(dtype)
        mine, ref = table.clone().requires_grad_(), table.clone().requires_grad_()
        out = BucketGather.apply(mine, bucket)
        want = ref[:, bucket]
        assert torch.equal(out, want)
        out.backward(upstream.float())
        want.backward(upstream.float())
        torch.testing.assert_close(mine.grad, ref.grad)
    # a bucket no position falls in gets exactly zero gradient
    mine = table.clone().requires_grad_()
    BucketGather.apply(mine, torch.zeros(3, 4, dtype=torch.long)).sum().backward()
    assert mine.grad[:, 1:].abs().sum() == 0 and torch.all(mine.grad[:, 0] == 12)


@pytest.mark.parametrize("S,window", [(40, 8), (5, 8), (0, 8), (12, 0)])
def test_the_band_bias_attends_and_backpropagates_as_the_dense_bias(S, window):
    """The recency bias kept as its table (a constant past the window and a band of ``window`` diagonals,
    ``attention.BandBias``) against the dense ``[h, n, S]`` gather, inside the shared softmax over the target's KV
    (causal: key j visible to a query at position p iff j < p) and a diagonal own segment: same outputs, same
    gradients of the queries, keys, values and the table; keys nearer and farther than the window, and S <= window."""
    from kvshot_lib.drafters import kv

    g = torch.Generator().manual_seed(1)
    B, kvh, grp, n, D = 2, 2, 3, 6, 8
    q_pos = torch.tensor([3, 4, 9, 20, 30, 41])  # [n]
    dist = q_pos[:, None] - torch.arange(S)[None]  # [n, S]
    visible = dist >= 1  # [n, S]
    bias = kv.RecencyBias(kvh * grp, window)
    with torch.no_grad():
        bias.table.add_(torch.randn(bias.table.shape, generator=g))
    leaves = [
        torch.randn(shape, generator=g) for shape in [(B, kvh * grp, n, D), (B, kvh, S, D), (B, kvh, S, D)]
    ]
    own = [torch.randn(B, kvh, n, D, generator=g) for _ in range(2)]
    results = []
    for band in (False, True):
        q, k, v = (x.clone().requires_grad_() for x in leaves)
        bias.table.grad = None
        seg = Segment(k, v, "dense", visible)
        seg.bias = bias.band(dist) if band else bias(dist)
        out = segmented_attention(q, [seg, Segment(*own, "diag")])
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in (q, k, v, bias.table)]
        results.append([out.detach(), *(x.clone() for x in grads)])
    for dense, band in zip(*results):
        torch.testing.assert_close(band, dense, atol=1e-5, rtol=1e-5)
    assert results[1][4].abs().sum() > 0 or S == 0  # the table learns through the band
