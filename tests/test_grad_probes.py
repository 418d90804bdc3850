"""Gradient probes: the statistics, the parameter groups, per-position counts, and the Adam caveat."""

import math

import pytest
import torch

from kvshot_lib.drafters import build_drafter, drafter_config_for
from kvshot_lib.training import (
    GradProbe,
    Objective,
    TrainConfig,
    batch_from_target,
    branch_valid,
    build_optimizer,
    grad_stats,
    grouped_parameters,
    param_group,
    spearman,
    step_mask,
)


def test_grad_stats_on_known_tensors():
    one_hot = torch.zeros(100)
    one_hot[3] = -2.0
    s = grad_stats([one_hot.view(10, 10)])
    assert (
        s["l2"] == pytest.approx(2.0)
        and s["hoyer"] == pytest.approx(1.0)
        and s["frac_small"] == pytest.approx(0.99)
    )
    s = grad_stats([torch.full((50,), 0.5), torch.full((50,), -0.5)])  # two tensors form one group
    assert s["l2"] == pytest.approx(5.0) and s["rms"] == pytest.approx(0.5)
    assert s["hoyer"] == pytest.approx(0.0, abs=1e-6) and s["frac_small"] == 0 and s["n_params"] == 100
    x = torch.tensor([1.0, 1e-4, 1.0, 1.0])  # one entry below 1% of the RMS
    assert grad_stats([x])["frac_small"] == 0.25
    assert spearman(torch.arange(10.0), torch.arange(10.0) ** 3) == pytest.approx(1.0)
    assert spearman(torch.arange(10.0), -torch.arange(10.0)) == pytest.approx(-1.0)


def test_parameter_groups():
    assert param_group("layers.0.self_attn.k_proj.weight") == "kv_proj"
    assert param_group("layers.1.self_attn.v_proj.weight") == "kv_proj"
    assert param_group("layers.0.cross_attn.q_proj.weight") == "q_proj"
    assert param_group("layers.0.cross_attn.o_proj.weight") == "o_proj"
    assert param_group("layers.0.mlp.gate_proj.weight") == "mlp"  # the MLP's gate is not the hybrid's gate
    assert (
        param_group("layers.0.gate.proj.bias") == "gate" and param_group("layers.0.gate.mix.weight") == "gate"
    )
    assert param_group("fc.weight") == "fusion" and param_group("layers.0.inject.k_map.weight") == "kv_inject"
    assert param_group("final_norm.weight") == "norm" and param_group("layers.0.feat_norm.weight") == "norm"


def probed_step(target, paradigm, regime, K, lmask, ids, **kw):
    cfg = TrainConfig(paradigm=paradigm, regime=regime, ttt_steps=K, draft_vocab_size=512, **kw)
    dcfg = drafter_config_for(target, paradigm, draft_vocab_size=512, kv_mode=cfg.kv_mode)
    d = build_drafter(dcfg, target, torch.arange(512), seed=0)
    batch = batch_from_target(target, ids, lmask, dcfg)
    with GradProbe(d, branch_valid(batch), keep_samples=50) as probe:
        loss, _ = Objective(d, cfg)(batch, probe)
        loss.backward()
    return d, batch, probe


def test_positions_that_get_gradient(tiny_llama):
    """Teacher-forced KV-only drafter: its own key at branch i is seen by query i only, so exactly the branches
    whose step-0 token counts send gradient into the K/V, Q and O projections."""
    T = 20
    ids = torch.randint(0, 3000, (T,), generator=torch.Generator().manual_seed(0))
    lmask = torch.zeros(T, dtype=torch.bool)
    lmask[[4, 5, 9, 15]] = True
    d, batch, probe = probed_step(tiny_llama, "kv", "tf", 1, lmask, ids)
    counted = int(step_mask(batch, 0).sum())
    assert counted == 4
    rows = {r["group"]: r for r in probe.group_rows()}
    assert rows["q_proj"]["n_positions"] == counted and rows["o_proj"]["n_positions"] == counted
    assert rows["kv_proj"]["n_positions"] == 2 * counted  # k_proj and v_proj outputs
    assert rows["kv_proj"]["n_positions_total"] == 2 * (T - 1)
    grads = [p.grad for _, p in grouped_parameters(d)["kv_proj"]]
    assert rows["kv_proj"]["l2"] == pytest.approx(
        math.sqrt(sum(float(g.pow(2).sum()) for g in grads)), rel=1e-5
    )
    kv, samples = probe.kv_rows()
    assert len(kv) == 1 and kv[0]["frac_zero_grad"] == pytest.approx(1 - counted / (T - 1))
    assert len(samples) == 19
    shares = {r["segment"]: r["share"] for r in probe.mass_rows()}
    assert shares["target"] + shares["own_branch"] == pytest.approx(1.0)
    assert 0 < shares["own_branch"] < 1


def test_ttt_probe_covers_every_step_and_position_sampling(tiny_llama):
    T, K = 24, 3
    ids = torch.randint(0, 3000, (T,), generator=torch.Generator().manual_seed(1))
    d, batch, probe = probed_step(tiny_llama, "hybrid", "ttt", K, torch.ones(T, dtype=torch.bool), ids)
    kv, _ = probe.kv_rows()
    assert sorted(r["own_step"] for r in kv) == [0, 1, 2]
    first = next(r for r in kv if r["own_step"] == 0)
    # step-0 own keys form the drafter's context: every later query attends to them
    assert first["received_mean"] > max(r["received_mean"] for r in kv if r["own_step"] > 0)
    groups = {r["group"] for r in probe.group_rows()}
    assert {"kv_proj", "q_proj", "o_proj", "mlp", "fusion", "gate", "norm"} <= groups
    mass = {(r["segment"], r["layer"]): r["share"] for r in probe.mass_rows()}
    assert mass[("own_context", 0)] + mass[("own_branch", 0)] == pytest.approx(1.0)  # self-attention softmax
    assert mass[("target", 0)] == pytest.approx(1.0)  # the cross-attention's own softmax


def _train(target, batch, cfg, steps=8):
    dcfg = drafter_config_for(target, cfg.paradigm, draft_vocab_size=512)
    d = build_drafter(dcfg, target, torch.arange(512), seed=0)
    obj, opt = Objective(d, cfg), build_optimizer(d, cfg)
    for _ in range(steps):
        loss, _ = obj(batch)
        loss.backward()
        for g in opt.param_groups:
            for p in g["params"]:
                p.grad.mul_(cfg.grad_scale.get(g["name"], 1.0))
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(d.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in d.named_parameters()}


def test_constant_gradient_scaling_is_nearly_a_no_op_under_adam(tiny_llama):
    """The brief's caution: Adam normalizes each parameter's update, so 50x on one group changes almost nothing
    without clipping (only through epsilon); a learning-rate multiplier does change the update."""
    T = 16
    ids = torch.randint(0, 3000, (T,), generator=torch.Generator().manual_seed(2))
    dcfg = drafter_config_for(tiny_llama, "kv", draft_vocab_size=512)
    batch = batch_from_target(tiny_llama, ids, torch.ones(T, dtype=torch.bool), dcfg)
    base = dict(paradigm="kv", regime="ttt", ttt_steps=2, lr=1e-3, grad_clip=0.0)
    ref = _train(tiny_llama, batch, TrainConfig(**base))
    scaled = _train(tiny_llama, batch, TrainConfig(**base, grad_scale={"kv_proj": 50.0}))
    lr_mult = _train(tiny_llama, batch, TrainConfig(**base, lr_scale={"kv_proj": 5.0}))
    init = build_drafter(dcfg, tiny_llama, torch.arange(512), seed=0).state_dict()
    key = "layers.0.self_attn.k_proj.weight"
    moved = (ref[key] - init[key]).norm()
    assert (scaled[key] - ref[key]).norm() < 0.02 * moved
    assert (lr_mult[key] - ref[key]).norm() > 1.0 * moved
