"""Shared fixtures: tiny seeded random targets (built in about a second) and SmolLM2's tokenizer."""

import pytest

from kvshot_lib.targets import load_target, smollm2_tokenizer


@pytest.fixture(scope="session")
def tiny_llama():
    return load_target("tiny-llama", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tiny_qwen3():
    return load_target("tiny-qwen3", device="cpu", dtype="float32")


@pytest.fixture(scope="session", params=["tiny-llama", "tiny-qwen3"])
def tiny_target(request):
    return load_target(request.param, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tokenizer():
    return smollm2_tokenizer()
