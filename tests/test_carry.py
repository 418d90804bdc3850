"""A run carried to a new machine goes on: from the committed folder that ``carry_saver`` keeps (bf16 weights and
the run's position, no optimizer), a session without ``runs/`` resumes at the step the folder reached, on the same
data positions, with the learning rate warmed up again, and writes the finished run with the whole history.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from kvshot_lib.corpus import extract_features, tokenize_sharegpt
from kvshot_lib.reference import carry_saver
from kvshot_lib.target import REPO_ROOT, cpu_model, load_target
from kvshot_lib.training import (
    StoreBatches,
    TrainConfig,
    build_draft_vocab,
    read_carried,
    read_train_state,
    rewarm_factor,
    train_drafter,
    trained_alike,
    write_carried,
)

# 5 training conversations, batch 2; a state (and its carried copy) every 3 steps, 12 steps in all, warm-up 4
PARAMS = dict(
    paradigm="hidden",
    regime="ttt",
    ttt_steps=3,
    train_steps=12,
    batch_size=2,
    max_tokens=64,
    draft_vocab_size=256,
    eval_every=4,
    eval_sequences=2,
    probe_every=0,
    save_every=3,
    lr=0.01,
    warmup_steps=4,
)
KILLED_AT = 6  # steps done when the first machine stops
REAL_BATCH = StoreBatches.batch


@pytest.fixture(scope="module")
def setup(tokenizer, tmp_path_factory):
    target = load_target("tiny-llama", device="cpu", seed=0)
    splits = (
        tokenize_sharegpt(tokenizer, "train", 5, 128, seed=0),
        tokenize_sharegpt(tokenizer, "eval", 2, 128, seed=0),
    )
    root = tmp_path_factory.mktemp("carry")
    stores = tuple(
        extract_features(target, s, out_dir=root / n, dtype="float32") for s, n in zip(splits, ("t", "e"))
    )
    d2t = build_draft_vocab(splits[0], target, 256)
    whole = train_drafter(target, *stores, TrainConfig(**PARAMS), root / "whole", d2t=d2t, progress=False)
    return dict(target=target, stores=stores, d2t=d2t, whole=whole)


def steps_asked(monkeypatch, kill_at: int | None = None) -> list[int]:
    """Record the steps whose batch the loop asks for; raise KeyboardInterrupt when it asks for ``kill_at``."""
    seen = []

    def batch(self, step):
        if step == kill_at:
            raise KeyboardInterrupt
        seen.append(step)
        return REAL_BATCH(self, step)

    monkeypatch.setattr(StoreBatches, "batch", batch)
    return seen


def first_machine(setup, out, folder, monkeypatch, cfg=None):
    """Train until the machine stops after KILLED_AT steps, keeping the carried folder."""
    steps_asked(monkeypatch, kill_at=KILLED_AT)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(
            setup["target"], *setup["stores"], cfg or TrainConfig(**PARAMS), out, d2t=setup["d2t"],
            progress=False, carried=folder, on_save=carry_saver(folder),
        )  # fmt: skip


def test_the_history_comes_back_as_rows(tmp_path):
    rows = [
        dict(step=1, loss=2.5, tokens=130, epoch=None, acc_0=0.25),
        dict(step=2, loss=1.0 / 3, tokens=2**40, epoch=0.8, acc_0=0.5),
    ]
    logs = dict(history=rows, eval=[dict(step=2, acc_0=0.5)], curve=[], _seconds=12.5)
    write_carried(tmp_path, 2, {"lr": 0.01}, logs, {"best_step": 0})
    meta = read_carried(tmp_path)
    got = meta["logs"]["history"]
    assert [r["step"] for r in got] == [1, 2] and [r["tokens"] for r in got] == [130, 2**40]  # exact integers
    assert list(got[0]) == list(rows[0])  # the columns in the rows' order (history.csv keeps it)
    assert got[0]["epoch"] is None and got[1]["epoch"] == pytest.approx(0.8, rel=1e-7)
    assert got[1]["loss"] == pytest.approx(1 / 3, rel=1e-7) and got[1]["loss"] != 1 / 3  # float32, said so
    assert (
        meta["step"] == 2
        and meta["config"] == {"lr": 0.01, "init_from": None}
        and meta["logs"]["_seconds"] == 12.5
    )
    assert meta["logs"]["eval"] == [dict(step=2, acc_0=0.5)] and meta["early_stopping"] == {"best_step": 0}


def test_a_carried_config_holds_no_machine_path_and_still_resumes(tmp_path):
    config = TrainConfig(**PARAMS, init_from=str(REPO_ROOT / "checkpoints" / "run" / "row")).as_dict()
    write_carried(tmp_path, 3, config, {"history": []}, {})
    saved = read_carried(tmp_path)["config"]
    assert saved["init_from"] == str(Path("checkpoints") / "run" / "row")  # relative to the checkout
    assert trained_alike(saved) == trained_alike(config)  # the same run, so it resumes


def test_the_learning_rate_warms_up_again_after_a_restart():
    cfg = TrainConfig(**PARAMS)  # warmup_steps 4
    restarts = [dict(step=6)]
    assert [rewarm_factor(cfg, s, restarts) for s in (0, 5, 6, 7, 8, 9, 10, 100)] == [
        1.0, 1.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0,
    ]  # fmt: skip
    assert rewarm_factor(cfg, 7, []) == 1.0
    assert rewarm_factor(cfg, 21, [dict(step=6), dict(step=20)]) == 0.5  # the last restart counts


def test_a_run_carried_to_a_new_machine_goes_on(setup, tmp_path, monkeypatch):
    whole = setup["whole"]
    folder = tmp_path / "checkpoints" / "run" / "row.partial"
    first_machine(setup, tmp_path / "first", folder, monkeypatch)
    assert read_carried(folder)["step"] == KILLED_AT
    carried_weights = json.loads((folder / "config.json").read_text())
    assert carried_weights["vocab_hash"] and (folder / "model.safetensors").stat().st_size > 0

    seen = steps_asked(monkeypatch)  # the new machine: no runs/ folder, only the carried one
    cfg = TrainConfig(**PARAMS)
    run = train_drafter(
        setup["target"], *setup["stores"], cfg, tmp_path / "second", d2t=setup["d2t"], progress=False,
        carried=folder,
    )  # fmt: skip
    assert seen == list(range(KILLED_AT, PARAMS["train_steps"]))  # went on, did not start over
    got, want = run.logs["history"], whole.logs["history"]
    assert [r["step"] for r in got] == list(range(1, PARAMS["train_steps"] + 1))
    assert [r["tokens"] for r in got] == [r["tokens"] for r in want]  # the same data positions
    for a, b in zip(got[:KILLED_AT], want[:KILLED_AT]):  # the first machine's history, kept (float32)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    # the first step after the restart is taken from the carried weights (bf16 copies of the step-6 weights):
    # its loss, computed before the update, is the uninterrupted run's to bf16 rounding, far from a fresh start's
    resumed, uninterrupted, first = got[KILLED_AT]["loss"], want[KILLED_AT]["loss"], want[0]["loss"]
    assert abs(resumed - uninterrupted) < 0.01 * uninterrupted < abs(first - uninterrupted)
    # the restart is logged and the learning rate warms up again from it, then follows the plan
    assert [(r["step"], r["cpu"]) for r in run.logs["restarts"]] == [(KILLED_AT, cpu_model())]  # who went on
    for k in range(KILLED_AT, PARAMS["train_steps"]):
        factor = min(1.0, (k - KILLED_AT + 1) / PARAMS["warmup_steps"])
        assert got[k]["lr"] == pytest.approx(want[k]["lr"] * factor, rel=1e-6), k
    assert (
        run.drafter.cfg.extra["completed"] and run.drafter.cfg.extra["steps_trained"] == PARAMS["train_steps"]
    )
    assert (tmp_path / "second" / "restarts.csv").is_file()


def test_a_saved_state_further_along_wins_over_the_carried_folder(setup, tmp_path, monkeypatch):
    out, folder = tmp_path / "run", tmp_path / "checkpoints" / "run" / "row.partial"
    first_machine(setup, out, folder, monkeypatch)
    write_carried(
        folder, 3, TrainConfig(**PARAMS).as_dict(), dict(read_carried(folder)["logs"]), {}
    )  # behind
    seen = steps_asked(monkeypatch)
    run = train_drafter(
        setup["target"], *setup["stores"], TrainConfig(**PARAMS), out, d2t=setup["d2t"], progress=False,
        carried=folder,
    )  # fmt: skip
    assert seen == list(range(KILLED_AT, PARAMS["train_steps"])) and run.logs["restarts"] == []
    a, b = run.drafter.state_dict(), setup["whole"].drafter.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # the exact resume, optimizer and all


def test_a_carried_folder_of_another_config_is_named_before_it_is_trained_over(setup, tmp_path, monkeypatch):
    folder = tmp_path / "checkpoints" / "run" / "row.partial"
    first_machine(setup, tmp_path / "first", folder, monkeypatch)
    seen = steps_asked(monkeypatch, kill_at=1)
    with (
        pytest.warns(UserWarning, match=r"another config \(lr\): starting over"),
        pytest.raises(KeyboardInterrupt),
    ):
        train_drafter(
            setup["target"], *setup["stores"], TrainConfig(**dict(PARAMS, lr=0.02)), tmp_path / "second",
            d2t=setup["d2t"], progress=False, carried=folder,
        )  # fmt: skip
    assert seen == [0]


def test_a_carried_folder_of_another_draft_vocabulary_is_refused(setup, tmp_path, monkeypatch):
    folder = tmp_path / "checkpoints" / "run" / "row.partial"
    first_machine(setup, tmp_path / "first", folder, monkeypatch)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, vocab_hash="0" * 12)))
    steps_asked(monkeypatch)
    with pytest.raises(ValueError, match="draft vocabulary 000000000000.*belongs to another run"):
        train_drafter(
            setup["target"], *setup["stores"], TrainConfig(**PARAMS), tmp_path / "second", d2t=setup["d2t"],
            progress=False, carried=folder,
        )  # fmt: skip


def test_a_carried_run_over_the_checkpoint_limit_warns_and_keeps_the_last_folder(
    setup, tmp_path, monkeypatch
):
    folder = tmp_path / "checkpoints" / "run" / "row.partial"
    drafter = setup["whole"].drafter
    save = carry_saver(folder)
    save(drafter, 3, TrainConfig(**PARAMS).as_dict(), dict(history=[], _seconds=1.0), {})
    before = read_carried(folder)["step"]
    with pytest.warns(UserWarning, match="row.partial not carried: .* over 0.001 MB"):
        carry_saver(folder, max_total_mb=0.001)(
            drafter, 6, TrainConfig(**PARAMS).as_dict(), {"history": []}, {}
        )
    assert before == read_carried(folder)["step"] == 3


def test_early_stopping_is_not_carried(setup, tmp_path):
    with pytest.raises(ValueError, match="early_stop_patience=0 to carry"):
        train_drafter(
            setup["target"], *setup["stores"], TrainConfig(**dict(PARAMS, early_stop_patience=2)), tmp_path,
            d2t=setup["d2t"], progress=False, carried=tmp_path / "row.partial",
        )  # fmt: skip


def test_a_carried_run_goes_on_after_its_starting_checkpoint_is_retired(setup, tmp_path, monkeypatch):
    """A continued row (``init_from``) reads its starting checkpoint only when it starts afresh: once it carries its
    own weights, that checkpoint may leave the repository, and both resumes go on without it."""
    start, folder = tmp_path / "start", tmp_path / "checkpoints" / "run" / "row.partial"
    shutil.copytree(setup["whole"].out_dir, start, ignore=shutil.ignore_patterns("*.csv"))
    cfg, out = TrainConfig(**PARAMS, init_from=str(start)), tmp_path / "first"
    first_machine(setup, out, folder, monkeypatch, cfg)
    record = json.loads((folder / "config.json").read_text())["extra"]["init_from"]
    assert record["copied"]  # the weights did come from the starting checkpoint
    shutil.rmtree(start)  # retired (git history keeps it)

    seen = steps_asked(monkeypatch, kill_at=9)  # the same machine: from the saved state, optimizer and all
    with pytest.raises(KeyboardInterrupt):
        train_drafter(
            setup["target"], *setup["stores"], cfg, out, d2t=setup["d2t"], progress=False, carried=folder,
            on_save=carry_saver(folder),
        )  # fmt: skip
    assert seen == [6, 7, 8] and read_train_state(out)["step"] == read_carried(folder)["step"] == 9

    seen = steps_asked(monkeypatch)  # a new machine: from the carried folder
    run = train_drafter(
        setup["target"], *setup["stores"], cfg, tmp_path / "second", d2t=setup["d2t"], progress=False,
        carried=folder,
    )  # fmt: skip
    assert seen == [9, 10, 11] and [r["step"] for r in run.logs["restarts"]] == [9]
    assert run.drafter.cfg.extra["init_from"] == record  # where the row started, still said

    steps_asked(monkeypatch)  # a fresh start does need it
    with pytest.raises(FileNotFoundError, match="No drafter checkpoint at .*start"):
        train_drafter(
            setup["target"], *setup["stores"], cfg, tmp_path / "third", d2t=setup["d2t"], progress=False
        )
