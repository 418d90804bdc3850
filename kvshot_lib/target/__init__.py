"""The target stage: find the installed assets, load the target model, and capture what it computes.

* :func:`load_target` gives a :class:`Target` (model, tokenizer, :class:`TargetInfo`) for a preset
  (``smollm2-135m``, ``tiny-llama``, ``tiny-qwen3``), a Hugging Face id or a local folder; :func:`random_target`
  one of any shape with random weights (the GPU check's Qwen3-8B shape, :data:`QWEN3_8B_CONFIG`);
* :class:`StaticKVCache` is the preallocated cache of the fast decode path, written by slot; :mod:`.graphs` is
  where its forwards are captured as CUDA graphs, one per padded width (:func:`width_for`);
* :func:`capture` records hidden states, post-RoPE K/V and post-RoPE queries through transformers' own
  seams, and undoes every hook on exit;
* :mod:`.precision`: ``mixed_precision: auto`` resolved against the hardware (bf16 on a CPU with AMX-BF16 or
  AVX512-BF16), the one ``autocast`` every stage runs under, the dtype decoding runs in (:func:`cast_target` copies a
  target into it), and the machine record every table carries.

It hands the loaded target and the captured tensors to ``corpus`` (feature extraction) and everything after.
"""

from . import assets
from .assets import REPO_ROOT, MissingAssetError, cache_dir, repo_relative
from .capture import Captured, capture, decoder_layers
from .graphs import WIDTHS, capture_seconds, width_for
from .loading import (
    DEFAULT_TARGET,
    KNOWN_ARCHITECTURES,
    PRESETS,
    QWEN3_8B_CONFIG,
    SUPPORTED_FAMILIES,
    TINY_CONFIG,
    Target,
    TargetInfo,
    TargetLoadError,
    cast_target,
    load_target,
    random_target,
    smollm2_tokenizer,
    target_architecture,
    target_shape,
)
from .precision import (
    DECODE_PRECISIONS,
    PRECISIONS,
    PrecisionError,
    autocast,
    bf16_isa,
    bf16_tier,
    cpu_model,
    decode_dtype,
    machine_label,
    machine_record,
    precision_label,
    resolve_precision,
)
from .static_cache import StaticKVCache, block_mask, prepare, static_cache_for

__all__ = [
    "Captured",
    "DECODE_PRECISIONS",
    "PRECISIONS",
    "PrecisionError",
    "DEFAULT_TARGET",
    "KNOWN_ARCHITECTURES",
    "MissingAssetError",
    "PRESETS",
    "QWEN3_8B_CONFIG",
    "REPO_ROOT",
    "repo_relative",
    "SUPPORTED_FAMILIES",
    "StaticKVCache",
    "TINY_CONFIG",
    "WIDTHS",
    "Target",
    "TargetInfo",
    "TargetLoadError",
    "assets",
    "autocast",
    "bf16_isa",
    "bf16_tier",
    "block_mask",
    "cache_dir",
    "capture",
    "capture_seconds",
    "cast_target",
    "cpu_model",
    "decode_dtype",
    "decoder_layers",
    "load_target",
    "machine_label",
    "machine_record",
    "precision_label",
    "prepare",
    "random_target",
    "resolve_precision",
    "smollm2_tokenizer",
    "static_cache_for",
    "target_architecture",
    "target_shape",
    "width_for",
]
