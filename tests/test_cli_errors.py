"""The command line's error paths: every error a user can cause ends in one line on stderr, ``kvshot: ...``,
naming what was wrong and what to do, with a documented exit status (2 a usage error, 1 a failure, 3 this machine
is short: ``kvshot_lib/user_errors.py``), never a traceback; it comes before any model is loaded wherever the
arguments and the target's config can tell (the test fails if a target is loaded then), and no file changes.

:func:`test_every_kind_of_bad_input_is_one_line_and_harms_nothing` holds the 34 kinds of bad input of issue 65,
one row each (exit status, the fix the line names, whether a target loads, files hashed before and after). Each
case runs through ``kvshot_lib.cli.main``; one case runs the real command in a subprocess to show the exit status
and stderr a shell sees.
"""

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from kvshot_lib import cli, needs, target
from kvshot_lib.decoding import cli as generate_cli
from kvshot_lib.drafters import build_drafter, drafter_config_for, save_drafter
from kvshot_lib.evaluation import cli as bench_cli
from kvshot_lib.target import precision
from kvshot_lib.user_errors import EXIT_MACHINE_SHORT, EXIT_USAGE


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
    message = str(exit_.value)
    assert exit_.value.code == EXIT_USAGE, exit_.value.code
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


def test_the_command_prints_one_line_and_exits_with_the_usage_status():
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
    assert done.returncode == EXIT_USAGE and done.stdout == ""
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("kvshot: --drafter early-exit-99: the target")


# --- the 34 kinds of bad input of issue 65 ------------------------------------------------------------------------

Case = namedtuple("Case", "name argv code fix loads", defaults=(False,))
G = ["generate", "--target", "tiny-llama", "--max-new-tokens", "4"]
TRAIN = ["train", "--paradigm", "kv", "--regime", "ttt", "--out", "{root}/trained"]
EXPORT = ["export", "--drafter", "{hidden}"]
CASES = [
    Case(
        "prompt longer than the context",
        [*G, "--raw", "--prompt", "word " * 8300],
        2,
        "shorten the prompt",
        True,
    ),
    Case("empty raw prompt", [*G, "--raw", "--prompt", ""], 2, "give the text to continue"),
    Case("--threads -1", [*G, "--threads", "-1", "--prompt", "hi"], 2, "(>= 1; 0 leaves torch's default)"),
    Case("non-UTF-8 prompt", [*G, "--prompt", os.fsdecode(b"caf\xe9 \xff")], 2, "pass UTF-8"),
    Case("--max-new-tokens 0", [*G[:3], "--max-new-tokens", "0", "--prompt", "hi"], 2, "(>= 1)"),
    Case("empty chat prompt", [*G, "--prompt", "  "], 2, "give the text to answer"),
    Case("--max-new-tokens -5", [*G[:3], "--max-new-tokens", "-5", "--prompt", "hi"], 2, "(>= 1)"),
    Case("weights cut short", [*G, "--drafter", "{cut}", "--prompt", "hi"], 2, "copy the checkpoint again"),
    Case(
        "a pickle as weights",
        [*G, "--drafter", "{pickled}", "--prompt", "hi"],
        2,
        "copy the checkpoint again",
    ),
    Case("unknown drafter", [*G, "--drafter", "no-such-drafter", "--prompt", "hi"], 2, "use none, "),
    Case(
        "folder that is no checkpoint", [*G, "--drafter", "{root}", "--prompt", "hi"], 2, "expected a folder"
    ),
    Case(
        "unknown target", [*G[:1], "--target", "no-such", "--prompt", "hi"], 2, "not a preset (smollm2-135m"
    ),
    Case("--mt-bench 0", [*G, "--mt-bench", "0"], 2, "a question number in 1..80"),
    Case("negative temperature", [*G, "--temperature", "-1", "--prompt", "hi"], 2, "temperature"),
    Case(
        "--mode ar with a drafter",
        [*G, "--mode", "ar", "--drafter", "ngram", "--prompt", "hi"],
        2,
        "drop --drafter",
    ),
    Case(
        "another vocabulary",
        [*G, "--drafter", "{vocab}", "--prompt", "hi"],
        2,
        "restore that file, or retrain",
    ),
    Case("early exit too deep", [*G, "--drafter", "early-exit-99", "--prompt", "hi"], 2, "n in 1..8"),
    Case(
        "config.json not JSON",
        [*G, "--drafter", "{not_json}", "--prompt", "hi"],
        2,
        "copy the checkpoint again",
    ),
    Case("checkpoint without weights", [*G, "--drafter", "{no_weights}", "--prompt", "hi"], 2, "Retrain it"),
    Case("--top-p 0", [*G, "--top-p", "0", "--prompt", "hi"], 2, "top_p"),
    Case("export onto its own drafter", [*EXPORT, "--out", "{hidden}", "--force"], 2, "Pass another folder"),
    Case("export onto a folder with files", [*EXPORT, "--out", "{full}"], 2, "pass --force"),
    Case("export onto a file", [*EXPORT, "--out", "{a_file}"], 2, "pass the path of a folder"),
    Case(
        "export a KV-reading drafter", ["export", "--drafter", "{kv}", "--out", "{root}/o"], 2, "Only hidden"
    ),
    Case(
        "export no such drafter", ["export", "--drafter", "{root}/none", "--out", "{root}/o"], 2, "expected a"
    ),
    Case("non-UTF-8 --config", [*TRAIN, "--config", "{latin1}"], 2, "save it as UTF-8 JSON"),
    Case("missing --config", [*TRAIN, "--config", "{root}/no.json"], 2, "pass a JSON file"),
    Case("--set of the wrong type", [*TRAIN, "--set", 'lr="fast"'], 2, "lr must be float"),
    Case("unknown training parameter", [*TRAIN, "--set", "n_layer=2"], 2, "unknown parameters"),
    Case("train --set without =", [*TRAIN, "--set", "lr"], 2, "--set expects KEY=JSON"),
    Case("unknown profile", ["run", "--profile", "no-such", "--dry-run"], 2, "not one of ["),
    Case(
        "this machine is short",
        ["run", "--profile", "qwen3-8b", "--set", "device=cpu", "--dry-run"],
        3,
        "--force",
    ),
    Case("run --set without =", ["run", "--profile", "smoke", "--set", "oops", "--dry-run"], 2, "key=value"),
    Case(
        "figures of an unknown profile", ["figures", "--profile", "no-such"], 2, "the profiles with figures"
    ),
]


def tree_hashes(folder: Path) -> dict[str, str]:
    return {
        str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.rglob("*"))
        if f.is_file()
    }


@pytest.fixture(scope="module")
def bad_files(tiny_llama, tmp_path_factory) -> dict[str, str]:
    """The files the cases name: a tiny-llama hidden drafter, damaged copies of it, a KV drafter, and so on."""
    root = tmp_path_factory.mktemp("bad-input")
    cfg = drafter_config_for(tiny_llama, "hidden", draft_vocab_size=64)
    hidden = save_drafter(build_drafter(cfg, tiny_llama, torch.arange(64), seed=0), root / "hidden")
    kv_cfg = drafter_config_for(tiny_llama, "kv", draft_vocab_size=64)
    save_drafter(build_drafter(kv_cfg, tiny_llama, torch.arange(64), seed=0), root / "kv")
    copies = {name: shutil.copytree(hidden, root / name) for name in ("cut", "pickled", "vocab", "not_json")}
    copies["no_weights"] = shutil.copytree(hidden, root / "no_weights")
    weights = (hidden / "model.safetensors").read_bytes()
    (copies["cut"] / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    (copies["pickled"] / "model.safetensors").write_bytes(pickle.dumps({"fc.weight": [0.0] * 100}))
    config = json.loads((hidden / "config.json").read_text())
    (copies["vocab"] / "config.json").write_text(json.dumps({**config, "target_vocab_size": 32000}))
    (copies["not_json"] / "config.json").write_text("{not json")
    (copies["no_weights"] / "model.safetensors").unlink()
    (root / "full").mkdir()
    (root / "full" / "config.json").write_text('{"keep": 1}')
    (root / "a_file").write_text("keep")
    (root / "latin1.json").write_bytes(b'{"lr": "\xe9"}')
    names = ("hidden", "kv", *copies, "full", "a_file")
    return {"root": str(root), "latin1": str(root / "latin1.json"), **{n: str(root / n) for n in names}}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_kind_of_bad_input_is_one_line_and_harms_nothing(
    case, bad_files, tiny_llama, monkeypatch, capsys
):
    loaded, real_load = [], target.load_target

    def load(name, *args, **kwargs):  # tiny-llama is the session's; another name is refused before it loads
        if name == "tiny-llama":
            loaded.append(name)
            return tiny_llama
        return real_load(name, *args, **kwargs)

    monkeypatch.setattr(target, "load_target", load)
    monkeypatch.setattr(
        needs, "_available_ram", lambda: 16 * needs.GIB
    )  # qwen3-8b needs more, on any machine
    root = Path(bad_files["root"])
    before, paths = tree_hashes(root), sorted(root.rglob("*"))
    argv = [a.format(**bad_files) for a in case.argv]
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == case.code, (code, err)
    assert len(err) == 1 and err[0].startswith("kvshot") and case.fix in err[0], err
    assert bool(loaded) == case.loads
    assert tree_hashes(root) == before and sorted(root.rglob("*")) == paths, "files changed"


def test_the_table_holds_every_kind_of_the_issue():
    assert len(CASES) == 34 and len({c.name for c in CASES}) == 34
    assert {c.code for c in CASES} == {EXIT_USAGE, EXIT_MACHINE_SHORT}


def test_a_long_context_prompt_the_target_cannot_hold_is_one_line(tiny_llama, monkeypatch):
    loads(monkeypatch, lambda args: tiny_llama)
    message = cli_error(["generate", "--target", "tiny-llama", "--long-context", "100000"])
    assert message.startswith("kvshot: --long-context 100000:") and "ask for at most 8128 tokens" in message
