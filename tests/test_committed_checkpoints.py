"""The drafters committed under ``checkpoints/<run>/`` (the on-policy run's, and any other run's), as a fresh clone
has them: within the size limits, bf16 trainable weights only, loading on the CPU with SmolLM2, refusing another target, and decoding
losslessly (chain and tree equal to plain greedy decoding) with no training and nothing under ``runs/``; and no
committed file under ``checkpoints/`` or ``figures/`` records a path of the machine that wrote it."""

import subprocess

import pytest
from conftest import assert_bf16_trainable_weights

from kvshot_lib.corpus import chat_prompt_ids
from kvshot_lib.decoding import DecodeConfig, generate
from kvshot_lib.drafters import DrafterTargetMismatch, load_drafter
from kvshot_lib.reference import load_plan
from kvshot_lib.target import REPO_ROOT, load_target

CHECKPOINTS = REPO_ROOT / "checkpoints"
RUNS = sorted(p for p in CHECKPOINTS.iterdir() if p.is_dir() and not p.name.endswith("-smoke"))
ROWS = [
    f"{run.name}/{p.name}" for run in RUNS for p in sorted(run.iterdir()) if (p / "config.json").is_file()
]
MB = 10**6


@pytest.fixture(scope="module")
def smollm2():
    return load_target("smollm2-135m", device="cpu", dtype="float32")


def test_every_committed_checkpoint_together_fits_60_mb():
    """The repository's rule: at most 60 MB of committed checkpoints in all (every run's, smoke runs aside)."""
    assert ROWS, "a fresh clone has committed checkpoints"
    files = [f for run in RUNS for f in run.rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) <= 60 * MB


@pytest.mark.parametrize("run", RUNS, ids=lambda p: p.name)
def test_the_committed_checkpoints_fit_their_runs_budget(run):
    limits = load_plan(run.name).checkpoints  # max_file_mb: 16, max_total_mb: 60
    files = [f for f in run.rglob("*") if f.is_file()]
    assert all(f.stat().st_size <= limits["max_file_mb"] * MB for f in files)
    assert sum(f.stat().st_size for f in files) <= limits["max_total_mb"] * MB


@pytest.mark.parametrize("row", ROWS)
def test_a_committed_drafter_is_bf16_loads_and_refuses_another_target(smollm2, row):
    folder = CHECKPOINTS / row
    drafter = load_drafter(folder, smollm2)
    assert_bf16_trainable_weights(
        drafter, sorted(folder.glob("model*.safetensors"))
    )  # a carried run's history aside
    assert drafter.head.device.type == "cpu"
    with pytest.raises(DrafterTargetMismatch, match="trained for target"):
        load_drafter(folder, load_target("tiny-llama", device="cpu"))


@pytest.mark.slow  # ~11 s each on SmolLM2: make test-slow, which CI runs, keeps make test within its budget
@pytest.mark.parametrize("row", ROWS)
def test_a_committed_drafter_decodes_losslessly(smollm2, row):
    drafter = load_drafter(CHECKPOINTS / row, smollm2)
    prompt = chat_prompt_ids(smollm2.tokenizer, [{"role": "user", "content": "Why is the sky blue?"}])
    plain = generate(smollm2, prompt, DecodeConfig(mode="ar", max_new_tokens=40))
    for mode in ("chain", "tree"):
        cfg = DecodeConfig(
            mode=mode, max_new_tokens=40, chain_depth=6, tree_depth=5, tree_top_k=4, tree_budget=16
        )
        out = generate(smollm2, prompt, cfg, drafter)
        assert out.token_ids == plain.token_ids, mode
        assert sum(out.accepted_per_cycle) > 0, mode  # a trained drafter: some drafts are accepted


def committed_files(*folders: str) -> list:
    """The files git tracks under ``folders`` (every file there where the checkout has no git)."""
    done = subprocess.run(["git", "ls-files", *folders], cwd=REPO_ROOT, capture_output=True, text=True)
    if done.returncode == 0 and done.stdout.strip():
        return [REPO_ROOT / f for f in done.stdout.split()]
    return [f for d in folders for f in (REPO_ROOT / d).rglob("*") if f.is_file()]


def test_no_committed_result_records_an_absolute_machine_path():
    files = committed_files("checkpoints", "figures")
    assert any(f.name == "config.json" for f in files) and any(f.suffix == ".csv" for f in files)
    found = [
        f"{f.relative_to(REPO_ROOT)}: {root.decode()}"
        for f in files
        for root in (b"/work/", b"/root/", b"/home/", b"/tmp/", b"/Users/")
        if root in f.read_bytes()
    ]
    fix = "record stores and files by name or hash, not by this machine's path"
    assert not found, fix + ":\n" + "\n".join(found)
