"""`kvshot export` never destroys a checkpoint: it refuses its own drafter's folder (or one holding it) as
``--out``, a folder with files in it without ``--force``, and it writes beside ``--out`` and swaps the new folder
in, so an export killed while it writes leaves the old folder as it was (hashes before and after). A drafter
checkpoint's own save commits with its ``config.json``, last."""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import time
from pathlib import Path

import pytest
import torch

from kvshot_lib import cli, target
from kvshot_lib.drafters import (
    build_drafter,
    checkpoint,
    drafter_config_for,
    eagle3_format,
    load_drafter,
    read_config,
    save_drafter,
)
from kvshot_lib.user_errors import EXIT_USAGE


def tree_hashes(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` by its path relative to it: the sha256 of its bytes."""
    return {
        str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.rglob("*"))
        if f.is_file()
    }


def refused(argv: list[str], capsys) -> tuple[int, str]:
    """``kvshot argv``'s exit status and its one line on stderr."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("kvshot: "), err
    return exit_.value.code, err


@pytest.fixture(scope="module")
def drafter_dir(tiny_llama, tmp_path_factory) -> Path:
    """A hidden drafter checkpoint for tiny-llama, in a folder of its own inside a runs-like tree."""
    cfg = drafter_config_for(tiny_llama, "hidden", draft_vocab_size=64, name="hidden-ttt")
    folder = tmp_path_factory.mktemp("runs") / "drafters" / "hidden-ttt"
    return save_drafter(build_drafter(cfg, tiny_llama, torch.arange(64), seed=0), folder)


def no_loading(monkeypatch) -> None:
    fail = lambda *a, **k: pytest.fail("a model was loaded for an --out that is refused")  # noqa: E731
    monkeypatch.setattr(target, "load_target", fail)


def test_export_onto_its_own_drafter_or_a_folder_holding_it_is_refused(drafter_dir, monkeypatch, capsys):
    no_loading(monkeypatch)
    before = tree_hashes(drafter_dir.parent.parent)
    for out, force in ((drafter_dir, []), (drafter_dir, ["--force"]), (drafter_dir.parent, ["--force"])):
        code, err = refused(["export", "--drafter", str(drafter_dir), "--out", str(out), *force], capsys)
        assert code == EXIT_USAGE and "Pass another folder" in err
        assert ("own folder" in err) == (out == drafter_dir)
    # the same folder reached through a symbolic link is the same folder
    link = drafter_dir.parent / "link"
    link.symlink_to(drafter_dir, target_is_directory=True)
    code, err = refused(["export", "--drafter", str(drafter_dir), "--out", str(link)], capsys)
    assert code == EXIT_USAGE and "own folder" in err
    link.unlink()
    assert tree_hashes(drafter_dir.parent.parent) == before


def test_a_folder_with_files_needs_force_and_is_then_replaced_whole(drafter_dir, tmp_path, capsys):
    out = tmp_path / "exported"
    out.mkdir()
    (out / "config.json").write_text('{"keep": 1}')
    (out / "notes.txt").write_text("mine")
    code, err = refused(["export", "--drafter", str(drafter_dir), "--out", str(out)], capsys)
    assert code == EXIT_USAGE and "--force" in err and "config.json" in err
    assert (out / "config.json").read_text() == '{"keep": 1}' and (out / "notes.txt").read_text() == "mine"

    assert cli.main(["export", "--drafter", str(drafter_dir), "--out", str(out), "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
    ]  # the old folder, gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]  # nothing left beside it
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes  # not 0600 beside 0644
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~_umask()  # as any folder made here, not 0700
    # an empty folder needs no --force
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["export", "--drafter", str(drafter_dir), "--out", str(empty)]) == 0
    assert tree_hashes(empty) == tree_hashes(out)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def export_killed_while_writing(drafter: Path, out: Path, tiny_llama) -> int:
    """``kvshot export --drafter drafter --out out --force`` in a forked process that is killed (SIGKILL) once half
    of its weights file is on disk; returns the signal that ended it."""
    pid = os.fork()
    if pid == 0:  # the child: never returns to pytest
        try:
            real = eagle3_format.save_file

            def half_then_killed(tensors, path, **kw):
                real(tensors, path, **kw)
                data = Path(path).read_bytes()
                Path(path).write_bytes(data[: len(data) // 2])  # half the weights are on disk
                os.kill(os.getpid(), signal.SIGKILL)

            eagle3_format.save_file = half_then_killed
            target.load_target = lambda *a, **k: tiny_llama
            cli.main(["export", "--drafter", str(drafter), "--out", str(out), "--force"])
        finally:
            os._exit(3)  # reached only if the kill did not happen
    for _ in range(1200):  # up to 2 minutes
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status)
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the export did not reach its weights file within 2 minutes")


def test_an_export_killed_while_it_writes_leaves_the_old_folder_intact(drafter_dir, tiny_llama, tmp_path):
    out = tmp_path / "exported"
    assert cli.main(["export", "--drafter", str(drafter_dir), "--out", str(out)]) == 0
    first = tree_hashes(out)
    (out / "notes.txt").write_text("the folder as it was")
    old, source = tree_hashes(out), tree_hashes(drafter_dir)

    assert export_killed_while_writing(drafter_dir, out, tiny_llama) == signal.SIGKILL
    (partial,) = tmp_path.glob(".exported.partial-*")  # killed midway: half a weights file beside --out
    assert 0 < (partial / "model.safetensors").stat().st_size < (out / "model.safetensors").stat().st_size
    assert tree_hashes(out) == old and tree_hashes(drafter_dir) == source

    # the next export clears what the killed one left, and its folder loads
    assert cli.main(["export", "--drafter", str(drafter_dir), "--out", str(out), "--force"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]
    assert tree_hashes(out) == first
    assert load_drafter(out, tiny_llama).cfg.draft_vocab_size == 64


def test_a_checkpoint_save_cut_short_never_pairs_new_weights_with_the_old_config(
    tiny_llama, tmp_path, monkeypatch
):
    """``save_drafter`` commits with ``config.json``: cut before the weights are renamed in, the old checkpoint is
    whole; cut after, the folder reads as incomplete, never as the old config over the new weights."""
    cfg = drafter_config_for(tiny_llama, "hidden", draft_vocab_size=64)
    folder = save_drafter(build_drafter(cfg, tiny_llama, torch.arange(64), seed=0), tmp_path / "d")
    old = {n: tree_hashes(folder)[n] for n in ("config.json", "model.safetensors")}
    other = build_drafter(cfg, tiny_llama, torch.arange(64, 128), seed=1)  # another draft vocabulary

    def cut(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "save_file", cut)  # before any weight file is renamed in
    with pytest.raises(KeyboardInterrupt):
        save_drafter(other, folder)
    assert {n: tree_hashes(folder)[n] for n in old} == old
    assert load_drafter(folder, tiny_llama).d2t.tolist() == list(range(64))

    monkeypatch.undo()
    monkeypatch.setattr(checkpoint, "mode_like", cut)  # the new weights are in, the commit is not
    with pytest.raises(KeyboardInterrupt):
        save_drafter(other, folder)
    with pytest.raises(FileNotFoundError, match="lacks config.json; it is incomplete"):
        read_config(folder)
    monkeypatch.undo()
    save_drafter(other, folder)  # saved again, whole
    assert load_drafter(folder, tiny_llama).d2t.tolist() == list(range(64, 128))
