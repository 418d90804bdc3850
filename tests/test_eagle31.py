"""EAGLE 3.1's two switches (fc_norm, post-norm feedback): each is live, each computes what the paper says, and
an EAGLE-3 drafter without them is unchanged (tiny models; decode = training for both: test_drafters_session.py)."""

import pytest
import torch

from kvshot_lib.drafters import DrafterConfigError, build_drafter, drafter_config_for
from kvshot_lib.training import TrainConfig, TrainConfigError, batch_from_target


def drafter(target, paradigm="hidden", **flags):
    cfg = drafter_config_for(target, paradigm, draft_vocab_size=512, **flags)
    d = build_drafter(cfg, target, torch.arange(512) * 3, seed=0)
    with torch.no_grad():  # norms away from 1, so that a norm's weight matters
        for p in d.parameters():
            p.add_(0.05 * torch.randn_like(p, generator=None))
    return d.eval()


def rms(x, w, eps):  # RMSNorm written out
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.fixture(scope="module")
def batch(tiny_llama):
    ids = torch.randint(0, 3000, (14,), generator=torch.Generator().manual_seed(3))
    cfg = drafter_config_for(tiny_llama, "hybrid", draft_vocab_size=512)  # hidden states and K/V
    return batch_from_target(tiny_llama, ids, torch.ones(14, dtype=torch.bool), cfg)


def test_without_the_flags_the_drafter_is_eagle3(tiny_llama, batch):
    """No new parameters, and fc and the feedback are EAGLE-3's: fc over the raw concatenation, the raw output fed on."""
    torch.manual_seed(0)
    d = drafter(tiny_llama)
    assert not any(k.startswith("fc_norms") for k in d.state_dict())
    hidden = batch.hidden[:, :5]  # [1, 5, 3H]
    torch.testing.assert_close(d.fuse(hidden), hidden @ d.fc.weight.T, rtol=0, atol=0)
    h = torch.randn(2, 3, d.cfg.hidden_size)
    assert torch.equal(d.feedback(h), h)


def test_fc_norm_norms_each_captured_layer_before_fc(tiny_llama, batch):
    torch.manual_seed(0)
    d = drafter(tiny_llama, fc_norm=True)
    H, eps = d.cfg.hidden_size, d.cfg.rms_norm_eps
    assert len(d.fc_norms) == len(d.cfg.hidden_layers) == 3
    hidden = batch.hidden[:, :5]
    by_hand = torch.cat(
        [rms(hidden[..., i * H : (i + 1) * H], n.weight, eps) for i, n in enumerate(d.fc_norms)], -1
    )
    torch.testing.assert_close(d.fuse(hidden), by_hand @ d.fc.weight.T)
    # one layer's scale hardly matters any more (up to eps): x100 on layer 0's feature moves the fused
    # feature by under 1% of what it moves fc's output without the norms
    scaled = hidden.clone()
    scaled[..., :H] *= 100
    moved = (d.fuse(scaled) - d.fuse(hidden)).abs().max()
    assert moved < 0.01 * (d.fc(scaled) - d.fc(hidden)).abs().max()


def test_norm_output_feeds_the_post_norm_state(tiny_llama, batch):
    torch.manual_seed(0)
    d = drafter(tiny_llama, norm_output=True)
    h = torch.randn(2, 3, d.cfg.hidden_size)
    torch.testing.assert_close(d.feedback(h), rms(h, d.final_norm.weight, d.cfg.rms_norm_eps))
    seen = []  # what the first layer's feature path reads at each step
    hook = d.layers[0].feat_norm.register_forward_hook(lambda m, args, out: seen.append(args[0].clone()))
    try:
        with torch.no_grad():
            un = d(batch, 3)
    finally:
        hook.remove()
    torch.testing.assert_close(seen[1], d.feedback(un.outs[0]), rtol=0, atol=0)
    torch.testing.assert_close(seen[2], d.feedback(un.outs[1]), rtol=0, atol=0)


@pytest.mark.parametrize("paradigm", ["hidden", "hybrid"])
@pytest.mark.parametrize("flag", ["fc_norm", "norm_output"])
def test_cutting_either_switch_changes_the_drafts(tiny_llama, batch, paradigm, flag):
    """The same weights with one switch turned off: fc_norm moves every step, norm_output only steps >= 1."""
    torch.manual_seed(0)
    d = drafter(tiny_llama, paradigm, fc_norm=True, norm_output=True)
    with torch.no_grad():
        on = [d.logits(h) for h in d(batch, 3).outs]
        setattr(d.cfg, flag, False)
        off = [d.logits(h) for h in d(batch, 3).outs]
    setattr(d.cfg, flag, True)
    assert (on[0] - off[0]).abs().max() > 1e-3 if flag == "fc_norm" else torch.equal(on[0], off[0])
    assert (on[2] - off[2]).abs().max() > 1e-3


def test_the_switches_belong_to_hidden_and_hybrid(tiny_llama):
    with pytest.raises(DrafterConfigError, match="EAGLE 3.1"):
        drafter_config_for(tiny_llama, "kv", fc_norm=True)
    with pytest.raises(TrainConfigError, match="EAGLE 3.1"):
        TrainConfig(paradigm="none", regime="ttt", norm_output=True)
    with pytest.raises(TrainConfigError, match="bool|norm_output"):
        TrainConfig.from_params({"paradigm": "hidden", "regime": "ttt", "norm_output": "yes"})
