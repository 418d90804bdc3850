"""bf16 decoding: verification in bf16 agrees with float32 up to near-ties, greedy bf16 speculative decoding equals
bf16 plain decoding up to near-ties, float32 stays exact, and the cost model is measured once and reused.

**The stated margin.** On the tiny targets (logits of std ~0.4) a bf16 forward's logits differ from float32's by
at most ~0.03 (measured over 20 tree blocks of 8 tokens each); a *near-tie* is a position whose top-2 logit
margin is below ``NEAR_TIE = 0.05``. A disagreement between the two precisions is allowed only there.
"""

import pytest
import torch
from conftest import random_prompts

from kvshot_lib.decoding import (
    CostModel,
    DecodeConfig,
    autoregressive_generate,
    cost_model_for,
    generate,
    speculative_generate,
)
from kvshot_lib.drafters import (
    SelfDrafter,
    ancestor_matrix,
    build_drafter,
    drafter_config_for,
    drafter_for_target,
    tree_attention_mask,
)
from kvshot_lib.evaluation import precision_setups
from kvshot_lib.target import cast_target, decode_dtype, load_target, precision_label
from kvshot_lib.target import forward as seam

NEAR_TIE = 0.05
PARENTS = [-1, 0, 0, 1, 2, 2, 5]  # a 7-node tree under the root
DEPTHS = [0, 0, 1, 1, 1, 2, 2]


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3"])
def pair(request):
    t32 = load_target(request.param, device="cpu", dtype="float32")
    return t32, cast_target(t32, torch.bfloat16)


@torch.inference_mode()
def verify_logits(target, prompt: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """The engine's verification forward: ``block [1, 8]`` (root + 7 nodes) over a cache of ``prompt``."""
    model = target.model
    cache = seam.new_cache(model)
    seam.forward(model, prompt, cache)
    P = prompt.shape[1]
    mask = tree_attention_mask(ancestor_matrix(PARENTS), P, next(model.parameters()).dtype)
    pos = torch.tensor([[P, *(P + 1 + d for d in DEPTHS)]])
    return seam.forward(model, block, cache, pos, mask).logits[0].float()


def test_cast_target_is_a_bf16_copy(pair):
    t32, t16 = pair
    assert next(t16.model.parameters()).dtype == torch.bfloat16 and t16.info.dtype == "bfloat16"
    assert next(t32.model.parameters()).dtype == torch.float32, "the float32 reference is untouched"
    assert cast_target(t32, torch.float32) is t32
    assert precision_label(decode_dtype("fp32")) == "fp32"


def test_bf16_verification_agrees_with_float32_up_to_near_ties(pair):
    t32, t16 = pair
    g = torch.Generator().manual_seed(0)
    positions = disagreements = 0
    for _ in range(20):
        prompt = torch.randint(0, 49152, (1, 50), generator=g)
        block = torch.randint(0, 49152, (1, 8), generator=g)
        a, b = verify_logits(t32, prompt, block), verify_logits(t16, prompt, block)  # [8, V]
        assert (a - b).abs().max() < NEAR_TIE
        top = a.topk(2, -1).values
        margin = top[:, 0] - top[:, 1]  # [8]
        differ = a.argmax(-1) != b.argmax(-1)
        assert (margin[differ] < NEAR_TIE).all(), margin[differ]
        positions, disagreements = positions + len(differ), disagreements + int(differ.sum())
    assert disagreements / positions < 0.1


def test_bf16_speculative_greedy_equals_bf16_plain_decoding_up_to_near_ties(amx_cpu, pair):
    """Chain and tree, the noisy self drafter and an (untrained) hidden drafter bound to the bf16 target and cast
    with it: each output equals bf16 plain decoding's, or first differs where plain decoding's top-2 margin is
    a near-tie. The float32 outputs equal float32 plain decoding exactly."""
    t32, t16 = pair
    cfg = drafter_config_for(t32, "hidden", draft_vocab_size=512, regime="ttt")
    hidden = build_drafter(cfg, t32, torch.arange(512), seed=0)
    drafters = {"self": SelfDrafter(t32, noise=1.0), "hidden": hidden}
    setups = precision_setups(t32, drafters, ("fp32", "bf16"))
    assert [s.precision for s in setups] == ["fp32", "bf16"]
    assert next(setups[1].drafters["hidden"].parameters()).dtype == torch.bfloat16
    base = dict(
        max_new_tokens=16, stop_token_ids=(), chain_depth=3, tree_depth=3, tree_top_k=2, tree_budget=6
    )
    for s in setups:
        for prompt in random_prompts(3, seed=2):
            ref = autoregressive_generate(s.target, prompt, DecodeConfig(mode="ar", **base)).token_ids
            for name, drafter in s.drafters.items():
                for mode in ("chain", "tree"):
                    out = speculative_generate(
                        s.target, drafter, prompt, DecodeConfig(mode=mode, **base)
                    ).token_ids
                    if s.precision == "fp32" or out == ref:
                        assert out == ref, (s.precision, name, mode)
                        continue
                    pos = next(i for i, (x, y) in enumerate(zip(out, ref)) if x != y)
                    with torch.inference_mode():
                        ids = torch.tensor([prompt + ref[:pos]])
                        logits = seam.forward(s.target.model, ids).logits[0, -1].float()
                    top = logits.topk(2).values
                    assert float(top[0] - top[1]) < NEAR_TIE, (name, mode, pos)


def test_drafter_for_target_keeps_the_learned_weights(pair):
    t32, t16 = pair
    cfg = drafter_config_for(t32, "kv", draft_vocab_size=256, regime="ttt")
    d = build_drafter(cfg, t32, torch.arange(256), seed=1)
    bound = drafter_for_target(d, t16, torch.bfloat16)
    for (k, v), (k2, v2) in zip(d.state_dict().items(), bound.state_dict().items()):
        assert k == k2
        if k != "target_probe":
            torch.testing.assert_close(v.to(v2.dtype), v2)
    assert bound._frozen.embed_weight is t16.model.model.embed_tokens.weight


@pytest.mark.slow  # ~28 s of timing loops: make test-slow, which CI runs
def test_cost_model_is_measured_once_and_reused(tmp_path, monkeypatch):
    """The first call measures verification (k = 1..64, chain and tree) and each drafter, and saves them under
    the cache; the second reads them back without measuring; a synthetic model interpolates between sizes."""
    monkeypatch.setenv("KVSHOT_CACHE", str(tmp_path))
    target = load_target("tiny-llama", device="cpu", dtype="float32")
    drafters = {"self": SelfDrafter(target)}
    first = cost_model_for(target, drafters, context=32)
    assert set(first.verify_chain) >= {1, 2, 8, 64} and first.drafters["self"].start_s > 0
    assert (tmp_path / "cost_models.json").is_file()

    def refuse(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr("kvshot_lib.decoding.cost_model.measure_verification", refuse)
    monkeypatch.setattr("kvshot_lib.decoding.cost_model.measure_drafter", refuse)
    again = cost_model_for(target, drafters, context=32)
    assert again.as_dict() == first.as_dict()
    synthetic = CostModel("s", "fp32", 8, {1: 1.0, 5: 3.0}, {1: 1.0, 5: 5.0}, 0.0)
    assert synthetic.verify(3, tree=False) == 2.0 and synthetic.verify(3) == 3.0
    assert synthetic.verify(9, tree=False) == 5.0  # past the last size: the last slope
    with pytest.raises(KeyError, match="no costs for drafter"):
        synthetic.start("nope")
    out = generate(target, [1, 2, 3], DecodeConfig(mode="ar", max_new_tokens=4, stop_token_ids=()))
    assert len(out.token_ids) == 4
