"""What a training run takes as data, and how a drafter may start from another's checkpoint.

* ``data_source="store"`` trains on :class:`~kvshot_lib.corpus.FeatureStore` s (features extracted once,
  :class:`StoreData`); ``data_source="online"`` trains on :class:`~kvshot_lib.corpus.TokenizedSplit` s
  (original or regenerated ShareGPT), the target computing the features at every step (:class:`OnlineData`,
  :mod:`.online`). :func:`data_source` gives the loop one of them: its checks, batches and held-out set.
* :func:`init_from_checkpoint` copies into a fresh drafter every parameter of a finished checkpoint that has
  the same name and shape (the paper's "hybrid from the EAGLE-3 checkpoint": a hybrid or cross-only drafter
  started from a trained hidden-only one). The checkpoint must be for the same target and draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..corpus import FeatureStore, TokenizedSplit
from ..drafters.checkpoint import read_config, read_weights
from ..drafters.config import DrafterConfig, DrafterConfigError
from ..drafters.trainable import TrainableDrafter
from ..target import Target
from ..target.precision import resolve_precision
from .batches import StoreBatches
from .config import TrainConfig
from .heldout import EvalSet
from .online import OnlineBatches, online_eval_set

NOT_COPIED = ("d2t", "target_probe")  # buffers that describe the drafter's binding, not what it learned


def is_feature_store(data) -> bool:
    return hasattr(data, "manifest") and hasattr(data, "sequence")


def is_tokenized_split(data) -> bool:
    return hasattr(data, "ids") and hasattr(data, "loss_mask") and not is_feature_store(data)


@dataclass
class StoreData:
    """Feature stores (``data_source="store"``): the loop's batches and held-out set, once checked."""

    cfg: TrainConfig
    target: Target
    train: FeatureStore | TokenizedSplit
    held: FeatureStore | TokenizedSplit
    holds, build_eval = staticmethod(is_feature_store), staticmethod(EvalSet.build)
    wants = (
        "trains on a feature store (data_source='store'): its {} data must be a FeatureStore "
        "(corpus.extract_features), got {}; or set data_source='online'."
    )

    def check(self) -> None:
        """Refuse data of the wrong kind (before any long work), with the call that makes the right one."""
        for data, what in ((self.train, "training"), (self.held, "held-out")):
            if not self.holds(data):
                raise TypeError(f"drafter {self.cfg.name!r} " + self.wants.format(what, type(data).__name__))

    def check_compatible(self, dcfg: DrafterConfig) -> None:
        """Refuse a store extracted from another target or without the layers the drafter reads."""
        info = self.target.info
        for store, what in ((self.train, "training"), (self.held, "held-out")):
            try:
                store.check_compatible(info.name, info.fingerprint, dcfg.hidden_layers, dcfg.kv_layers)
            except ValueError as e:
                raise ValueError(
                    f"The {what} feature store does not fit drafter {self.cfg.name!r}: {e}"
                ) from None

    def loader(self, dcfg: DrafterConfig, rank: int, world: int) -> StoreBatches | OnlineBatches:
        c = self.cfg
        return StoreBatches(self.train, dcfg, c.batch_size, c.seed, rank, world, c.max_tokens)

    def eval_set(self, dcfg: DrafterConfig) -> EvalSet:
        c = self.cfg
        return self.build_eval(self.held, dcfg, self.target, c.eval_sequences, c.batch_size, c.max_tokens)


class OnlineData(StoreData):
    """Tokenized splits (``data_source="online"``), the target computing the features at every step."""

    holds, build_eval = staticmethod(is_tokenized_split), staticmethod(online_eval_set)
    wants = (
        "trains online (data_source='online'): its {} data must be a TokenizedSplit "
        "(corpus.tokenize_sharegpt or corpus.regenerated_split), got {}."
    )

    def check_compatible(self, dcfg: DrafterConfig) -> None:
        """Nothing to check: the target computes the features itself."""

    def loader(self, dcfg: DrafterConfig, rank: int, world: int) -> OnlineBatches:
        c, device = self.cfg, self.target.info.device
        precision = resolve_precision(c.mixed_precision, device)  # the target under the drafter's autocast
        return OnlineBatches(
            self.target, self.train, dcfg, c.batch_size, c.seed, rank, world, c.max_tokens, precision
        )


def data_source(cfg: TrainConfig, target: Target, train, held) -> StoreData:
    """A run's training and held-out data, read as ``cfg.data_source`` says."""
    return (OnlineData if cfg.data_source == "online" else StoreData)(cfg, target, train, held)


def describe_data(data) -> str:
    """A short record of the data, for the checkpoint's metadata (``train_store``, ``eval_store``): a feature
    store by its folder's name, the target and a hash of what was extracted (``smollm2-135m-3b8c463ff23c``, under
    ``<cache>/features/``), never this machine's path; online data by its split's spec."""
    if is_feature_store(data):
        return Path(data.path).name
    spec = getattr(data, "spec", {}) or {}
    return "online: " + ", ".join(f"{k}={spec[k]}" for k in sorted(spec) if k != "tokenizer")


def init_from_checkpoint(drafter: TrainableDrafter, path: str | Path, target: Target) -> dict:
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
