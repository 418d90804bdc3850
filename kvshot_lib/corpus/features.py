"""The feature store: the target's hidden states, K/V and label features, in safetensors shards.

Extraction runs the frozen target over tokenized conversations and writes, per shard of whole
sequences (token-major, so one sequence is a contiguous row range):

* ``input_ids [N] int32``, ``loss_mask [N] uint8``, ``lengths [S] int64``
* ``hidden.{l} [N, hidden]``   output of decoder layer ``l`` (for each hidden layer)
* ``keys.{l}, values.{l} [N, kv_heads, head_dim]``   post-RoPE, as the cache holds them (for each KV layer)
* ``final_hidden [N, hidden]``   the last hidden state after the final norm: the target's next-token
  distribution at position t is exactly ``softmax(lm_head(final_hidden[t]))``, so drafters get their soft
  labels over any (draft) vocabulary from it

A JSON manifest records the target (name and architecture fingerprint), layers, dtype, the data slice,
per-shard token counts and sha256, the token count and a content hash. Shards are written to a temporary
name and renamed, and the manifest is rewritten after each one, so an interrupted extraction resumes:
finished shards are kept (their hashes are checked), an interrupted shard is redone.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..target import Target, assets
from ..target.forward import sequence_features
from ..target.precision import autocast, machine_record, resolve_precision
from .sharegpt import TokenizedSplit

FORMAT = "kvshot-features/1"
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class FeatureStoreMismatch(ValueError):
    """A feature store on disk does not match what was asked for."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _plan_shards(lengths: Sequence[int], shard_tokens: int) -> list[tuple[int, int]]:
    """Group consecutive sequences into shards of at least ``shard_tokens`` tokens: [(start, end)]."""
    shards, start, acc = [], 0, 0
    for i, n in enumerate(lengths):
        acc += n
        if acc >= shard_tokens:
            shards.append((start, i + 1))
            start, acc = i + 1, 0
    if start < len(lengths):
        shards.append((start, len(lengths)))
    return shards


def default_store_dir(
    target: Target, split: TokenizedSplit, hidden_layers, kv_layers, dtype: str, precision: str = "no"
) -> Path:
    parts = [
        target.info.name,
        target.info.fingerprint,
        list(hidden_layers),
        list(kv_layers),
        dtype,
        split.spec,
    ]
    if precision != "no":  # stores computed in float32 keep the folder they always had
        parts.append(precision)
    key = json.dumps(parts, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return assets.cache_dir() / "features" / f"{target.info.name.replace('/', '--')}-{digest}"


def _check_layers(layers: Sequence[int], n_layers: int, what: str) -> list[int]:
    layers = [int(x) for x in layers]
    bad = [x for x in layers if not 0 <= x < n_layers - 1]
    if bad or len(set(layers)) != len(layers):
        raise ValueError(
            f"{what} layers {layers} are invalid: use distinct decoder layers in 0..{n_layers - 2} "
            f"(the last layer's output is post-norm and is stored as final_hidden)."
        )
    return layers


@torch.inference_mode()
def _extract_sequence(target: Target, ids: torch.Tensor, manifest: dict) -> dict:
    """One sequence's features, as the manifest asks for them (layers, dtype, precision)."""
    model, dtype = target.model, _DTYPES[manifest["dtype"]]
    with autocast(manifest["precision"], next(model.parameters()).device):
        f = sequence_features(model, ids[None], manifest["hidden_layers"], manifest["kv_layers"])
    feats = {"final_hidden": f.final[0].to(dtype).cpu()}  # [T, hidden], after the final norm
    for layer in manifest["hidden_layers"]:
        feats[f"hidden.{layer}"] = f.hidden[layer][0].to(dtype).cpu()  # [T, hidden]
    for layer in manifest["kv_layers"]:
        feats[f"keys.{layer}"] = f.keys[layer][0].transpose(0, 1).to(dtype).cpu()  # [T, kvH, D]
        feats[f"values.{layer}"] = f.values[layer][0].transpose(0, 1).to(dtype).cpu()
    for name, x in feats.items():
        if not torch.isfinite(x).all():
            raise FloatingPointError(
                f"{name} overflows {dtype} (the target has activations beyond its range); "
                "extract with dtype='bfloat16' or 'float32'."
            )
    return feats


def extract_features(
    target: Target,
    split: TokenizedSplit,
    hidden_layers: Sequence[int] | None = None,
    kv_layers: Sequence[int] | None = None,
    out_dir: str | Path | None = None,
    dtype: str = "auto",
    shard_tokens: int = 32768,
    precision: str = "auto",
    extract: bool = True,
) -> FeatureStore | None:
    """Extract (or resume extracting) features of ``split`` with ``target``; returns the finished store
    (``extract=False``: the finished store, or None where there is none yet, and nothing is written).

    ``hidden_layers`` defaults to EAGLE-3's (1, L/2-1, L-4); ``kv_layers`` defaults to the same layers.
    ``precision`` (``auto`` / ``no`` / ``bf16``, see target/precision.py) is what the target's forward runs
    in: ``auto`` is bf16 autocast on a CPU or GPU that has it. ``dtype='auto'`` stores bfloat16 when the
    target or its forward is bf16, and float16 otherwise (a float32 forward keeps float16's finer mantissa).
    Stores of any of these dtypes, float32 included, load the same way.
    """
    info = target.info
    precision = resolve_precision(precision, info.device)
    if dtype == "auto":
        dtype = "bfloat16" if "bfloat16" in (info.dtype,) or precision == "bf16" else "float16"
    hidden_layers = _check_layers(hidden_layers or info.default_hidden_layers(), info.n_layers, "hidden")
    kv_layers = _check_layers(kv_layers or info.default_hidden_layers(), info.n_layers, "KV")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype!r}.")
    out = (
        Path(out_dir)
        if out_dir
        else default_store_dir(target, split, hidden_layers, kv_layers, dtype, precision)
    )
    manifest = _manifest(target, split, hidden_layers, kv_layers, dtype, precision, shard_tokens)
    # A finished store is only read: runs sharing it can start together, and it keeps its machine record.
    if _resume(out, manifest):
        return FeatureStore(out)
    if not extract:
        return None
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.tmp"):
        stale.unlink()
    finished = {s["index"] for s in manifest["shards"]}
    bar = tqdm(
        total=manifest["n_tokens"],
        initial=sum(s["tokens"] for s in manifest["shards"]),
        unit="tok",
        desc=f"extracting features ({info.name})",
        smoothing=0.1,
    )
    for i in range(len(manifest["shard_plan"])):
        if i not in finished:
            _write_shard(out, manifest, i, target, split, bar)
    bar.close()
    manifest["shards"].sort(key=lambda s: s["index"])
    manifest["complete"] = True
    manifest["content_hash"] = hashlib.sha256(
        "".join(s["sha256"] for s in manifest["shards"]).encode()
    ).hexdigest()
    manifest["bytes"] = sum(s["bytes"] for s in manifest["shards"])
    manifest["bytes_per_token"] = manifest["bytes"] / max(1, manifest["n_tokens"])
    _write_manifest(out, manifest)
    return FeatureStore(out)


def _manifest(
    target: Target, split: TokenizedSplit, hidden_layers, kv_layers, dtype, precision, shard_tokens
) -> dict:
    """The manifest of a store not yet extracted: what it holds, and its plan of shards."""
    info = target.info
    lengths = [len(x) for x in split.ids]
    return dict(
        format=FORMAT,
        target=info.name,
        target_fingerprint=info.fingerprint,
        hidden_layers=hidden_layers,
        kv_layers=kv_layers,
        dtype=dtype,
        precision=precision,
        machine=machine_record(precision, info.device),
        data=split.spec,
        hidden_size=info.hidden_size,
        n_kv_heads=info.n_kv_heads,
        head_dim=info.head_dim,
        n_sequences=len(lengths),
        n_tokens=sum(lengths),
        shard_plan=[list(p) for p in _plan_shards(lengths, shard_tokens)],
        shards=[],
        complete=False,
        extraction_seconds=0.0,
    )


def _resume(out: Path, manifest: dict) -> bool:
    """Take over, into ``manifest``, the intact shards and the time of an extraction into ``out`` of the same
    store (refusing a store of anything else); whether that store is complete."""
    if not (out / "manifest.json").is_file():
        return False
    old = json.loads((out / "manifest.json").read_text())
    old.setdefault("precision", "no")  # stores from before precision was recorded ran in float32
    made = ("format", "target", "target_fingerprint", "hidden_layers", "kv_layers", "dtype", "precision")
    diff = {k: (old.get(k), manifest[k]) for k in (*made, "data", "shard_plan") if old.get(k) != manifest[k]}
    if diff:
        lines = "\n".join(f"  {k}: on disk {a!r}, requested {b!r}" for k, (a, b) in diff.items())
        raise FeatureStoreMismatch(
            f"The feature store at {out} was made for something else:\n{lines}\n"
            "Choose another out_dir, or delete that folder to re-extract."
        )
    manifest["extraction_seconds"] = old.get("extraction_seconds", 0.0)
    for shard in old.get("shards", []):
        path = out / shard["file"]
        if path.is_file() and _sha256(path) == shard["sha256"]:
            manifest["shards"].append(shard)
    return bool(old.get("complete")) and len(manifest["shards"]) == len(manifest["shard_plan"])


def _write_shard(out: Path, manifest: dict, i: int, target: Target, split: TokenizedSplit, bar) -> None:
    """Extract shard ``i`` of the manifest's plan, write it (under a temporary name, then renamed) and record it
    in the manifest, on disk too."""
    start, end = manifest["shard_plan"][i]
    lengths = [len(x) for x in split.ids[start:end]]
    t0 = time.perf_counter()
    parts = []
    for ids in split.ids[start:end]:
        parts.append(_extract_sequence(target, ids, manifest))
        bar.update(len(ids))
    tensors = {k: torch.cat([p[k] for p in parts]).contiguous() for k in parts[0]}
    tensors["input_ids"] = torch.cat(split.ids[start:end]).to(torch.int32)
    tensors["loss_mask"] = torch.cat(split.loss_mask[start:end]).to(torch.uint8)
    tensors["lengths"] = torch.tensor(lengths, dtype=torch.int64)
    name = f"shard-{i:05d}.safetensors"
    save_file(tensors, str(out / (name + ".tmp")))
    (out / (name + ".tmp")).rename(out / name)
    manifest["extraction_seconds"] += time.perf_counter() - t0
    manifest["shards"].append(
        dict(
            index=i,
            file=name,
            sequences=[start, end],
            tokens=sum(lengths),
            bytes=(out / name).stat().st_size,
            sha256=_sha256(out / name),
        )
    )
    _write_manifest(out, manifest)


def _write_manifest(out: Path, manifest: dict) -> None:
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.rename(out / "manifest.json")


@dataclass
class FeatureStore:
    """Lazy reader of a finished feature store. ``sequence(i)`` loads only that sequence's rows."""

    path: Path

    def __post_init__(self):
        self.path = Path(self.path)
        mf = self.path / "manifest.json"
        if not mf.is_file():
            raise FileNotFoundError(
                f"No feature store at {self.path} (manifest.json missing); run extract_features."
            )
        self.manifest = json.loads(mf.read_text())
        if self.manifest.get("format") != FORMAT:
            raise FeatureStoreMismatch(
                f"{mf} has format {self.manifest.get('format')!r}, expected {FORMAT!r}."
            )
        if not self.manifest.get("complete"):
            raise FeatureStoreMismatch(
                f"The feature store at {self.path} is incomplete; rerun extract_features to resume."
            )
        self._index: list[tuple[int, int, int]] = []  # sequence -> (shard, row start, row end)
        for s_i, shard in enumerate(self.manifest["shards"]):
            start, end = shard["sequences"]
            with safe_open(str(self.path / shard["file"]), "pt") as f:
                lengths = f.get_tensor("lengths").tolist()
            if len(lengths) != end - start:
                raise FeatureStoreMismatch(
                    f"{shard['file']} holds {len(lengths)} sequences, manifest says {end - start}."
                )
            row = 0
            for n in lengths:
                self._index.append((s_i, row, row + n))
                row += n

    def __len__(self) -> int:
        return len(self._index)

    def subset(self, indices) -> FeatureStore:
        """A view of the sequences ``indices``, in that order, reading the same files (nothing is copied)."""
        pick = [int(i) for i in indices]
        view = copy.copy(self)
        view._index = [self._index[i] for i in pick]
        key = hashlib.sha256(json.dumps([self.manifest.get("content_hash"), pick]).encode()).hexdigest()[:16]
        view.manifest = dict(self.manifest, content_hash=key, n_sequences=len(pick), n_tokens=view.n_tokens)
        return view

    @property
    def n_tokens(self) -> int:
        return sum(b - a for _, a, b in self._index)

    @property
    def bytes_per_token(self) -> float:
        return float(self.manifest["bytes_per_token"])

    @property
    def hidden_layers(self) -> list[int]:
        return list(self.manifest["hidden_layers"])

    @property
    def kv_layers(self) -> list[int]:
        return list(self.manifest["kv_layers"])

    def summary(self) -> dict:
        """Size and extraction throughput, as recorded in the manifest."""
        m = self.manifest
        secs = m.get("extraction_seconds") or float("nan")
        return {
            "path": str(self.path),
            "split": m["data"].get("split"),
            "sequences": m["n_sequences"],
            "tokens": m["n_tokens"],
            "extraction_seconds": round(secs, 1),
            "tokens_per_s": round(m["n_tokens"] / secs, 1),
            "bytes_per_token": round(m["bytes_per_token"]),
            "gigabytes": round(m["bytes"] / 1e9, 3),
            "dtype": m["dtype"],
            "precision": {"no": "fp32"}.get(m.get("precision", "no"), m.get("precision")),
            "hidden_layers": m["hidden_layers"],
            "kv_layers": m["kv_layers"],
        }

    def check_compatible(self, target_name: str, fingerprint: str, hidden_layers=(), kv_layers=()) -> None:
        """Refuse, with a clear message, a store made for another target or lacking the needed layers."""
        m = self.manifest
        if m["target_fingerprint"] != fingerprint:
            raise FeatureStoreMismatch(
                f"The feature store at {self.path} was extracted from target {m['target']!r} "
                f"(fingerprint {m['target_fingerprint']}), not {target_name!r} ({fingerprint})."
            )
        missing_h = sorted(set(hidden_layers) - set(m["hidden_layers"]))
        missing_kv = sorted(set(kv_layers) - set(m["kv_layers"]))
        if missing_h or missing_kv:
            raise FeatureStoreMismatch(
                f"The feature store at {self.path} has hidden layers {m['hidden_layers']} and KV layers {m['kv_layers']}; "
                f"missing hidden {missing_h}, KV {missing_kv}. Extract features with those layers."
            )

    def sequence(self, i: int, fields: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Sequence ``i``'s tensors (all fields, or the named ones), each with the token axis first."""
        s_i, a, b = self._index[i]
        with safe_open(str(self.path / self.manifest["shards"][s_i]["file"]), "pt") as f:
            names = [k for k in f.keys() if k != "lengths"] if fields is None else list(fields)
            return {k: f.get_slice(k)[a:b] for k in names}

    def sequences(self, fields: Sequence[str] | None = None) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(len(self)):
            yield self.sequence(i, fields)
