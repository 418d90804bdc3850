"""The reference run's committed checkpoints (``kvshot_lib.reference.checkpoints``) at smoke scale: small bf16
files of the trainable weights that load on the CPU with their own target, refuse another one, and decode
losslessly (greedy equal to plain decoding), from the folder alone as a fresh clone has it."""

import json
import subprocess
import sys

import pytest
from conftest import assert_reference_checkpoint, trained_like

from kvshot_lib.decoding import DecodeConfig, generate
from kvshot_lib.drafters import load_drafter
from kvshot_lib.reference import checkpoint_folders, commit_checkpoint, folder_bytes
from kvshot_lib.target import REPO_ROOT

MB = 10**6  # the limits are in decimal megabytes
LIMIT_MB = 0.1  # tiny-llama drafters are ~0.1-0.2 MB in bf16: the hybrid's weights need two files


def test_a_committed_checkpoint_is_small_bf16_and_loads_on_the_cpu(tiny_llama, tmp_path):
    d = trained_like(tiny_llama, "hybrid")
    rec = commit_checkpoint(d, tmp_path / "hybrid-ttt", max_file_mb=LIMIT_MB, max_total_mb=60)
    folder = tmp_path / "hybrid-ttt"
    files = sorted(folder.glob("*.safetensors"))
    assert rec["checkpoint_files"] == len(files) >= 2  # split: no file over the limit
    assert all(f.stat().st_size <= LIMIT_MB * MB for f in files)
    assert [f.name for f in files] == [
        f"model-0000{i}-of-0000{len(files)}.safetensors" for i in range(1, len(files) + 1)
    ]
    assert rec["checkpoint_mb"] == pytest.approx(folder_bytes(folder) / MB, abs=0.01)
    assert_reference_checkpoint(d, files, folder, tiny_llama)
    files[-1].unlink()  # an incomplete copy says so
    with pytest.raises(FileNotFoundError, match="not a complete set"):
        load_drafter(folder, tiny_llama)


@pytest.mark.parametrize("paradigm", ["kv", "hybrid"])
def test_a_committed_checkpoint_decodes_losslessly(tiny_llama, tmp_path, paradigm):
    commit_checkpoint(trained_like(tiny_llama, paradigm), tmp_path / "d", max_file_mb=LIMIT_MB)
    drafter = load_drafter(tmp_path / "d", tiny_llama)
    prompt = list(range(5, 40))
    plain = generate(tiny_llama, prompt, DecodeConfig(mode="ar", max_new_tokens=24))
    for mode in ("chain", "tree"):
        cfg = DecodeConfig(
            mode=mode, max_new_tokens=24, chain_depth=4, tree_depth=3, tree_top_k=2, tree_budget=6
        )
        assert generate(tiny_llama, prompt, cfg, drafter).token_ids == plain.token_ids, mode


def test_a_committed_checkpoint_names_its_starting_folder_relative_to_the_checkout(tiny_llama, tmp_path):
    """A row continued from another (``init_from``) trains with that folder's full path; the committed copy keeps
    it relative to the checkout, the drafter itself keeps the full one, and the summary row's helper gives the same."""
    from kvshot_lib.training import portable_init

    d = trained_like(tiny_llama, "hidden")
    start = str(REPO_ROOT / "runs" / "onpolicy" / "drafters" / "hidden31-ttt-noloop-s2")
    d.cfg.extra = dict(init_from=dict(path=start, copied=["fc.weight"]), train_config=dict(init_from=start))
    commit_checkpoint(d, tmp_path / "d", max_file_mb=LIMIT_MB)
    text = (tmp_path / "d" / "config.json").read_text()
    extra = json.loads(text)["extra"]
    assert (
        extra["init_from"]["path"]
        == extra["train_config"]["init_from"]
        == "runs/onpolicy/drafters/hidden31-ttt-noloop-s2"
    )
    assert str(REPO_ROOT) not in text
    assert d.cfg.extra["init_from"]["path"] == start
    assert [portable_init(x) for x in (start, "target", None)] == [extra["init_from"]["path"], "target", ""]


def test_the_run_budget_leaves_out_a_checkpoint_that_does_not_fit(tiny_llama, tmp_path):
    first = commit_checkpoint(trained_like(tiny_llama, "hidden"), tmp_path / "a", max_total_mb=0.2)
    assert first["checkpoint"] and (tmp_path / "a" / "config.json").is_file()
    second = commit_checkpoint(trained_like(tiny_llama, "hybrid"), tmp_path / "b", max_total_mb=0.2)
    assert second["checkpoint"] == "" and "over 0.2 MB" in second["checkpoint_skipped"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # nothing half-written is left behind


def test_the_budget_counts_every_committed_run_but_not_smoke_runs(tiny_llama, tmp_path):
    """Under ``checkpoints/`` the 60 MB rule is over all runs: another run's row counts, a smoke run's does not.
    Tiny-llama's hidden drafter (~0.13 MB) and no-target drafter (~0.08 MB) are together over 0.2 MB."""
    root, limit = tmp_path / "checkpoints", dict(max_total_mb=0.2)

    def commit(paradigm, run, row):
        return commit_checkpoint(trained_like(tiny_llama, paradigm), root / run / row, **limit)

    assert commit("none", "run-smoke", "a")["checkpoint"]
    assert commit("hidden", "new-run", "b")["checkpoint"]  # the smoke run's drafter does not count
    other = commit("none", "old-run", "c")  # the other run's hidden does
    assert other["checkpoint"] == "" and "committed checkpoints" in other["checkpoint_skipped"]
    assert not (root / "old-run" / "c").exists()
    assert commit("hidden", "new-run", "b")["checkpoint"]  # a row replacing itself is not counted twice
    assert commit("hidden", "run-smoke", "d")["checkpoint"] == ""  # a smoke run counts its own rows


@pytest.mark.slow  # ~8 s: make test-slow, which CI runs
def test_kvshot_generate_takes_a_committed_checkpoint(tiny_llama, tmp_path):
    """What a fresh clone does: ``kvshot generate --drafter checkpoints/<run>/<row>``, no training, no runs/."""
    commit_checkpoint(trained_like(tiny_llama, "hybrid"), tmp_path / "hybrid-ttt", max_file_mb=LIMIT_MB)
    done = subprocess.run(
        [sys.executable, "-m", "kvshot_lib.cli", "generate", "--target", "tiny-llama", "--device", "cpu",
         "--drafter", str(tmp_path / "hybrid-ttt"), "--mode", "chain", "--raw", "--prompt", "one two three",
         "--max-new-tokens", "12", "--json"],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout[done.stdout.index("{") :])
    prompt = tiny_llama.tokenizer("one two three", add_special_tokens=False)["input_ids"]
    plain = generate(tiny_llama, prompt, DecodeConfig(mode="ar", max_new_tokens=12))
    assert out["token_ids"] == plain.token_ids


def test_checkpoint_folders_name_what_is_wrong_before_any_work(tmp_path):
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "config.json").write_text("{}")
    assert checkpoint_folders(None, {"a": "ok"}, tmp_path) == {"a": tmp_path / "ok"}
    assert checkpoint_folders(["b=ok"], {"a": "missing"}, tmp_path) == {"b": tmp_path / "ok"}
    with pytest.raises(ValueError, match="NAME=FOLDER, got 'ok'"):
        checkpoint_folders(["ok"], {}, tmp_path)
    with pytest.raises(ValueError, match="--drafter a: no checkpoint in missing"):
        checkpoint_folders(None, {"a": "missing"}, tmp_path)
