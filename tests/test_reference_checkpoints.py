"""The reference run's committed checkpoints (``kvshot_lib.reference.checkpoints``) at smoke scale: small bf16
files of the trainable weights that load on the CPU with their own target, refuse another one, and decode
losslessly (greedy equal to plain decoding), from the folder alone as a fresh clone has it."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from kvshot_lib.decoding import DecodeConfig, generate
from kvshot_lib.drafters import DrafterTargetMismatch, build_drafter, drafter_config_for, load_drafter
from kvshot_lib.reference import commit_checkpoint, folder_bytes
from kvshot_lib.target import REPO_ROOT, load_target

MB = 10**6  # the limits are in decimal megabytes
LIMIT_MB = 0.1  # tiny-llama drafters are ~0.1-0.2 MB in bf16: the hybrid's weights need two files


def trained_like(target, paradigm: str):
    """A drafter of ``paradigm`` whose weights moved away from their initialization (as training moves them)."""
    cfg = drafter_config_for(target, paradigm, draft_vocab_size=512, name=f"{paradigm}-ttt", regime="ttt")
    d = build_drafter(cfg, target, torch.arange(512) * 7, seed=0)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return d


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
    dtypes = {}
    for f in files:
        with safe_open(str(f), "pt") as sf:
            dtypes.update({k: sf.get_tensor(k).dtype for k in sf.keys()})
    trainable = {n for n, p in d.named_parameters() if p.requires_grad}
    assert set(dtypes) == trainable | {"d2t", "target_probe"}  # no frozen embedding, no LM head
    assert all(dtypes[n] == torch.bfloat16 for n in trainable) and dtypes["d2t"] == torch.int64
    back = load_drafter(folder, tiny_llama)
    assert back.head.device.type == "cpu"
    for n, p in d.state_dict().items():
        if n in trainable:
            assert torch.equal(back.state_dict()[n], p.to(torch.bfloat16).float()), n
    with pytest.raises(DrafterTargetMismatch, match="trained for target"):
        load_drafter(folder, load_target("tiny-qwen3", device="cpu"))  # another architecture
    with pytest.raises(DrafterTargetMismatch, match="different embedding weights"):
        load_drafter(
            folder, load_target("tiny-llama", device="cpu", seed=1)
        )  # same architecture, other weights
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


def test_the_run_budget_leaves_out_a_checkpoint_that_does_not_fit(tiny_llama, tmp_path):
    first = commit_checkpoint(trained_like(tiny_llama, "hidden"), tmp_path / "a", max_total_mb=0.2)
    assert first["checkpoint"] and (tmp_path / "a" / "config.json").is_file()
    second = commit_checkpoint(trained_like(tiny_llama, "hybrid"), tmp_path / "b", max_total_mb=0.2)
    assert second["checkpoint"] == "" and "over 0.2 MB" in second["checkpoint_skipped"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # nothing half-written is left behind


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
