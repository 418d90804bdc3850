"""Shared fixtures: tiny seeded random targets (built in about a second) and SmolLM2's tokenizer.

The tests run on the CPU. ``KVSHOT_TEST_DEVICE=cuda`` builds the engine tests' targets on a GPU instead,
to check the CUDA path by hand on a machine that has one; CI never sets it.
"""

import os

import pytest

from kvshot_lib.targets import load_target, smollm2_tokenizer

TEST_DEVICE = os.environ.get("KVSHOT_TEST_DEVICE", "cpu")


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
