"""Information probes: matched parameter counts, independent probes per step, causal reads of the KV cache,
the control task, and the statistics behind the verdict."""

import numpy as np
import pandas as pd
import pytest
import torch

from kvshot_lib.diagnostics import info_probes as ip
from kvshot_lib.diagnostics import mean_ci, probe_stats, ratio_ci, slope
from kvshot_lib.diagnostics import probe_training as pt

SMOLLM2_ONE_LAYER = ip.ProbeDims(n_layers=1, hidden=576, n_heads=9, n_kv_heads=3, head_dim=64)
SMOLLM2_THREE_LAYERS = ip.ProbeDims(n_layers=3, hidden=576, n_heads=9, n_kv_heads=3, head_dim=64)
TINY = ip.ProbeDims(n_layers=1, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16)


class _Head(torch.nn.Module):  # a stand-in readout: no parameters, like the frozen one
    def forward(self, z):
        return z[..., :7]


@pytest.mark.parametrize(
    "dims, budget, rank",
    [(SMOLLM2_ONE_LAYER, 100_000, 16), (SMOLLM2_THREE_LAYERS, 400_000, 32), (TINY, 6000, 4)],
)
def test_probe_parameter_counts_match_within_five_percent(dims, budget, rank):
    widths = ip.probe_widths(dims, budget, rank)
    counts = {}
    for kind in ip.KINDS:
        bank = ip.ProbeBank(kind, 3, dims, widths[kind], rank, _Head())
        counts[kind] = bank.n_trainable_per_probe()
        expected = ip.mlp_params(dims.input_width(kind), widths[kind], dims.hidden) + dims.query_params(
            kind, rank
        )
        assert counts[kind] == expected
        assert abs(counts[kind] / budget - 1) <= 0.05, (kind, counts[kind], budget)
    assert max(counts.values()) / min(counts.values()) <= 1.10


def test_a_budget_too_small_for_the_query_map_is_refused():
    with pytest.raises(ValueError, match="probe_budget"):
        ip.probe_widths(SMOLLM2_THREE_LAYERS, 50_000, 64)


def _docs(n_docs=3, K=3, dims=TINY, T=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    from kvshot_lib.diagnostics import ProbeDoc

    docs = []
    for i in range(n_docs):
        anchors = torch.tensor([3, 7, 12, 15])
        docs.append(
            ProbeDoc(
                doc_id=f"d{i}",
                anchors=anchors,
                tokens=torch.randint(0, 50, (4,), generator=g),
                labels=torch.randint(0, 7, (K, 4), generator=g),
                hidden=torch.randn(4, dims.n_layers * dims.hidden, generator=g),
                keys=torch.randn(dims.n_layers * dims.n_kv_heads, T, dims.head_dim, generator=g),
                values=torch.randn(dims.n_layers * dims.n_kv_heads, T, dims.head_dim, generator=g),
                queries=torch.randn(K, 4, dims.heads, dims.head_dim, generator=g),
            )
        )
    return docs


def _batch(docs, dims=TINY):
    def rope_fn(pos):
        return torch.ones(pos.numel(), dims.head_dim), torch.zeros(pos.numel(), dims.head_dim)

    return pt.ProbeBatch(docs, torch.randn(50, dims.hidden), rope_fn, dims, torch.arange(50))


def test_the_k_probes_of_a_bank_are_independent():
    b = _batch(_docs())
    for kind in ip.KINDS:
        bank = ip.ProbeBank(kind, 3, TINY, 8, 4, _Head())
        logits = bank(b)  # [K, n, 7]
        logits[1].sum().backward()  # the loss of the probe for step 1 only
        for name, p in bank.named_parameters():
            others = torch.cat([p.grad[0].flatten(), p.grad[2].flatten()])
            assert torch.count_nonzero(others) == 0, (kind, name)
            assert torch.count_nonzero(p.grad[1]) > 0, (kind, name)


def test_attention_reads_only_positions_up_to_the_anchor():
    docs = _docs(n_docs=1)
    b = _batch(docs)
    q = torch.randn(3, b.n, TINY.heads, TINY.head_dim)
    before = b.attend(q)
    docs[0].keys[:, 13:] += 10 * torch.randn_like(docs[0].keys[:, 13:])  # after every anchor but 15
    docs[0].values[:, 13:] += 10 * torch.randn_like(docs[0].values[:, 13:])
    after = _batch(docs).attend(q)
    assert torch.allclose(before[:, :3], after[:, :3])  # anchors 3, 7, 12 do not see positions 13..
    assert not torch.allclose(before[:, 3], after[:, 3])  # anchor 15 does
    # one example by hand: query head 3 reads KV head 1 (GQA groups of 2)
    k, v, a = docs[0].keys[1, :8], docs[0].values[1, :8], 1  # anchor 7
    w = torch.softmax(q[0, a, 3] @ k.T * TINY.head_dim**-0.5, -1)
    read = torch.nn.functional.layer_norm(w @ v, (TINY.head_dim,))
    assert torch.allclose(after[0, a].view(TINY.heads, -1)[3], read, atol=1e-5)


def test_control_labels_depend_on_the_token_type_only():
    docs = _docs(n_docs=4)
    docs[1].tokens[0] = docs[0].tokens[0]
    batches = [_batch(docs[:2]), _batch(docs[2:])]
    maps = pt.control_maps(batches, 50, seed=1)
    labels = pt.control_labels(maps, batches)
    for k in range(3):
        assert labels[0][k, 0] == labels[0][k, 4]  # the same token at t: the same control label
        real = set(torch.cat([b.labels[k] for b in batches]).tolist())
        assert set(labels[0][k].tolist()) <= real  # drawn from the real labels


# ---------------------------------------------------------------------------------------------- statistics


def _table(ce: dict, n_docs=40, noise=0.05, seeds=(0, 1, 2), steps=range(8)):
    rng = np.random.default_rng(0)
    rows = []
    for d in range(n_docs):
        doc_shift = rng.normal(0, 0.3)  # documents differ; the pairing removes it
        for kind, f in ce.items():
            for s in seeds:
                for k in steps:
                    n = 50
                    value = f(k) + doc_shift + rng.normal(0, noise)
                    rows.append(
                        dict(
                            kind=kind,
                            task="real",
                            seed=s,
                            doc=f"d{d}",
                            step=k,
                            n=n,
                            ce_bits=value * n,
                            top1=int(n * 0.3),
                            top5=int(n * 0.6),
                        )
                    )
    return pd.DataFrame(rows)


def test_information_gap_that_grows_and_one_that_does_not():
    grows = _table({"emb": lambda k: 6.0, "h": lambda k: 5.0, "kv_h": lambda k: 5.0 - 0.2 * k})
    gap = probe_stats.information_gap(grows, n_boot=500)
    by_step = gap[gap["step"] >= 0]
    assert np.allclose(by_step["gap_bits"], 0.2 * by_step["step"], atol=0.03)
    trend = gap[gap["step"] == -1].iloc[0]
    assert trend["gap_bits"] == pytest.approx(0.2, abs=0.01) and trend["verdict"].startswith("grows with k")
    assert "KV ahead at k = [1, 2, 3, 4, 5, 6, 7], hidden state ahead at k = none" in trend["verdict"]
    flat = _table({"emb": lambda k: 6.0, "h": lambda k: 5.0, "kv_h": lambda k: 4.9})
    trend = probe_stats.information_gap(flat, n_boot=500).query("step == -1").iloc[0]
    assert trend["verdict"].startswith("does not grow with k") and trend["ci_lo"] < 0 < trend["ci_hi"]
    assert "hidden state ahead at k = none" in trend["verdict"]


def test_probe_results_information_gain_and_pairwise_tests():
    table = _table({"emb": lambda k: 6.0, "h": lambda k: 5.0}, seeds=(0,), steps=range(2))
    res = probe_stats.probe_results(table, n_boot=300)
    ig = res[(res["metric"] == "ig_bits") & (res["kind"] == "h")]
    assert np.allclose(ig["value"], 1.0, atol=0.03)
    top1 = res[(res["metric"] == "top1")]
    assert np.allclose(top1["value"], 0.3)
    pair = probe_stats.pairwise_tests(table, n_boot=300)
    assert np.allclose(pair["ce_diff_bits"], 1.0, atol=0.03) and (pair["p_value"] < 0.01).all()


def test_bootstrap_helpers():
    est, lo, hi, _ = ratio_ci(np.full((10, 2), 3.0), np.ones(10))
    assert np.allclose(est, 3.0) and np.allclose(lo, 3.0) and np.allclose(hi, 3.0)
    est, lo, hi, _ = mean_ci(np.array([[1.0], [np.nan], [3.0]]), n_boot=200)
    assert est[0] == pytest.approx(2.0) and lo[0] <= 2.0 <= hi[0]
    assert slope(np.array([1.0, 3.0, 5.0]), np.array([0, 1, 2])) == pytest.approx(2.0)


def test_run_probes_end_to_end_on_a_tiny_target(tiny_llama, monkeypatch):
    """The table's structure, and its values: every real-task row's ``n``, ``ce_bits``, ``top1`` and ``top5``
    are recomputed here from the trained probes' logits on the test documents (cross-entropy in bits as
    ``-log2 softmax[label]``, summed per document and step)."""
    banks, batch_sets = {}, []
    real_train_bank, real_batches_of = pt.train_bank, pt.batches_of

    def keep_bank(kind, batches, *args, labels=None, **kwargs):
        bank = real_train_bank(kind, batches, *args, labels=labels, **kwargs)
        if labels is None:  # the real task
            banks[(kind, args[4])] = bank  # args: readout, dims, width, rank, seed, ...
        return bank

    def keep_batches(*args, **kwargs):
        batch_sets.append(real_batches_of(*args, **kwargs))
        return batch_sets[-1]

    monkeypatch.setattr(pt, "train_bank", keep_bank)
    monkeypatch.setattr(pt, "batches_of", keep_batches)
    cfg = pt.ProbeConfig(
        layers=(3,),
        n_train_docs=3,
        n_test_docs=2,
        mixed_precision="no",  # the table's values are recomputed below in float32
        offset=40,
        max_len=48,
        anchors_per_doc=8,
        n_steps=3,
        readout_size=32,
        budget=6000,
        query_rank=4,
        seeds=(0, 1),
        control_kinds=("h",),
        epochs=1,
    )
    run = pt.run_probes(tiny_llama, cfg, progress=False)
    t = run.table
    assert set(t["kind"]) == set(ip.KINDS) and set(t["seed"]) == {0, 1}
    assert set(t[t["task"] == "control"]["kind"]) == {"h"}
    assert (run.params["deviation"].abs() <= 0.05).all()
    assert (
        run.data["train_docs"] == 3 and 1 <= run.data["test_docs"] <= 2
    )  # a document without anchors is dropped
    assert (t["top1"] <= t["top5"]).all() and (t["top5"] <= t["n"]).all()
    test_batches = batch_sets[1]  # run_probes builds the training batches, then the test batches
    assert sorted(banks) == sorted((k, s) for k in ip.KINDS for s in (0, 1))
    real = t[t["task"] == "real"].set_index(["kind", "seed", "doc", "step"])
    checked = 0
    for (kind, seed), bank in banks.items():
        with torch.no_grad():
            for b in test_batches:
                logits = bank(b)  # [K, n, V]
                logp = torch.log_softmax(logits.double(), -1)
                for k in range(logits.shape[0]):
                    for d, doc in enumerate(b.doc_ids):
                        y = b.labels[k][b.doc_of == d]
                        lp = logp[k][b.doc_of == d][y >= 0]  # [m, V]
                        y = y[y >= 0]
                        if len(y) == 0:
                            continue
                        row = real.loc[(kind, seed, doc, k)]
                        ce = float(-lp.gather(1, y[:, None]).sum()) / np.log(2)
                        rank = (lp > lp.gather(1, y[:, None])).sum(1)  # tokens scored above the label
                        assert row["n"] == len(y) and row["ce_bits"] == pytest.approx(ce, rel=1e-5)
                        assert row["top1"] == int((rank == 0).sum()) and row["top5"] == int((rank < 5).sum())
                        checked += 1
    assert checked == len(real) > 0
    # the probes beat a uniform guess over the readout vocabulary (the initial bias is the label frequency)
    assert 0 < t["ce_bits"].sum() / t["n"].sum() < np.log2(run.data["readout_vocab"])
    with pytest.raises(ValueError, match="held-out split"):
        pt.ProbeConfig(layers=(3,), offset=450, n_train_docs=40, n_test_docs=20).validate()
