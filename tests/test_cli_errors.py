"""The command line's error paths: every error a user can cause ends in one line, ``kvshot: ...``, and a
non-zero exit status, never a traceback; and it comes before any model is loaded wherever the arguments and
the target's config can tell (the test fails if a target is loaded then).

Each case runs through ``kvshot_lib.cli.main`` (a ``SystemExit`` whose message is a string: Python prints
it to stderr and exits with status 1); one case runs the real command in a subprocess to show exactly that.
"""

import subprocess
import sys

import pytest
import torch

from kvshot_lib import cli, target
from kvshot_lib.decoding import cli as generate_cli
from kvshot_lib.drafters import build_drafter, drafter_config_for, save_drafter
from kvshot_lib.evaluation import cli as bench_cli
from kvshot_lib.target import precision


def no_loading(monkeypatch):
    fail = lambda *a, **k: pytest.fail("a model was loaded for arguments that are wrong")  # noqa: E731
    loads(monkeypatch, fail)
    monkeypatch.setattr(target, "load_target", fail)  # kvshot train imports it when it runs


def loads(monkeypatch, load) -> None:
    """``kvshot generate`` and ``kvshot bench`` load their target with ``load``."""
    for module in (generate_cli, bench_cli):
        monkeypatch.setattr(module, "load_cli_target", load)


def cli_error(argv: list[str]) -> str:
    """``kvshot argv``'s error: asserts it is one line starting with ``kvshot: `` and returns it."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    message = exit_.value.code
    assert isinstance(message, str), f"exit without a message: {message!r}"
    assert message.startswith("kvshot: ") and "\n" not in message, message
    return message


@pytest.fixture(scope="module")
def qwen3_checkpoint(tiny_qwen3, tmp_path_factory):
    """A (untrained) KV drafter checkpoint for tiny-qwen3."""
    cfg = drafter_config_for(tiny_qwen3, "kv", draft_vocab_size=64)
    return save_drafter(
        build_drafter(cfg, tiny_qwen3, torch.arange(64), seed=0), tmp_path_factory.mktemp("q")
    )


@pytest.fixture(scope="module")
def llama_checkpoint(tiny_llama, tmp_path_factory):
    cfg = drafter_config_for(tiny_llama, "hidden", draft_vocab_size=64)
    return save_drafter(
        build_drafter(cfg, tiny_llama, torch.arange(64), seed=0), tmp_path_factory.mktemp("l")
    )


def test_a_checkpoint_for_another_target_is_refused_before_loading(qwen3_checkpoint, monkeypatch):
    no_loading(monkeypatch)
    ckpt = str(qwen3_checkpoint)
    for argv in (
        ["generate", "--target", "tiny-llama", "--drafter", ckpt, "--prompt", "hi"],
        ["bench", "--target", "tiny-llama", "--drafters", "ngram", ckpt],
    ):
        message = cli_error(argv)
        assert "trained for target 'tiny-qwen3'" in message and "--target tiny-qwen3" in message


def test_a_checkpoint_for_other_weights_is_refused_after_loading(llama_checkpoint, monkeypatch):
    """Same architecture, other weights: only the loaded target can tell, and it says so in one line."""
    other = target.load_target("tiny-llama", device="cpu", seed=1)  # the architecture, other weights
    loads(monkeypatch, lambda args: other)
    ckpt = str(llama_checkpoint)
    message = cli_error(["generate", "--target", "tiny-llama", "--drafter", ckpt, "--prompt", "hi"])
    assert "different embedding weights" in message
    message = cli_error(["bench", "--target", "tiny-llama", "--drafters", ckpt])
    assert "different embedding weights" in message


def test_an_early_exit_deeper_than_the_target_is_refused(tiny_llama, monkeypatch):
    no_loading(monkeypatch)
    message = cli_error(
        ["generate", "--target", "tiny-llama", "--drafter", "early-exit-99", "--prompt", "hi"]
    )
    assert "has 8 layers" in message and "1..8" in message
    assert "1..8" in cli_error(["bench", "--target", "tiny-llama", "--drafters", "early-exit-99"])
    # a hub id's config cannot be read here: the loaded target refuses it, in one line
    loads(monkeypatch, lambda args: tiny_llama)
    message = cli_error(["generate", "--target", "org/model", "--drafter", "early-exit-99", "--prompt", "hi"])
    assert "early-exit-99" in message and "1..8" in message


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["bench", "--n-questions", "0"],
            "--n-questions takes a number of MT-bench questions in 1..80, got 0",
        ),
        (["bench", "--methods", "ar", "beam"], "unknown methods ['beam']"),
        (["bench", "--temperatures", "0", "-1"], "temperature"),
        (["generate", "--drafter", "ngram", "--long-context", "10"], "--long-context takes a prompt length"),
        (["generate", "--drafter", "ngram", "--prompt", "hi", "--top-p", "0"], "top_p"),
        (
            ["generate", "--drafter", "ngram", "--prompt", "hi", "--verify", "partial", "--budget", "100"],
            "divide",
        ),
        (
            ["train", "--paradigm", "kv", "--regime", "ttt", "--out", "x", "--set", 'lr="fast"'],
            "lr must be float",
        ),
        (
            ["train", "--paradigm", "kv", "--regime", "ttt", "--out", "x", "--set", "n_layer=2"],
            "unknown parameters",
        ),
        (
            ["train", "--paradigm", "kv", "--regime", "ttt", "--out", "x", "--set", "lr"],
            "--set expects KEY=JSON",
        ),
        (
            ["train", "--paradigm", "kv", "--regime", "ttt", "--out", "x", "--config", "/no/such.json"],
            "--config",
        ),
    ],
)
def test_bad_settings_and_counts_are_refused_before_loading(argv, expected, monkeypatch):
    no_loading(monkeypatch)
    assert expected in cli_error(argv)


def test_bf16_on_a_cpu_without_it_is_refused_before_loading(monkeypatch):
    no_loading(monkeypatch)
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)
    message = cli_error(["bench", "--device", "cpu", "--precisions", "fp32", "bf16"])
    assert "neither AMX-BF16 nor AVX512-BF16" in message and "\n" not in message


def test_an_unknown_target_is_one_line(monkeypatch):
    message = cli_error(["generate", "--target", "no-such-target", "--drafter", "ngram", "--prompt", "hi"])
    assert "Unknown target 'no-such-target'" in message


def test_the_command_prints_one_line_and_exits_non_zero():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvshot_lib.cli",
            "generate",
            "--target",
            "tiny-llama",
            "--drafter",
            "early-exit-99",
        ]
        + ["--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and done.stdout == ""
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("kvshot: --drafter early-exit-99: the target")
