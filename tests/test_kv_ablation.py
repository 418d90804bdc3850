"""The target-KV ablations and the zeroed-KV control: what a KV-reading drafter is given, checked by hand."""

from dataclasses import replace

import pytest
import torch

from kvshot_lib.drafters import (
    RecencyBias,
    Segment,
    TargetView,
    TrainBatch,
    build_drafter,
    drafter_config_for,
    segmented_attention,
)
from kvshot_lib.training import EvalSet, batch_from_target, with_target_kv

D2T = torch.arange(512) * 3


def batch(T: int, fill: float) -> TrainBatch:
    keys = torch.full((2, T, 4, 8), fill)  # [B, T, heads, D]
    return TrainBatch(
        ids=torch.zeros(2, T, dtype=torch.long),
        loss_mask=torch.ones(2, T, dtype=torch.bool),
        lengths=torch.full((2,), T),
        final_hidden=torch.zeros(2, T, 16),
        keys=keys,
        values=keys + 100,
    )


def test_conditions_zero_and_shuffle_the_kv_and_keep_the_rest():
    evals = EvalSet([batch(5, 1.0), batch(3, 2.0)], [torch.zeros(2, 5), torch.zeros(2, 3)])
    assert with_target_kv(evals, "real") is evals
    zeroed = with_target_kv(evals, "zeroed")
    assert all(float(b.keys.abs().sum() + b.values.abs().sum()) == 0 for b in zeroed.batches)
    shuffled = with_target_kv(evals, "shuffled").batches
    # batch 0 (5 tokens) reads batch 1's cache (3 tokens) padded with zeros; batch 1 reads batch 0's, cut
    assert torch.equal(shuffled[0].keys[:, :3], torch.full((2, 3, 4, 8), 2.0))
    assert float(shuffled[0].keys[:, 3:].abs().sum()) == 0
    assert torch.equal(shuffled[1].values, torch.full((2, 3, 4, 8), 101.0))
    for a, b in zip(evals.batches, shuffled):
        assert a.ids is b.ids and a.final_hidden is b.final_hidden
    with pytest.raises(ValueError, match="one of"):
        with_target_kv(evals, "noise")


@pytest.mark.parametrize("paradigm", ["kv", "hybrid"])
def test_zeroed_control_never_sees_the_target_kv(tiny_llama, paradigm):
    """The control's logits are identical with the real K/V and with noise, in training and in decoding;
    the same drafter with target_kv="real" does change (so the check can fail)."""
    ids = torch.randint(0, 3000, (14,), generator=torch.Generator().manual_seed(0))
    out = {}
    for target_kv in ("zeroed", "real"):
        cfg = drafter_config_for(tiny_llama, paradigm, draft_vocab_size=512, target_kv=target_kv)
        d = build_drafter(cfg, tiny_llama, D2T, seed=0).eval()
        b = batch_from_target(tiny_llama, ids, torch.ones(14, dtype=torch.bool), d.cfg)
        noisy = replace(b, keys=torch.randn_like(b.keys) * 5, values=torch.randn_like(b.values) * 5)
        with torch.no_grad():
            real_logits = d.logits(d(b, 3).outs[-1])
            noise_logits = d.logits(d(noisy, 3).outs[-1])
        with torch.no_grad():
            cache = tiny_llama.model(input_ids=ids[None, :10], use_cache=True).past_key_values
        view = TargetView(cache=cache, hidden={i: torch.randn(1, 10, 64) for i in range(8)})
        first = d.new_session().start_cycle(ids[None, :11], view)
        for layer in cache.layers:
            layer.keys.normal_(), layer.values.normal_()
        second = d.new_session().start_cycle(ids[None, :11], view)
        out[target_kv] = (torch.equal(real_logits, noise_logits), torch.equal(first, second))
    assert out["zeroed"] == (True, True)
    assert out["real"] == (False, False)


def test_recency_bias_picks_the_most_recent_target_position():
    """With a zero query, the scores are the bias alone: a large bias at distance 1 returns the value of
    the key just before the query, whatever the keys hold."""
    rec = RecencyBias(n_heads=2, window=4)
    with torch.no_grad():
        rec.table[:, 0] = 50.0  # distance 1
    T = 6
    k, v = torch.randn(1, 2, T, 8), torch.randn(1, 2, T, 8)
    q_pos = torch.tensor([3, 6])  # two queries: they see keys 0..2 and 0..5
    dist = q_pos[:, None] - torch.arange(T)[None]  # [2, T]
    seg = Segment(k, v, "dense", dist > 0, dist=dist, bias=rec(dist))
    out = segmented_attention(torch.zeros(1, 2, 2, 8), [seg])  # [1, h, n, D]
    torch.testing.assert_close(out[:, :, 0], v[:, :, 2], atol=1e-6, rtol=0)
    torch.testing.assert_close(out[:, :, 1], v[:, :, 5], atol=1e-6, rtol=0)
    assert rec(torch.tensor([[1, 4, 5, 90]])).shape == (2, 1, 4)  # distances past the window share a bucket


def test_a_zeroed_control_gets_its_own_name_and_folder():
    from kvshot_lib.training import TrainConfig

    assert TrainConfig(paradigm="kv", regime="ttt").name == "kv-ttt"
    assert TrainConfig(paradigm="kv", regime="ttt", target_kv="zeroed").name == "kv-ttt-zeroed"
    assert (
        TrainConfig(paradigm="block", context="kv", regime="parallel", target_kv="zeroed").name
        == "block-kv-zeroed"
    )
    assert (
        TrainConfig(paradigm="kv", regime="tf", target_kv="zeroed", name="mine").name == "mine"
    )  # a given name is kept


def test_the_ablation_figure_states_the_margin_over_the_control():
    import pandas as pd

    from kvshot_lib.plots import training as plots_training

    real = pd.DataFrame(dict(draft_step=[0, 1], accuracy=[0.5, 0.2], n=[1000, 1000]))
    control = pd.DataFrame(dict(draft_step=[1, 0], accuracy=[0.19, 0.3], n=[1000, 1000]))
    # step 0: 0.5 vs 0.3, Wilson half-widths ~0.03 -> apart; step 1: 0.2 vs 0.19 -> overlapping
    assert plots_training._margin_over_control(real, control) == (
        "real − control: +0.010 to +0.200\nintervals apart at 1 of 2 steps"
    )
