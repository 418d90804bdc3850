"""Drafter checkpoints: ``config.json`` (the :class:`DrafterConfig`) + ``model.safetensors`` (the state dict).

A checkpoint saved with a per-file limit (``save_drafter(..., max_file_bytes=...)``, the reference run's
committed checkpoints) splits its tensors over ``model-00001-of-00002.safetensors``, ... instead; every reader
goes through :func:`read_weights`, which takes either layout.

The state dict is the drafter's trainable parameters plus ``d2t`` (the draft vocabulary) and
``target_probe`` (a sample of the target's embedding). The frozen embedding and LM head are the target's
and are never saved, so loading needs the target, and refuses one that is not the drafter's: another
architecture (fingerprint), another vocabulary, or the same architecture with other weights (probe).
Loading is strict and bitwise: what was saved is what comes back. Nothing is pickled. :func:`load_drafter` also
takes a folder in the EAGLE-3 layout that the serving engines share (``eagle3_format.py``). A weights file that is
damaged (cut short) or not safetensors at all (a pickle renamed) is refused by its header
(:func:`check_weights`), as a :class:`~kvshot_lib.user_errors.UsageError`.

:func:`save_drafter` commits with ``config.json``: the new weight files are written under temporary names, the
old ``config.json`` is withdrawn before any old weight file is replaced, and the new one is renamed in last. An
interrupted save leaves the old checkpoint, or a folder that :func:`read_config` refuses as incomplete; never
the weights of one save under the config of another.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..target import Target
from ..user_errors import UsageError
from .block import BlockDrafter
from .config import DrafterConfig, DrafterConfigError, DrafterTargetMismatch
from .cross import CrossDrafter
from .eagle3_format import is_eagle3_folder, load_eagle3
from .hidden import HiddenDrafter
from .hybrid import HybridDrafter
from .kv import KVDrafter
from .no_target import NoTargetDrafter
from .output_folder import mode_like
from .trainable import TrainableDrafter
from .vocab import vocab_hash

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
SHARD_GLOB = "model-*-of-*.safetensors"
CLASSES = {"hidden": HiddenDrafter, "kv": KVDrafter, "hybrid": HybridDrafter, "none": NoTargetDrafter}
CLASSES.update(cross=CrossDrafter, block=BlockDrafter)  # one per config.PARADIGMS


def fresh_drafter(cfg: DrafterConfig, target: Target, d2t: torch.Tensor) -> TrainableDrafter:
    """A drafter of ``cfg.paradigm`` over ``target``, on its device, initialized from the global RNG."""
    return CLASSES[cfg.paradigm](cfg, target, d2t).to(target.model.model.embed_tokens.weight.device)


def build_drafter(
    cfg: DrafterConfig, target: Target, d2t: torch.Tensor, seed: int | None = None
) -> TrainableDrafter:
    """A freshly initialized drafter of ``cfg.paradigm`` for ``target`` (seeded if ``seed`` is given)."""
    cfg.vocab_hash = vocab_hash(d2t)
    if seed is None:
        return fresh_drafter(cfg, target, d2t)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # parameters are initialized on the CPU, so the seed fixes them on any device
        return fresh_drafter(cfg, target, d2t)


def save_drafter(
    drafter: TrainableDrafter,
    path: str | Path,
    dtype: torch.dtype | None = None,
    max_file_bytes: int | None = None,
) -> Path:
    """Write ``config.json`` and the weights under ``path``, ``config.json`` last (see the module's docstring).

    ``dtype`` (e.g. ``torch.bfloat16``) stores the trainable weights in that dtype (the reference run's committed
    checkpoints); ``d2t`` and ``target_probe`` keep theirs. Loading casts back to the drafter's dtype.
    ``max_file_bytes`` splits the tensors over numbered files of at most about that size each (a tensor is never
    cut), when they do not fit one."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
    if dtype is not None:
        state = {
            k: v.to(dtype) if v.is_floating_point() and k != "target_probe" else v for k, v in state.items()
        }
    groups = _shards(state, max_file_bytes)
    names = (
        [WEIGHTS_FILE]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    cfg = drafter.cfg.as_dict()
    cfg["vocab_hash"] = vocab_hash(drafter.d2t.cpu())
    (path / (CONFIG_FILE + ".tmp")).write_text(json.dumps(cfg, indent=1))
    for name, keys in zip(names, groups):
        save_file(
            {k: state[k] for k in keys}, str(path / (name + ".tmp")), metadata={"format": drafter.cfg.format}
        )
    (path / CONFIG_FILE).unlink(missing_ok=True)  # withdrawn: from here the folder reads as incomplete
    for old in (path / WEIGHTS_FILE, *path.glob(SHARD_GLOB)):  # a save replaces either layout
        old.unlink(missing_ok=True)
    for name in names:
        (path / (name + ".tmp")).rename(path / name)
    mode_like(path / (CONFIG_FILE + ".tmp"), [path / name for name in names])
    (path / (CONFIG_FILE + ".tmp")).rename(path / CONFIG_FILE)  # the commit
    return path


def _shards(state: dict, max_bytes: int | None) -> list[list[str]]:
    """The tensor names of each file, in state order: one file, or groups of at most ``max_bytes`` each."""
    groups, size = [[]], 0
    for k, v in state.items():
        n = v.numel() * v.element_size()
        if max_bytes and groups[-1] and size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += n
    return groups


def weight_files(path: str | Path) -> list[Path]:
    """The weight files of the checkpoint at ``path``: ``model.safetensors``, or its numbered shards."""
    path = Path(path)
    if (path / WEIGHTS_FILE).is_file():
        return [path / WEIGHTS_FILE]
    shards = sorted(path.glob(SHARD_GLOB))
    total = {s.name.rsplit("-of-", 1)[1].split(".")[0] for s in shards}
    if shards and len(total) == 1 and int(total.pop()) == len(shards):
        return shards
    found = f" (found {len(shards)} shard files, not a complete set)" if shards else ""
    raise FileNotFoundError(
        f"The drafter checkpoint {path} lacks {WEIGHTS_FILE}{found}; it is incomplete (an interrupted "
        "save or copy?). Retrain it, or resume its training."
    )


def check_weights(path: str | Path) -> list[Path]:
    """The weight files of the checkpoint at ``path``, each with a whole safetensors header that covers the file;
    a :class:`UsageError` names the one that is cut short or not safetensors (a pickle renamed, say)."""
    files = weight_files(path)
    for file in files:
        try:
            with safe_open(str(file), "pt"):  # reads the header only, and checks it against the file's size
                pass
        except SafetensorError as e:
            raise UsageError(
                f"{file} is damaged or not a safetensors file ({e}); copy the checkpoint again from where it came, "
                "or retrain it."
            ) from None
    return files


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``path``, as saved (either layout)."""
    state = {}
    for file in check_weights(path):
        with safe_open(str(file), "pt") as f:
            state.update({k: f.get_tensor(k) for k in f.keys()})
    return state


def read_config(path: str | Path) -> DrafterConfig:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"No drafter checkpoint at {path}: expected a folder with {CONFIG_FILE} and "
            f"{WEIGHTS_FILE} (written by save_drafter / notebook 02)."
        )
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(
            f"The drafter checkpoint {path} lacks {CONFIG_FILE}; it is incomplete (an interrupted "
            "save?). Retrain it, or resume its training."
        )
    weight_files(path)
    try:
        raw = json.loads((path / CONFIG_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DrafterConfigError(
            f"{path / CONFIG_FILE} is not valid JSON ({e}); copy the checkpoint again, or retrain it."
        ) from None
    if not isinstance(raw, dict):
        raise DrafterConfigError(f"{path / CONFIG_FILE} must hold a JSON object.")
    return DrafterConfig.from_dict(raw)


def load_drafter(path: str | Path, target: Target, dtype: torch.dtype | None = None) -> TrainableDrafter:
    """Load a drafter checkpoint for ``target``; raises a clear error on a wrong target or a bad checkpoint.
    ``dtype`` (e.g. ``torch.bfloat16`` for bf16 decoding) casts its weights and draft head after loading.
    A folder in the shared EAGLE-3 layout (``eagle3_format.py``) loads as a hidden drafter."""
    path = Path(path)
    if is_eagle3_folder(path):
        return load_eagle3(path, target, dtype)
    cfg = read_config(path)
    cfg.check_target(target.info, where=f"the drafter at {path}")
    state = read_weights(path)
    if "d2t" not in state:
        raise DrafterConfigError(
            f"{path / WEIGHTS_FILE} has no d2t tensor; it is not a KVShot drafter checkpoint."
        )
    d2t = state["d2t"]
    if vocab_hash(d2t) != cfg.vocab_hash:
        raise DrafterConfigError(
            f"{path}: the draft vocabulary in {WEIGHTS_FILE} (hash {vocab_hash(d2t)}) does not "
            f"match the config's vocab_hash {cfg.vocab_hash}; the two files come from different runs."
        )
    drafter = fresh_drafter(cfg, target, d2t)
    probe = drafter.target_probe.cpu()
    saved = state.get("target_probe")
    if saved is None or saved.shape != probe.shape or not torch.allclose(saved, probe, rtol=2e-2, atol=1e-3):
        raise DrafterTargetMismatch(
            f"the drafter at {path} was trained with target {cfg.target_name!r}, and {target.info.name!r} has the same "
            "architecture but different embedding weights (another seed or fine-tune). Load the target it was trained "
            "with."
        )
    state["target_probe"] = drafter.target_probe.cpu()  # the live target's, within tolerance of the saved one
    device = drafter.head.device
    missing_or_unexpected = drafter.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=False)
    if missing_or_unexpected.missing_keys or missing_or_unexpected.unexpected_keys:
        raise DrafterConfigError(
            f"{path / WEIGHTS_FILE} does not fit its config: missing "
            f"{missing_or_unexpected.missing_keys}, unexpected {missing_or_unexpected.unexpected_keys}."
        )
    drafter.eval()
    return drafter if dtype is None else drafter.to(dtype)


def rebind_drafter(
    drafter: TrainableDrafter, target: Target, dtype: torch.dtype | None = None
) -> TrainableDrafter:
    """The same trained drafter bound to another copy of its target (e.g. the target cast to bf16 for decoding):
    a fresh drafter of the same config over ``target``'s embedding, rotary table and LM-head rows, with
    ``drafter``'s learned weights, cast to ``dtype`` when given."""
    fresh = fresh_drafter(drafter.cfg, target, drafter.d2t.cpu())
    state = {k: v for k, v in drafter.state_dict().items() if k != "target_probe"}
    result = fresh.load_state_dict(state, strict=False)
    if result.missing_keys != ["target_probe"] or result.unexpected_keys:
        raise DrafterConfigError(
            f"rebinding drafter {drafter.name!r}: missing {result.missing_keys}, unexpected {result.unexpected_keys}."
        )
    fresh.eval()
    return fresh if dtype is None else fresh.to(dtype)
