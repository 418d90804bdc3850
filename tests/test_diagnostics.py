"""Query-estimation error: the metrics against values computed by hand, the drafter's query taken into the
target's key space reproducing its own scores exactly, the measurement's invariants, and the causal hook."""

import math

import pandas as pd
import pytest
import torch

from kvshot_lib.diagnostics import (
    ESTIMATORS,
    QueryErrorTables,
    TargetAttentionRecorder,
    drafter_queries,
    head_map,
    measure_sequence,
    mixing_hook,
    query_in_key_space,
    sequence_batch,
    stale_verdict,
    target_pass,
)
from kvshot_lib.diagnostics import attention_metrics as am
from kvshot_lib.drafters import build_drafter, drafter_config_for


def logp(*probs):
    """Log-probabilities of rows given as lists (0 = masked)."""
    p = torch.tensor(probs, dtype=torch.float32)
    return torch.where(p > 0, p.log(), torch.full_like(p, float("-inf"))), p > 0


# --------------------------------------------------------------------------------------- the metrics


def test_distribution_metrics_by_hand():
    star, mask = logp([0.6, 0.4, 0.0])
    hat, _ = logp([0.3, 0.7, 0.0])
    m = am.distribution_metrics(hat, star, mask)
    kl = 0.6 * math.log2(0.6 / 0.3) + 0.4 * math.log2(0.4 / 0.7)
    mid = [0.45, 0.55]
    js = 0.5 * (0.6 * math.log2(0.6 / mid[0]) + 0.4 * math.log2(0.4 / mid[1])) + 0.5 * (
        0.3 * math.log2(0.3 / mid[0]) + 0.7 * math.log2(0.7 / mid[1])
    )
    assert float(m["kl_bits"][0]) == pytest.approx(kl, abs=1e-6)
    assert float(m["js_bits"][0]) == pytest.approx(js, abs=1e-6)
    assert float(m["recall@1"][0]) == 0.0  # the target's top key is 0, the estimate's is 1
    assert float(m["mass@1"][0]) == pytest.approx(0.4 / 0.6)
    assert float(m["recall@4"][0]) == 1.0  # only two visible keys: top-4 is both
    assert float(m["mass@16"][0]) == pytest.approx(1.0)


def test_output_error_by_hand_and_zero_for_the_true_query():
    star, mask = logp([0.5, 0.5, 0.0])
    hat, _ = logp([0.25, 0.75, 0.0])
    values = torch.tensor([[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]])  # the masked key's value never counts
    err = am.output_error(hat, star, values)  # |(-0.25, 0.25)| / |(0.5, 0.5)|
    assert float(err[0]) == pytest.approx(0.5)
    full, _ = logp([0.4, 0.4, 0.2])
    out = am.all_metrics(
        star, star, mask, values, full, torch.tensor([1]), torch.ones(1, 2), torch.ones(1, 2)
    )
    for variant in ("with_sink", "without_sink"):
        for name in ("out_err", "kl_bits", "js_bits"):
            assert float(out[variant][name][0]) == pytest.approx(0.0, abs=1e-6)
        assert float(out[variant]["recall@1"][0]) == 1.0
        assert float(out[variant]["cosine"][0]) == pytest.approx(1.0)


def test_unavailable_mass_sums_with_the_reused_mass_to_one():
    full, mask = logp([0.1, 0.2, 0.3, 0.4])  # the target at p = 3, anchor t = 1
    t = torch.tensor([1])
    assert float(am.unavailable_mass(full, t)[0]) == pytest.approx(0.7)
    reused = full.exp()[0, :2].sum()
    assert float(reused + am.unavailable_mass(full, t)[0]) == pytest.approx(1.0)
    no_sink, _ = am.drop_sink(full, mask)
    assert float(am.unavailable_mass(no_sink, t - 1)[0]) == pytest.approx(0.7 / 0.9)
    star, smask = logp([0.1 / 0.3, 0.2 / 0.3, 0.0, 0.0])
    out = am.all_metrics(star, star, smask, torch.eye(4), full, t)
    assert float(out["with_sink"]["unavailable_mass"][0]) == pytest.approx(0.7)
    assert float(out["without_sink"]["unavailable_mass"][0]) == pytest.approx(0.7 / 0.9)


def test_drop_sink_renormalizes():
    p, mask = logp([0.5, 0.3, 0.2])
    rest, m = am.drop_sink(p, mask)
    assert torch.allclose(rest.exp(), torch.tensor([[0.6, 0.4]]))
    assert m.tolist() == [[True, True]]


def test_vector_metrics_by_hand():
    q = torch.tensor([[3.0, 4.0]])
    m = am.vector_metrics(2 * q, q)
    assert float(m["cosine"][0]) == pytest.approx(1.0)
    assert float(m["rel_l2"][0]) == pytest.approx(1.0)
    assert float(m["norm_ratio"][0]) == pytest.approx(2.0)
    m = am.vector_metrics(torch.tensor([[4.0, -3.0]]), q)
    assert float(m["cosine"][0]) == pytest.approx(0.0, abs=1e-7)
    assert float(m["rel_l2"][0]) == pytest.approx(math.sqrt(2))


# ------------------------------------------------------------------------- drafter queries vs the target


def kv_drafter(target, mode="concat", query_group=None, recency=0, seed=0, softmax="shared"):
    cfg = drafter_config_for(
        target,
        "kv",
        kv_softmax=softmax,
        kv_mode=mode,
        query_group=query_group,
        draft_vocab_size=512,
        kv_recency=recency,
        name="kv-x",
    )
    d = build_drafter(cfg, target, torch.arange(512), seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in d.layers:
            if mode != "concat":  # a map far from the identity, so that W^T q differs from q
                layer.inject.k_map.weight.add_(
                    0.3 * torch.randn(layer.inject.k_map.weight.shape, generator=g)
                )
            if layer.recency is not None:
                layer.recency.table.copy_(torch.randn(layer.recency.table.shape, generator=g))
    return d


def test_head_map_pairs_each_drafter_head_with_its_target_heads(tiny_llama):
    info = tiny_llama.info  # 4 query heads, 2 KV heads: groups of 2
    cfg = drafter_config_for(tiny_llama, "kv", query_group=2, draft_vocab_size=512)
    pairs = head_map(cfg, info.n_heads)
    assert len(pairs) == len(cfg.kv_layers) * info.n_heads
    first = [(p.drafter_head, p.layer, p.kv_head, p.target_head) for p in pairs[:4]]
    assert first == [(0, 1, 0, 0), (1, 1, 0, 1), (2, 1, 1, 2), (3, 1, 1, 3)]
    cfg1 = drafter_config_for(tiny_llama, "kv", query_group=1, draft_vocab_size=512)
    pairs1 = head_map(cfg1, info.n_heads)
    assert [(p.drafter_head, p.target_head) for p in pairs1[:4]] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    cfg3 = drafter_config_for(tiny_llama, "kv", query_group=3, draft_vocab_size=512)
    assert head_map(cfg3, info.n_heads) == []  # no per-head correspondence


@pytest.mark.parametrize(
    "mode, softmax", [("concat", "shared"), ("linear", "shared"), ("concat", "separate")]
)
def test_query_in_key_space_reproduces_the_drafters_own_scores(tiny_llama, mode, softmax):
    d = kv_drafter(tiny_llama, mode=mode, query_group=1, recency=3, softmax=softmax)
    ids = torch.randint(0, 49152, (24,), generator=torch.Generator().manual_seed(0))
    tp = target_pass(tiny_llama, ids, d.cfg.kv_layers)
    batch = sequence_batch(tp, d.cfg)
    rec = TargetAttentionRecorder()
    with torch.no_grad(), drafter_queries(d) as records:
        un = d.forward(batch, 2, recorder=rec)
    k_all = torch.cat([tp.keys[lay] for lay in d.cfg.kv_layers])  # [nI, T, D] the target's keys
    nI, T, D = k_all.shape
    k_flat = k_all.transpose(0, 1).reshape(T, nI * D)  # [T, nI*D] heads side by side
    layer = d.layers[0]
    for step in (0, 1):
        q = records[step].q[0]  # [h, N, D]
        N = q.shape[1]
        for i in range(nI):
            q_hat = query_in_key_space(layer, q[i], i, nI)  # [N, nI*D]
            ours = q_hat @ k_flat[:N].T  # [N, N]: q̂ . k over the target's raw keys
            theirs = q[i] @ un.injected[0][0][0, i, :N].T  # the drafter's own q . k'
            assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4)
            # ... and the attention it gives, bias and all, is the one the drafter used (renormalized)
            dist = (torch.arange(N)[:, None] + 1 + step) - torch.arange(N)[None]
            scores = ours * D**-0.5 + layer.recency(dist)[i]
            causal = torch.ones(N, N, dtype=torch.bool).tril()
            ours_p = am.masked_log_softmax(scores, causal).exp()
            used = rec.probs[(0, step)][0, i, 0]  # [N, N] normalized with the drafter's own K/V too
            used = used / used.sum(-1, keepdim=True)
            assert torch.allclose(ours_p, used, atol=1e-5)


def test_linear_rope_has_no_single_query(tiny_llama):
    d = kv_drafter(tiny_llama, mode="linear_rope", query_group=1)
    assert query_in_key_space(d.layers[0], torch.randn(3, 16), 0, d.cfg.n_injected_heads) is None


def test_measurement_invariants(tiny_llama):
    d = kv_drafter(tiny_llama, query_group=2, recency=2)
    ids = torch.randint(0, 49152, (30,), generator=torch.Generator().manual_seed(3))
    se = measure_sequence(tiny_llama, d, ids, answer_start=15, n_steps=3, seq_id="s", keep_maps=True)
    oracle = ESTIMATORS.index("oracle")
    for variant in ("with_sink", "without_sink"):
        h = se.head[variant]
        ok = se.valid[None].expand_as(h["out_err"][oracle])
        assert torch.allclose(h["out_err"][oracle][ok], torch.zeros(int(ok.sum())), atol=1e-6)
        assert torch.allclose(h["kl_bits"][oracle][ok], torch.zeros(int(ok.sum())), atol=1e-5)
        unavailable = h["unavailable_mass"][ESTIMATORS.index("drafter")][ok]
        assert bool(((unavailable > 0) & (unavailable < 1)).all())
    # the unavailable mass is what the target's attention over 0..p puts after t
    layer, head, k, a = d.cfg.kv_layers[0], 1, 2, 4
    t = int(se.anchors[a])
    p_full = se.maps["target"][layer][head, k, a]
    assert float(p_full.sum()) == pytest.approx(1.0, abs=1e-5)
    assert float(p_full[: t + 1].sum() + p_full[t + 1 :].sum()) == pytest.approx(1.0, abs=1e-5)
    col = next(c for c, pr in enumerate(se.pairs) if pr[1] == layer and pr[2] == head)
    stored = float(se.head["with_sink"]["unavailable_mass"][0, col, k, a])
    assert stored == pytest.approx(float(p_full[t + 1 :].sum()), abs=1e-5)
    # the drafter's map lives on the reused cache only
    assert float(se.maps["drafter"][0][se.pairs[col][4], k, a][t + 1 :].sum()) == 0.0


def test_tables_and_stale_verdict(tiny_llama):
    d = kv_drafter(tiny_llama, query_group=1)
    tables = QueryErrorTables(dict(drafter="kv-x", paradigm="kv", regime="ttt", kv_mode="concat"))
    for s in range(3):
        ids = torch.randint(0, 49152, (28,), generator=torch.Generator().manual_seed(s))
        tables.add(measure_sequence(tiny_llama, d, ids, 14, 2, f"s{s}"))
    by_step, by_head = tables.by_step(), tables.by_head()
    assert set(by_step["estimator"]) == set(ESTIMATORS) and by_step["sequence"].nunique() == 3
    # per drafter head, exactly one of the group's target heads is matched
    m = by_head[
        (by_head["estimator"] == "drafter")
        & (by_head["variant"] == "with_sink")
        & (by_head["level"] == "head")
    ]
    assert (m[m["matched"]].groupby(["drafter_head"])["head"].nunique() == 1).all()
    assert m[m["matched"]]["drafter_head"].nunique() == d.cfg.n_injected_heads
    v = stale_verdict(by_step, n_boot=200)
    row = v[(v["level"] == "head") & (v["variant"] == "with_sink") & (v["step"] == -1)].iloc[0]
    assert row["ci_lo"] <= row["diff"] <= row["ci_hi"]
    assert row["diff"] == pytest.approx(row["drafter_mean"] - row["stale_mean"], abs=1e-9)


def test_stale_verdict_on_a_known_difference():
    rows = []
    g = torch.Generator().manual_seed(0)
    for s in range(30):
        base = float(torch.rand(1, generator=g))
        for step in range(3):
            for est, value in (("drafter", base - 0.1), ("stale", base)):
                rows.append(
                    dict(
                        drafter="d",
                        level="head",
                        variant="with_sink",
                        sequence=f"s{s}",
                        step=step,
                        estimator=est,
                        out_err=value,
                    )
                )
    v = stale_verdict(pd.DataFrame(rows), n_boot=500)
    assert (v["diff"].round(9) == -0.1).all() and v["beats_stale"].all()


# ---------------------------------------------------------------------------------------- the causal hook


def test_causal_hook_lambda_zero_is_the_drafter_and_one_is_the_target(tiny_llama):
    d = kv_drafter(tiny_llama, query_group=2)  # one drafter query per target query head
    ids = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(5))
    tp = target_pass(tiny_llama, ids, d.cfg.kv_layers)
    batch = sequence_batch(tp, d.cfg)
    subs = {(0, p.drafter_head): (p.layer, p.target_head) for p in head_map(d.cfg, tiny_llama.info.n_heads)}
    with torch.no_grad():
        plain = d.logits(d.forward(batch, 2).outs[1])
        with drafter_queries(d, replace=mixing_hook(tp.queries, subs, 0.0)):
            same = d.logits(d.forward(batch, 2).outs[1])
        rec = TargetAttentionRecorder()
        with drafter_queries(d, replace=mixing_hook(tp.queries, subs, 1.0)):
            moved = d.logits(d.forward(batch, 2, recorder=rec).outs[1])
    assert torch.equal(plain, same)
    assert not torch.allclose(plain, moved)
    N, D = ids.numel() - 1, d.cfg.target_head_dim
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    for step in (0, 1):
        pos = torch.arange(N) + 1 + step
        real = pos < ids.numel()  # rows past the sequence's end are padding
        pos = pos.clamp(max=ids.numel() - 1)
        for (_, a), (layer, head) in subs.items():
            kv = d.cfg.kv_layers.index(layer) * d.cfg.target_n_kv_heads + head // 2
            q_star = tp.queries[layer][head][pos]  # [N, D] the target's queries at p
            p_star = am.masked_log_softmax(q_star @ tp.keys[layer][head // 2][:N].T * D**-0.5, causal).exp()
            used = rec.probs[(0, step)][0, kv, a % 2]
            assert torch.allclose((used / used.sum(-1, keepdim=True))[real], p_star[real], atol=1e-5)
    assert "rope" not in d.__dict__ and "query" not in d.layers[0].self_attn.__dict__


def test_hooks_are_undone_after_an_exception(tiny_llama):
    d = kv_drafter(tiny_llama)
    with pytest.raises(RuntimeError), drafter_queries(d):
        raise RuntimeError("boom")
    assert "rope" not in d.__dict__ and "query" not in d.layers[0].self_attn.__dict__


def test_greedy_references_are_cached_for_one_target_and_setting(tiny_llama, tmp_path, monkeypatch):
    from kvshot_lib.evaluation import acceptance

    cache = tmp_path / "refs.json"
    first = acceptance.greedy_references(tiny_llama, 1, 4, progress=False, cache=cache)
    assert cache.is_file() and len(first) == 2 and all(len(r.greedy_ids) == 4 for r in first)

    def decode(*args):
        raise AssertionError("decoded again")

    monkeypatch.setattr(acceptance, "_decode_references", decode)
    assert acceptance.greedy_references(tiny_llama, 1, 4, progress=False, cache=cache) == first
    with pytest.raises(AssertionError, match="decoded again"):  # other settings: not the cached ones
        acceptance.greedy_references(tiny_llama, 1, 5, progress=False, cache=cache)


def test_causal_alpha_at_lambda_zero_is_the_plain_greedy_replay(tiny_llama):
    from kvshot_lib.decoding import DecodeConfig
    from kvshot_lib.diagnostics import causal_alpha, causal_summary
    from kvshot_lib.evaluation import acceptance

    d = kv_drafter(tiny_llama, query_group=2)
    refs = acceptance.greedy_references(tiny_llama, 1, 10, progress=False)
    cfg = DecodeConfig(mode="chain", max_new_tokens=10, chain_depth=4)
    subs = {(0, p.drafter_head): (p.layer, p.target_head) for p in head_map(d.cfg, tiny_llama.info.n_heads)}
    table = causal_alpha(tiny_llama, d, refs, subs, [0.0, 1.0], cfg, progress=False).assign(drafter="kv-x")
    for ref in refs:
        plain = acceptance.replay_greedy(tiny_llama, d, ref, cfg)
        mine = table[(table["lam"] == 0.0) & (table["sequence"] == f"q{ref.question_id}-t{ref.turn + 1}")]
        assert mine.sort_values("step")["attempts"].tolist() == plain.step_attempts
        assert mine.sort_values("step")["accepts"].tolist() == plain.step_accepts
    summary = causal_summary(table, n_boot=100)
    assert set(summary["lam"]) == {0.0, 1.0} and (summary["ci_lo"] <= summary["ci_hi"]).all()
