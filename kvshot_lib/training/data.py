"""What a training run takes as data, and how a drafter may start from another's checkpoint.

* ``data_source="store"`` trains on :class:`~kvshot_lib.corpus.FeatureStore` s (features extracted once);
  ``data_source="online"`` trains on :class:`~kvshot_lib.corpus.TokenizedSplit` s (original or regenerated
  ShareGPT), the target computing the features at every step (:mod:`.online`). :func:`check_data` refuses a
  mismatch before any work, with the call that makes the right object.
* :func:`init_from_checkpoint` copies into a fresh drafter every parameter of a finished checkpoint that has
  the same name and shape (the paper's "hybrid from the EAGLE-3 checkpoint": a hybrid or cross-only drafter
  started from a trained hidden-only one). The checkpoint must be for the same target and draft vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..drafters.checkpoint import read_config, read_weights
from ..drafters.config import DrafterConfigError

NOT_COPIED = ("d2t", "target_probe")  # buffers that describe the drafter's binding, not what it learned


def is_feature_store(data) -> bool:
    return hasattr(data, "manifest") and hasattr(data, "sequence")


def is_tokenized_split(data) -> bool:
    return hasattr(data, "ids") and hasattr(data, "loss_mask") and not is_feature_store(data)


def check_data(cfg, train_data, eval_data) -> None:
    """Refuse training data of the wrong kind for ``cfg.data_source`` (before any long work)."""
    for data, what in ((train_data, "training"), (eval_data, "held-out")):
        if cfg.data_source == "online" and not is_tokenized_split(data):
            raise TypeError(
                f"drafter {cfg.name!r} trains online (data_source='online'): its {what} data must be a "
                f"TokenizedSplit (corpus.tokenize_sharegpt or corpus.regenerated_split), got {type(data).__name__}."
            )
        if cfg.data_source == "store" and not is_feature_store(data):
            raise TypeError(
                f"drafter {cfg.name!r} trains on a feature store (data_source='store'): its {what} data must be "
                f"a FeatureStore (corpus.extract_features), got {type(data).__name__}; or set data_source='online'."
            )


def describe_data(data) -> str:
    """A short record of the data, for the checkpoint's metadata (``train_store``, ``eval_store``): a feature
    store by its folder's name, the target and a hash of what was extracted (``smollm2-135m-3b8c463ff23c``, under
    ``<cache>/features/``), never this machine's path; online data by its split's spec."""
    if is_feature_store(data):
        return Path(data.path).name
    spec = getattr(data, "spec", {}) or {}
    return "online: " + ", ".join(f"{k}={spec[k]}" for k in sorted(spec) if k != "tokenizer")


def init_from_checkpoint(drafter, path: str | Path, target) -> dict:
    """Copy the same-named, same-shaped parameters of the checkpoint at ``path`` into ``drafter``.

    Returns ``{"path", "copied": [...], "kept": [...]}`` (``kept``: the drafter's own initialization)."""
    path = Path(path)
    src = read_config(path)
    src.check_target(target.info, where=f"the init_from checkpoint {path}")
    if src.vocab_hash != drafter.cfg.vocab_hash:
        raise DrafterConfigError(
            f"init_from={str(path)!r} has draft vocabulary {src.vocab_hash}, this drafter {drafter.cfg.vocab_hash}; "
            "pass the checkpoint's d2t (load_drafter(path, target).d2t) to train_drafter so that the two agree."
        )
    own = drafter.state_dict()
    copied = []
    with torch.no_grad():
        for name, value in read_weights(path).items():
            if name in NOT_COPIED or name not in own:
                continue
            if value.shape == own[name].shape:
                own[name].copy_(value.to(own[name].dtype))
                copied.append(name)
    if not copied:
        raise DrafterConfigError(
            f"init_from={str(path)!r} (a {src.paradigm} drafter) shares no parameter with this {drafter.cfg.paradigm} drafter."
        )
    kept = sorted(set(own) - set(copied) - set(NOT_COPIED))
    return dict(path=str(path), paradigm=src.paradigm, copied=sorted(copied), kept=kept)
