"""Shared fixtures: tiny seeded random targets (built in about a second), SmolLM2's tokenizer, and the
engine tests' spread targets and random prompts.

The tests run on the CPU. ``KVSHOT_TEST_DEVICE=cuda`` builds the engine tests' targets on a GPU instead,
to check the CUDA path by hand on a machine that has one; CI never sets it.
"""

import os

import pytest
import torch

from kvshot_lib.target import load_target, smollm2_tokenizer

TEST_DEVICE = os.environ.get("KVSHOT_TEST_DEVICE", "cpu")


@pytest.fixture
def amx_cpu(monkeypatch):
    """A CPU with AMX-BF16 and AVX512-BF16. The bf16 numerics tests use it too, so that they run on any CPU
    (bf16 is emulated where the CPU lacks it, and explicit bf16 is refused there)."""
    monkeypatch.setattr(
        "kvshot_lib.target.precision.cpu_flags",
        lambda: frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}),
    )


@pytest.fixture(scope="session")
def tiny_llama():
    return load_target("tiny-llama", device=TEST_DEVICE, dtype="float32")


@pytest.fixture(scope="session")
def tiny_qwen3():
    return load_target("tiny-qwen3", device=TEST_DEVICE, dtype="float32")


@pytest.fixture(scope="session", params=["tiny-llama", "tiny-qwen3"])
def tiny_target(request):
    return load_target(request.param, device=TEST_DEVICE, dtype="float32")


@pytest.fixture(scope="session")
def tokenizer():
    return smollm2_tokenizer()


def spread_target(name: str, seed: int = 1, std: float = 0.2):
    """A tiny target with re-drawn, wider weights and an untied LM head: varied greedy outputs whose top-2
    logit gaps are far above float noise (a fresh tiny model mostly repeats its input)."""
    target = load_target(name, device=TEST_DEVICE, dtype="float32")
    g = torch.Generator().manual_seed(seed)
    model = target.model
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in pname:
                p.copy_(torch.randn(p.shape, generator=g) * std)
        head = torch.randn(model.lm_head.weight.shape, generator=g).to(model.device)
        model.lm_head.weight = torch.nn.Parameter(head, requires_grad=False)
    return target


def trained_like(target, paradigm: str):
    """A drafter of ``paradigm`` whose weights moved away from their initialization (as training moves them)."""
    from kvshot_lib.drafters import build_drafter, drafter_config_for

    cfg = drafter_config_for(target, paradigm, draft_vocab_size=512, name=f"{paradigm}-ttt", regime="ttt")
    d = build_drafter(cfg, target, torch.arange(512) * 7, seed=0)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return d


def assert_bf16_trainable_weights(drafter, files) -> None:
    """The checkpoint ``files`` hold ``drafter``'s trainable weights in bf16 and nothing frozen (no embedding, no
    LM head), beside d2t as int64 and the target probe in float32."""
    from safetensors import safe_open

    dtypes = {}
    for f in files:
        with safe_open(str(f), "pt") as sf:
            dtypes.update({k: sf.get_tensor(k).dtype for k in sf.keys()})
    trainable = {n for n, p in drafter.named_parameters() if p.requires_grad}
    assert set(dtypes) == trainable | {"d2t", "target_probe"}  # no frozen embedding, no LM head
    assert all(dtypes[n] == torch.bfloat16 for n in trainable)
    assert dtypes["d2t"] == torch.int64 and dtypes["target_probe"] == torch.float32


def assert_reference_checkpoint(drafter, files, folder, target) -> None:
    """A reference checkpoint (``files`` in ``folder``): the trainable weights in bf16 (no frozen embedding or LM
    head), d2t as int64, the target probe in float32; it loads on the CPU with ``target``, equal to the drafter's
    weights rounded to bf16, and refuses another architecture and the same architecture with other weights."""
    from kvshot_lib.drafters import DrafterTargetMismatch, load_drafter

    assert_bf16_trainable_weights(drafter, files)
    trainable = {n for n, p in drafter.named_parameters() if p.requires_grad}
    back = load_drafter(folder, target)
    assert back.head.device.type == "cpu"
    for n, p in drafter.state_dict().items():
        if n in trainable:
            assert torch.equal(back.state_dict()[n], p.to(torch.bfloat16).float()), n
    with pytest.raises(DrafterTargetMismatch, match="trained for target"):
        load_drafter(folder, load_target("tiny-qwen3", device="cpu"))  # another architecture
    with pytest.raises(DrafterTargetMismatch, match="different embedding weights"):
        load_drafter(
            folder, load_target("tiny-llama", device="cpu", seed=1)
        )  # same architecture, other weights


# A run of 14 drafters of five paradigms and four stages, in the order an evaluation might write them (no order):
# what the figure tests draw, so that a figure meets as many drafters as the on-policy run has.
MANY_DRAFTERS = [
    ("hybrid31-ttt-s3", "hybrid"),
    ("kv-ttt-zeroed", "kv"),
    ("hidden31-ttt-noloop-s2", "hidden"),
    ("ngram", "baseline"),
    ("hidden-ttt@reference", "hidden"),
    ("kv-ttt", "kv"),
    ("hybrid31-ttt-zeroed", "hybrid"),
    ("hybrid31-ttt", "hybrid"),
    ("none-ttt", "none"),
    ("hidden31-ttt@reference", "hidden"),
    ("hidden31-ttt-s3", "hidden"),
    ("hybrid31-ttt-s3-zeroed", "hybrid"),
    ("hidden31-ttt", "hidden"),
    ("block-kv", "block"),
]


def random_prompts(n: int, seed: int, vocab: int = 49152) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (t,), generator=g).tolist() for t in lengths]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and on a busy 2-core machine OpenMP barriers cost ~ms per op."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llama():
    return spread_target("tiny-llama")


def pytest_collection_modifyitems(items):
    """Every test that needs the smoke run of all notebooks is slow (make test-slow, run by CI after make test)."""
    for item in items:
        if "smoke_run" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
