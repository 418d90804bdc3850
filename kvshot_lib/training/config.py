"""The training configuration: one dataclass, and the one place that turns a notebook's parameter dict into it.

A notebook (or ``kvshot train``) describes each drafter as a dict, e.g.
``{"paradigm": "kv", "regime": "ttt", "kv_mode": "linear_rope", "n_layers": 2}``, on top of shared
defaults (``train_steps``, ``lr``, ...). :meth:`TrainConfig.from_params` checks every key, type and value
and says what was wrong and what is allowed, before any long work starts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from ..drafters.config import (
    BLOCK_CONTEXTS,
    EAGLE31_PARADIGMS,
    KV_MODES,
    KV_SOFTMAX,
    PARADIGMS,
    READS_HIDDEN,
    READS_KV,
    REGIMES,
    TARGET_KV,
)
from ..target.precision import PRECISIONS
from .grad_probes import GROUPS
from .schedule import SCHEDULES

DATA_SOURCES = ("store", "online")
STOP_METRICS = ("mat", "acc_0")
# Parameters added after runs were saved with the rest: as_dict() leaves each out at its default, so that those
# runs' saved configs still match (a finished row is read back, a killed one resumes) and their hashes hold.
ADDED_LATER = {
    "plateau_min_steps": 0,
    "converge_z": 0.0,
    "tokens_before": 0,
    "answer_start_weight": 1.0,
    "answer_start_tokens": 64,
}


class TrainConfigError(ValueError):
    """A training parameter is unknown, of the wrong type, or out of range."""


@dataclass
class TrainConfig:
    paradigm: str  # "hidden" | "kv" | "hybrid" | "none" (no-target control) | "cross" (cross-only) | "block"
    regime: (
        str  # "tf" (teacher forcing) | "ttt" | "ttt_dense" (TTT with dense per-position losses) | "parallel"
    )
    name: str = ""  # checkpoint folder name; default "<paradigm>-<regime>" ("block-<context>")
    # architecture
    n_layers: int = 1
    kv_mode: str = "concat"  # "concat" | "linear" | "linear_rope"
    query_group: int | None = None  # queries per injected KV head; None = the target's GQA group
    # KV-only design (issue 12): the target's KV gets a softmax of its own and an ALiBi-initialized recency
    # bias over the last 32 positions; with one shared softmax and no bias (the first design, still what a
    # checkpoint without these fields loads as) the drafter learned nothing from what the KV holds
    kv_recency: int | None = None  # recency-bias window on target-KV scores; None = 32 (kv), 0 (others)
    target_kv: str = "real"  # "zeroed": the control, trained (and decoding) with every target K/V set to 0
    kv_softmax: str = "separate"  # "shared": target and own K/V in one softmax
    context: str = (
        ""  # block drafter: "kv" | "hidden" | "both" (its target context); "zeroed" zeroes all of it
    )
    # EAGLE 3.1 (hidden, hybrid): one RMSNorm per captured target layer before fc; post-norm feedback
    fc_norm: bool = False
    norm_output: bool = False
    hidden_layers: list[int] | None = None  # None = EAGLE-3's (1, L/2-1, L-4)
    kv_layers: list[int] | None = None  # None = the same layers
    draft_vocab_size: int = 8192
    # optimization
    train_steps: int = 300  # optimizer steps
    batch_size: int = 2  # sequences per step (per process)
    max_tokens: int | None = None  # crop sequences to this many tokens (None: as stored)
    lr: float = 1e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # the schedule decays to lr * min_lr_ratio
    schedule: str = "cosine"  # "cosine" | "wsd" (warmup-stable-decay, training/schedule.py)
    # wsd: the final decay, and each curve point's decay branch, as a share of its budget
    decay_fraction: float = 0.1
    # held-out points at log-spaced budgets T/2^j, each after a decay branch (wsd; 0 = off)
    curve_points: int = 0
    # wsd: end the stable phase once held-out acc_0 moved by less than this over the last quarter (0 = off)
    plateau_stop: float = 0.0
    # ...and not before this step (0: from the fourth evaluation); a run on a large corpus sees it once first
    plateau_min_steps: int = 0
    # wsd: end the stable phase at the first decay branch whose annealed held-out acc_0 and cross-entropy gained
    # less than this many standard errors over a doubling of token-passes (convergence.py; 0 = off)
    converge_z: float = 0.0
    # token-passes the starting weights (init_from) had already trained on: the curve counts from there, and its
    # first point is the starting drafter itself (annealed when it was a finished run)
    tokens_before: int = 0
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 0.5  # global-norm clipping (0 = off)
    mixed_precision: str = (
        "auto"  # "auto" (bf16 where a probe measures it faster: target/precision.py) | "no" | "bf16" | "fp16"
    )
    seed: int = 0
    # the loss weight of the tokens among each answer's first answer_start_tokens (1 = every token alike; MT-bench
    # measures 64-token answers, whose starts a drafter trained on whole answers predicts worst)
    answer_start_weight: float = 1.0
    answer_start_tokens: int = 64
    # regime
    ttt_steps: int = 7  # K: unrolled steps (ttt, ttt_dense) or drafted block length (parallel); tf uses 1
    step_decay: float | None = (
        None  # step i weighs step_decay**i; None = 0.8 (ttt, parallel); ttt_dense weighs every step 1
    )
    feature_loss_weight: float | None = None  # None = 0, or 1.0 for ttt_dense (hidden, hybrid)
    kv_align_weight: float | None = None  # None = 1.0 for ttt_dense, 0 otherwise
    detach_chain: bool = False  # stop gradients between unrolled steps through the reused hidden state
    branch_fraction: float = 1.0  # share of branches unrolled past step 0 (1.0 = all, as EAGLE-3; < 1 is cheaper)  # parallel: the share of a sequence's positions that anchor a block (random, per sequence and step)
    # remedies for the K/V-projection gradient (notebook 05)
    grad_scale: dict = field(
        default_factory=dict
    )  # group -> factor applied to its gradient, e.g. {"kv_proj": 50}
    lr_scale: dict = field(default_factory=dict)  # group -> learning-rate multiplier
    # logging
    eval_every: int = 100
    eval_sequences: int = 32
    eval_steps: int = 7  # draft steps evaluated on the held-out slice (0..eval_steps-1)
    eval_branch_fraction: float = 1.0  # share of held-out branches evaluated past step 0
    probe_every: int = 10  # gradient probes every n steps (0 = off)
    probe_rel_threshold: float = 1e-2
    probe_samples: int = 2000  # raw (attention, gradient) pairs kept from the last probe
    save_every: int = 50  # resumable state every n steps
    # data and convergence (the reference run)
    data_source: str = (
        "store"  # "store": a feature store; "online": the target runs in the loop on a tokenized split
    )
    init_from: str | None = None  # a checkpoint folder whose same-named parameters start this drafter, or
    # "target": a KV-only drafter's attention from the target layers whose KV it reads (drafters/target_init.py)
    early_stop_patience: int = (
        0  # stop after this many held-out evaluations without a better acceptance (0 = off)
    )
    early_stop_metric: str = "mat"  # "mat": 1 + sum_k prod_{j<=k} acc_j on the held-out slice; or "acc_0"
    max_seconds: float | None = None  # wall-clock cap on training (then the last evaluation and the save)

    def __post_init__(self):
        if not self.name:  # the block drafter is named by its context: block-kv, block-hidden, block-both
            self.name = (
                f"block-{self.context}" if self.paradigm == "block" else f"{self.paradigm}-{self.regime}"
            )
            if self.target_kv == "zeroed":  # the control does not overwrite the drafter it controls
                self.name += "-zeroed"
        self.adam_betas = tuple(self.adam_betas)
        if self.kv_recency is None:
            self.kv_recency = 32 if self.paradigm == "kv" else 0
        if self.step_decay is None:
            self.step_decay = 0.8 if self.regime != "ttt_dense" else 1.0
        if self.feature_loss_weight is None:
            self.feature_loss_weight = (
                1.0 if self.regime == "ttt_dense" and self.paradigm in READS_HIDDEN else 0.0
            )
        if self.kv_align_weight is None:
            self.kv_align_weight = 1.0 if self.regime == "ttt_dense" else 0.0
        self.validate()

    @property
    def n_train_steps(self) -> int:
        """Unrolled draft steps per training forward."""
        return 1 if self.regime == "tf" else self.ttt_steps

    def as_dict(self) -> dict:
        d = asdict(self)
        d["adam_betas"] = list(self.adam_betas)
        for name, default in ADDED_LATER.items():  # at its default: as the runs saved before it recorded it
            if d[name] == default:
                del d[name]
        return d

    def validate(self) -> None:
        def bad(msg):
            raise TrainConfigError(f"drafter {self.name!r}: {msg}")

        def one_of(name: str, allowed: tuple) -> None:
            if getattr(self, name) not in allowed:
                bad(f"{name} must be one of {allowed}, got {getattr(self, name)!r}.")

        one_of("paradigm", PARADIGMS)
        if self.regime not in REGIMES:
            bad(
                f"regime must be one of {REGIMES} (teacher forcing, training-time test, TTT with dense "
                f"per-position losses, parallel block drafting), got {self.regime!r}."
            )
        one_of("kv_mode", KV_MODES)
        one_of("target_kv", TARGET_KV)
        if self.target_kv != "real" and self.paradigm not in (*READS_KV, "block"):
            bad(
                f"target_kv applies to drafters that read the target's KV {READS_KV}, not to {self.paradigm!r}."
            )
        one_of("kv_softmax", KV_SOFTMAX)
        if (self.fc_norm or self.norm_output) and self.paradigm not in EAGLE31_PARADIGMS:
            bad(
                f"fc_norm and norm_output (EAGLE 3.1) apply to {EAGLE31_PARADIGMS}, not to {self.paradigm!r}."
            )
        one_of("data_source", DATA_SOURCES)
        one_of("early_stop_metric", STOP_METRICS)
        if self.early_stop_patience < 0:
            bad(f"early_stop_patience must be >= 0 (0 = off), got {self.early_stop_patience}.")
        if self.early_stop_patience and not self.eval_every:
            bad("early stopping needs held-out evaluations: set eval_every > 0.")
        if self.max_seconds is not None and not self.max_seconds > 0:
            bad(f"max_seconds must be > 0 (or None), got {self.max_seconds}.")
        if self.init_from == "target" and self.paradigm != "kv":
            bad(
                f"init_from='target' initializes a KV-only drafter's attention; got paradigm {self.paradigm!r}."
            )
        if self.kv_recency < 0:
            bad(f"kv_recency must be >= 0 (0 = no recency bias), got {self.kv_recency}.")
        self._validate_block(bad)
        top = {"kv": 4, "block": 5}.get(self.paradigm, 8)
        if not 1 <= self.n_layers <= top:
            bad(f"n_layers must be in 1..{top} for the {self.paradigm} drafter, got {self.n_layers}.")
        for name in (
            "train_steps",
            "batch_size",
            "ttt_steps",
            "eval_steps",
            "eval_sequences",
            "draft_vocab_size",
        ):
            if getattr(self, name) < 1:
                bad(f"{name} must be >= 1, got {getattr(self, name)}.")
        for name in ("branch_fraction", "eval_branch_fraction"):
            if not 0 < getattr(self, name) <= 1:
                bad(f"{name} must be in (0, 1], got {getattr(self, name)}.")
        if not self.lr > 0:
            bad(f"lr must be > 0, got {self.lr}.")
        if self.max_tokens is not None and self.max_tokens < 2 + self.n_train_steps:
            bad(f"max_tokens={self.max_tokens} is too short for {self.n_train_steps} draft steps.")
        one_of("mixed_precision", PRECISIONS)
        one_of("schedule", SCHEDULES)
        if not 0 < self.decay_fraction < 1:
            bad(f"decay_fraction must be in (0, 1), got {self.decay_fraction}.")
        if self.curve_points < 0 or (self.curve_points and self.schedule != "wsd"):
            bad(
                f"curve_points={self.curve_points}: learning-curve points need schedule='wsd' (a cosine "
                "schedule's intermediate points are not annealed) and a count >= 0."
            )
        if self.plateau_stop < 0 or (self.plateau_stop and (self.schedule != "wsd" or not self.eval_every)):
            bad(
                f"plateau_stop={self.plateau_stop}: training to a plateau needs schedule='wsd' (it ends the stable "
                "phase where acc_0 stops moving) and held-out evaluations (eval_every > 0)."
            )
        if self.plateau_min_steps < 0 or (self.plateau_min_steps and not self.plateau_stop):
            bad(f"plateau_min_steps={self.plateau_min_steps}: a step >= 0, and only with plateau_stop > 0.")
        if self.converge_z < 0 or (self.converge_z and (self.schedule != "wsd" or self.curve_points < 2)):
            bad(
                f"converge_z={self.converge_z}: the convergence rule compares annealed decay branches a doubling "
                "apart, so it needs schedule='wsd' and curve_points >= 2."
            )
        if self.tokens_before < 0:
            bad(
                f"tokens_before={self.tokens_before}: the token-passes the starting weights saw, a count >= 0."
            )
        if not self.answer_start_weight > 0 or self.answer_start_tokens < 1:
            bad(
                f"answer_start_weight={self.answer_start_weight}, answer_start_tokens={self.answer_start_tokens}: "
                "a weight > 0 (1 = every answer token alike) on each answer's first >= 1 tokens."
            )
        if self.curve_points and not self.eval_sequences:
            bad("curve_points needs held-out evaluations (eval_sequences >= 1).")
        for name in ("grad_scale", "lr_scale"):
            d = getattr(self, name)
            unknown = sorted(set(d) - set(GROUPS))
            if unknown:
                bad(f"{name} names unknown parameter groups {unknown}; groups are {GROUPS}.")
            if any(not isinstance(v, (int, float)) or v <= 0 for v in d.values()):
                bad(f"{name} factors must be positive numbers, got {d}.")

    def _validate_block(self, bad) -> None:
        """The block drafter (paradigm ``block``) and its regime ``parallel`` go together."""
        if (self.paradigm == "block") != (self.regime == "parallel"):
            bad(
                f"the block drafter trains under regime 'parallel' only, and 'parallel' trains the block drafter "
                f"only; got paradigm {self.paradigm!r} with regime {self.regime!r}."
            )
        if self.paradigm == "block" and self.context not in BLOCK_CONTEXTS:
            bad(f"the block drafter needs context in {BLOCK_CONTEXTS}, got {self.context!r}.")
        if self.paradigm != "block" and self.context:
            bad(f"context is a block-drafter parameter; the {self.paradigm} drafter has none.")
        if self.regime == "parallel" and (
            self.kv_align_weight or self.feature_loss_weight or self.detach_chain
        ):
            bad(
                "kv_align_weight, feature_loss_weight and detach_chain belong to the unrolled regimes, not to 'parallel'."
            )
        if self.paradigm == "block" and self.kv_recency:
            bad("kv_recency is a KV-only drafter parameter; the block drafter has none.")

    @classmethod
    def from_params(cls, params: dict, defaults: dict | None = None) -> TrainConfig:
        """Build from a notebook-style dict (``params`` over ``defaults``), checking names and types."""
        merged = {**(defaults or {}), **params}
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(merged) - set(known))
        label = merged.get("name") or f"{merged.get('paradigm')}-{merged.get('regime')}"
        if unknown:
            raise TrainConfigError(
                f"drafter {label!r}: unknown parameters {unknown}. Known: {sorted(known)}."
            )
        for req in ("paradigm", "regime"):
            if req not in merged:
                raise TrainConfigError(
                    f"drafter {label!r}: missing {req!r} (one of "
                    f"{PARADIGMS if req == 'paradigm' else REGIMES})."
                )
        for name, value in merged.items():
            _check_type(label, name, value, cls.__dataclass_fields__[name].type)
        return cls(**merged)


def _check_type(label: str, name: str, value, annotation: str) -> None:
    ann = str(annotation)
    ok = True
    if value is None:
        ok = "None" in ann
    elif ann.startswith("int"):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif ann.startswith("float"):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif ann.startswith("str"):
        ok = isinstance(value, str)
    elif ann == "bool":
        ok = isinstance(value, bool)
    elif ann == "dict":
        ok = isinstance(value, dict)
    elif ann.startswith("list") or ann.startswith("tuple"):
        ok = isinstance(value, (list, tuple))
    if not ok:
        raise TrainConfigError(
            f"drafter {label!r}: {name} must be {ann}, got {value!r} ({type(value).__name__})."
        )


def parse_drafter_specs(specs, defaults: dict | None = None) -> list[TrainConfig]:
    """A notebook's ``drafters`` list (dicts over shared ``defaults``) as validated configs with distinct names."""
    if not isinstance(specs, (list, tuple)) or not specs:
        raise TrainConfigError(f"drafters must be a non-empty list of dicts, got {specs!r}.")
    configs = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict):
            raise TrainConfigError(
                f"drafters[{i}] must be a dict like {{'paradigm': 'kv', 'regime': 'ttt'}}, got {spec!r}."
            )
        configs.append(TrainConfig.from_params(spec, defaults))
    names = [c.name for c in configs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise TrainConfigError(f"drafter names {dupes} appear twice; give each a distinct 'name'.")
    return configs
