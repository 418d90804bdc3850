"""The target stage: find the installed assets, load the target model, and capture what it computes.

* :func:`load_target` gives a :class:`Target` (model, tokenizer, :class:`TargetInfo`) for a preset
  (``smollm2-135m``, ``tiny-llama``, ``tiny-qwen3``), a Hugging Face id or a local folder;
* :func:`capture` records hidden states, post-RoPE K/V and post-RoPE queries through transformers' own
  seams, and undoes every hook on exit.

It hands the loaded target and the captured tensors to ``corpus`` (feature extraction) and everything after.
"""

from . import assets
from .assets import REPO_ROOT, MissingAssetError, cache_dir
from .capture import Captured, capture, decoder_layers
from .loading import (
    DEFAULT_TARGET,
    PRESETS,
    SUPPORTED_FAMILIES,
    TINY_CONFIG,
    Target,
    TargetInfo,
    TargetLoadError,
    load_target,
    smollm2_tokenizer,
    target_architecture,
)

__all__ = [
    "Captured",
    "DEFAULT_TARGET",
    "MissingAssetError",
    "PRESETS",
    "REPO_ROOT",
    "SUPPORTED_FAMILIES",
    "TINY_CONFIG",
    "Target",
    "TargetInfo",
    "TargetLoadError",
    "assets",
    "cache_dir",
    "capture",
    "decoder_layers",
    "load_target",
    "smollm2_tokenizer",
    "target_architecture",
]
