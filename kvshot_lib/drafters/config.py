"""The drafter configuration: one dataclass for every paradigm, stored as JSON next to the weights.

The config holds the architecture (paradigm, depth, KV injection mode, widths), the target it was built
for (name, architecture fingerprint, layers it reads, vocabulary size) and the draft vocabulary's size
and hash. :func:`drafter_config_for` fills the widths from a target; :meth:`DrafterConfig.check_target`
refuses a target the drafter was not built for.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields

from ..target import Target

PARADIGMS = ("hidden", "kv", "hybrid", "none", "cross", "block")
# "none": the no-target control (a tiny LM over the prefix; reads nothing of the target but its embedding and
# LM head); "cross": the hybrid's cross-attention path on the target's KV without its self-attention path.
READS_HIDDEN = ("hidden", "hybrid", "cross")  # paradigms that fuse the target's hidden states
READS_KV = ("kv", "hybrid", "cross")  # paradigms that read the target's KV cache
EAGLE31_PARADIGMS = ("hidden", "hybrid")  # paradigms with EAGLE 3.1's switches: fc_norm, norm_output
OWN_CONTEXT = ("hidden", "hybrid", "none")  # paradigms with their own K/V over every context position
# "block": the parallel block drafter (DFlash-style; drafters/block.py), trained by "parallel"
BLOCK_CONTEXTS = ("kv", "hidden", "both")  # what of the target a block drafter reads
KV_MODES = ("concat", "linear", "linear_rope")
REGIMES = ("tf", "ttt", "ttt_dense", "parallel")  # parallel: the block drafter's own regime
TARGET_KV = ("real", "zeroed")  # what a KV-reading drafter is given: the target's K/V, or zeros (a control)
KV_SOFTMAX = ("shared", "separate")  # KV-only: target and own K/V in one softmax, or one softmax each
FORMAT = "kvshot-drafter/1"


class DrafterConfigError(ValueError):
    """A drafter configuration (or parameter dict) is invalid; the message says which field and why."""


class DrafterTargetMismatch(ValueError):
    """A drafter is being used with a target other than the one it was trained for."""


@dataclass
class DrafterConfig:
    paradigm: str  # "hidden" | "kv" | "hybrid" | "none" (no-target control) | "cross" (cross-only) | "block"
    n_layers: int
    hidden_size: int
    intermediate_size: int
    n_heads: int  # self-attention query heads (hidden, hybrid)
    n_kv_heads: int  # self-attention KV heads (hidden, hybrid)
    head_dim: int
    kv_mode: str  # target-KV injection (kv, hybrid): "concat" | "linear" | "linear_rope"
    hidden_layers: tuple[int, ...]  # target layers fused by fc (hidden, hybrid); () for kv
    kv_layers: tuple[int, ...]  # target layers whose KV is read (kv, hybrid); () for hidden
    target_n_kv_heads: int
    target_head_dim: int
    query_group: int  # queries per injected KV head (kv, hybrid cross-attention)
    draft_vocab_size: int
    rms_norm_eps: float
    target_name: str
    target_fingerprint: str
    target_vocab_size: int
    target_n_layers: int
    kv_recency: int = 0  # KV-only: window W of the learned recency bias on target-KV scores (0 = none)
    target_kv: str = "real"  # KV-reading drafters: "real", or "zeroed" (the control: every target K/V is 0)
    kv_softmax: str = "shared"  # KV-only: one softmax over target + own K/V ("shared"), or one each
    context: str = ""  # block drafter: "kv" | "hidden" | "both" (what of the target it reads); "" otherwise
    block_size: int = 0  # block drafter: K, the tokens one forward drafts; 0 otherwise
    fc_norm: bool = False  # EAGLE 3.1: one RMSNorm per fused target layer, before fc
    norm_output: bool = False  # EAGLE 3.1: deeper steps are fed the previous output after the final norm
    vocab_hash: str = ""
    name: str = ""
    regime: str = ""
    format: str = FORMAT
    extra: dict = field(default_factory=dict)  # training metadata (steps, data, seed, times)

    def __post_init__(self):
        self.hidden_layers = tuple(int(x) for x in self.hidden_layers)
        self.kv_layers = tuple(int(x) for x in self.kv_layers)
        self.validate()

    @property
    def uses_hidden(self) -> bool:
        return self.paradigm in READS_HIDDEN or self.context in ("hidden", "both")

    @property
    def uses_target_kv(self) -> bool:
        return self.paradigm in READS_KV or self.context in ("kv", "both")

    @property
    def own_context(self) -> bool:
        """Whether the drafter keeps its own K/V for every context position (hidden, hybrid, no-target)."""
        return self.paradigm in OWN_CONTEXT

    @property
    def n_injected_heads(self) -> int:
        """KV heads of the injected target KV: every chosen layer's heads side by side."""
        return len(self.kv_layers) * self.target_n_kv_heads

    def validate(self) -> None:
        def bad(msg: str):
            raise DrafterConfigError(msg)

        if self.format != FORMAT:
            bad(f"format {self.format!r} is not {FORMAT!r}; this checkpoint was written by another version.")
        if self.paradigm not in PARADIGMS:
            bad(f"paradigm must be one of {PARADIGMS}, got {self.paradigm!r}.")
        if self.regime and self.regime not in REGIMES:
            bad(f"regime must be one of {REGIMES}, got {self.regime!r}.")
        if self.kv_mode not in KV_MODES:
            bad(f"kv_mode must be one of {KV_MODES}, got {self.kv_mode!r}.")
        if self.target_kv not in TARGET_KV:
            bad(f"target_kv must be one of {TARGET_KV}, got {self.target_kv!r}.")
        if self.kv_softmax not in KV_SOFTMAX:
            bad(f"kv_softmax must be one of {KV_SOFTMAX}, got {self.kv_softmax!r}.")
        top = {"kv": 4, "block": 5}.get(self.paradigm, 8)
        if self.paradigm == "block" and (self.context not in BLOCK_CONTEXTS or self.block_size < 1):
            bad(
                f"the block drafter needs context in {BLOCK_CONTEXTS} and block_size >= 1, got "
                f"context={self.context!r}, block_size={self.block_size!r}."
            )
        if self.paradigm != "block" and (self.context or self.block_size):
            bad(f"context and block_size belong to the block drafter, not to the {self.paradigm} drafter.")
        if not isinstance(self.n_layers, int) or not 1 <= self.n_layers <= top:
            bad(
                f"n_layers must be an integer in 1..{top} for the {self.paradigm} drafter, got {self.n_layers!r}."
            )
        if self.uses_hidden and not self.hidden_layers:
            bad(f"the {self.paradigm} drafter needs hidden_layers (target layers to fuse).")
        if self.uses_target_kv and not self.kv_layers:
            bad(f"the {self.paradigm} drafter needs kv_layers (target layers whose KV it reads).")
        if (self.hidden_layers and not self.uses_hidden) or (self.kv_layers and not self.uses_target_kv):
            bad(f"the {self.paradigm} drafter reads no target layers of that kind; leave them empty.")
        for name in ("hidden_layers", "kv_layers"):
            layers = getattr(self, name)
            if any(not 0 <= x < self.target_n_layers for x in layers):
                bad(
                    f"{name}={list(layers)} must lie in 0..{self.target_n_layers - 1} (the target's decoder layers)."
                )
        if (self.fc_norm or self.norm_output) and self.paradigm not in EAGLE31_PARADIGMS:
            bad(
                f"fc_norm and norm_output (EAGLE 3.1) apply to {EAGLE31_PARADIGMS}, not to {self.paradigm!r}."
            )
        if not 1 <= self.draft_vocab_size <= self.target_vocab_size:
            bad(f"draft_vocab_size must be in 1..{self.target_vocab_size}, got {self.draft_vocab_size}.")

    def as_dict(self) -> dict:
        d = asdict(self)
        d["hidden_layers"], d["kv_layers"] = list(self.hidden_layers), list(self.kv_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DrafterConfig:
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        missing = sorted(required - set(d))
        if missing:
            raise DrafterConfigError(f"drafter config lacks {missing}; it is not a {FORMAT} config.")
        unknown = sorted(set(d) - names)
        if unknown:
            raise DrafterConfigError(f"drafter config has unknown fields {unknown}.")
        return cls(**d)

    def check_target(self, info, where: str = "this drafter") -> None:
        """Raise :class:`DrafterTargetMismatch` unless ``info`` (a TargetInfo) is the target of this config."""
        if info.fingerprint != self.target_fingerprint or info.vocab_size != self.target_vocab_size:
            raise DrafterTargetMismatch(
                f"{where} was trained for target {self.target_name!r} (architecture fingerprint "
                f"{self.target_fingerprint}, vocab {self.target_vocab_size}), but the target passed is {info.name!r} "
                f"(fingerprint {info.fingerprint}, vocab {info.vocab_size}). Load the matching target, e.g. "
                f"load_target({self.target_name!r}), or train a drafter for {info.name!r}."
            )


def drafter_config_for(
    target: Target,
    paradigm: str,
    n_layers: int = 1,
    kv_mode: str = "concat",
    hidden_layers=None,
    kv_layers=None,
    draft_vocab_size: int = 8192,
    query_group: int | None = None,
    name: str = "",
    regime: str = "",
    kv_recency: int = 0,
    target_kv: str = "real",
    kv_softmax: str = "shared",
    context: str = "",
    block_size: int = 0,
    fc_norm: bool = False,
    norm_output: bool = False,
) -> DrafterConfig:
    """A drafter config whose widths follow the target's (as EAGLE-3 does). ``target`` is a loaded Target."""
    info = target.info
    if paradigm not in PARADIGMS:
        raise DrafterConfigError(f"paradigm must be one of {PARADIGMS}, got {paradigm!r}.")
    default_layers = tuple(info.default_hidden_layers())
    hidden_layers = tuple(hidden_layers or default_layers) if paradigm in (*READS_HIDDEN, "block") else ()
    kv_layers = tuple(kv_layers or default_layers) if paradigm in (*READS_KV, "block") else ()
    if paradigm == "block":  # it reads what its context names
        hidden_layers = hidden_layers if context in ("hidden", "both") else ()
        kv_layers = kv_layers if context in ("kv", "both") else ()
    return DrafterConfig(
        paradigm=paradigm,
        n_layers=n_layers,
        hidden_size=info.hidden_size,
        intermediate_size=int(target.model.config.intermediate_size),
        n_heads=info.n_heads,
        n_kv_heads=info.n_kv_heads,
        head_dim=info.head_dim,
        kv_mode=kv_mode,
        hidden_layers=hidden_layers,
        kv_layers=kv_layers,
        target_n_kv_heads=info.n_kv_heads,
        target_head_dim=info.head_dim,
        query_group=query_group or max(1, info.n_heads // info.n_kv_heads),
        draft_vocab_size=min(draft_vocab_size, info.vocab_size),
        rms_norm_eps=1e-5,
        target_name=info.name,
        target_fingerprint=info.fingerprint,
        target_vocab_size=info.vocab_size,
        target_n_layers=info.n_layers,
        kv_recency=kv_recency if paradigm == "kv" else 0,
        target_kv=target_kv,
        kv_softmax=kv_softmax,
        context=context,
        block_size=block_size,
        fc_norm=fc_norm,
        norm_output=norm_output,
        name=name,
        regime=regime,
    )
