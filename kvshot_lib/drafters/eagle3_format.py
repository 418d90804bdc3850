"""The EAGLE-3 checkpoint layout that EAGLE, SpecForge, speculators, SGLang and vLLM share: out and in.

The suite's hidden drafter *is* an EAGLE-3 drafter (``hidden.py``), so the two layouts differ in names, in the
``d2t`` convention and in the config, not in the arithmetic. Layer 0 of both computes, from the fused feature
``f = fc(features)`` and the embedding ``e`` of the next token,

    ``h = f + attn([norm_in(e), norm_hidden(f)])``, ``out = h + mlp(norm_post(h))``, logits ``= lm_head(norm(out))``

(vLLM's ``llama_eagle3.py`` with ``norm_before_residual: false``: the residual is the raw feature), and a deeper
draft step reads ``out`` (or ``norm(out)`` with EAGLE 3.1's ``norm_output``). Two conventions differ and are
converted here:

* **Layer ids.** The suite's hidden layer ``l`` is the output of decoder layer ``l`` (``hidden_states[l + 1]``);
  ``eagle_aux_hidden_state_layer_ids`` count the embedding as 0, so they are ``l + 1`` (vLLM collects the state
  after layer ``idx`` under ``idx + 1``; its default ``(2, L/2, L-3)`` is EAGLE-3's ``(1, L/2-1, L-4)``).
* **Positions.** The suite gives draft row ``t`` (feature of ``t``, token ``t+1``) position ``t+1``; vLLM gives it
  ``t``. RoPE scores depend only on differences, so the logits are the same.
* **The vocabulary.** ``d2t`` is stored as offsets (target id = draft id + ``d2t[draft id]``), with ``t2d`` a bool
  mask over the target vocabulary; the suite keeps target ids.

What is written (:func:`export_eagle3`), into a new or empty folder (one with files needs ``force``), beside it
first and then swapped in (:mod:`.output_folder`): ``config.json`` (``LlamaForCausalLMEagle3``) and ``model.safetensors``
with ``fc.weight``, ``fc_norm.{i}.weight`` (3.1), ``midlayer.*``, ``norm.weight``, ``lm_head.weight`` (the
target's LM-head rows of the draft vocabulary: the suite trains none of its own), ``d2t`` and ``t2d``; no
``embed_tokens`` (the engines then share the target's, as the suite does). Only one-layer hidden drafters have
this layout: the KV and hybrid drafters read the target's KV cache, which no serving format carries.

What is read (:func:`load_eagle3`): such a folder, ``midlayer.`` or ``layers.0.``, with its own ``lm_head`` and, if
present, its own ``embed_tokens``; a variant whose arithmetic differs (``norm_before_residual``,
``norm_before_fc``, biases, several layers) is refused by name. ``tests/test_eagle3_format.py`` holds the round
trip (identical draft logits) and the check against speculators' own EAGLE-3 model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..target import Target
from ..user_errors import UsageError
from .config import DrafterConfig, DrafterConfigError, DrafterTargetMismatch, drafter_config_for
from .hidden import HiddenDrafter
from .output_folder import check_output_folder, mode_like, replacing_folder
from .vocab import vocab_hash

ARCHITECTURE = "LlamaForCausalLMEagle3"
# suite name -> EAGLE-3 name, for the one decoder layer (prefix "layers.0." -> "midlayer.")
LAYER_NAMES = {
    "emb_norm.weight": "input_layernorm.weight",
    "feat_norm.weight": "hidden_norm.weight",
    "post_norm.weight": "post_attention_layernorm.weight",
    **{f"self_attn.{p}_proj.weight": f"self_attn.{p}_proj.weight" for p in "qkvo"},
    **{f"mlp.{p}_proj.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
}


def is_eagle3_folder(path: str | Path) -> bool:
    """Whether ``path`` holds an EAGLE-3 checkpoint in the shared layout (rather than a suite checkpoint)."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        raw = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(raw, dict) and ARCHITECTURE in (raw.get("architectures") or [])


def exportable(cfg: DrafterConfig) -> None:
    """Raise a clear error unless the drafter of ``cfg`` has an EAGLE-3 layout."""
    if cfg.paradigm != "hidden":
        raise DrafterConfigError(
            f"the {cfg.paradigm} drafter has no EAGLE-3 layout: it reads the target's KV cache (or nothing of the "
            "target), and no serving engine or format carries that. Only hidden drafters export."
        )
    if cfg.n_layers != 1:
        raise DrafterConfigError(
            f"the drafter has {cfg.n_layers} layers; the EAGLE-3 layout written here has one (midlayer)."
        )


def export_eagle3(drafter: HiddenDrafter, target: Target, out: str | Path, force: bool = False) -> Path:
    """Write ``drafter`` (a one-layer hidden drafter) in the EAGLE-3 layout as the folder ``out``; returns ``out``.

    ``out`` must be new or empty, unless ``force``: then the folder is replaced whole. Either way the files are
    written beside it and swapped in, so an interrupted export leaves the old folder or the new one."""
    cfg = drafter.cfg
    exportable(cfg)
    out = check_output_folder(out, force=force)
    state = {k: v.detach().float().cpu() for k, v in drafter.state_dict().items()}
    tensors = {"fc.weight": state["fc.weight"], "norm.weight": state["final_norm.weight"]}
    for i in range(len(cfg.hidden_layers) if cfg.fc_norm else 0):
        tensors[f"fc_norm.{i}.weight"] = state[f"fc_norms.{i}.weight"]
    for ours, theirs in LAYER_NAMES.items():
        tensors[f"midlayer.{theirs}"] = state[f"layers.0.{ours}"]
    d2t = drafter.d2t.long().cpu()  # [V_draft] target ids
    tensors["lm_head.weight"] = drafter.head.float().cpu()  # [V_draft, H]
    tensors["d2t"] = d2t - torch.arange(d2t.numel())  # offsets
    t2d = torch.zeros(cfg.target_vocab_size, dtype=torch.bool)
    t2d[d2t] = True
    tensors["t2d"] = t2d
    with replacing_folder(out) as folder:
        (folder / "config.json").write_text(json.dumps(eagle3_config(cfg, target), indent=1))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
        mode_like(folder / "config.json", [folder / "model.safetensors"])  # not safetensors' own 0600
    return out


def eagle3_config(cfg: DrafterConfig, target: Target) -> dict:
    """The ``config.json`` of the EAGLE-3 layout for a hidden drafter of ``cfg`` over ``target``."""
    tc = target.model.config
    rope = getattr(tc, "rope_parameters", None) or {"rope_theta": getattr(tc, "rope_theta", 10000.0)}
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": int(tc.max_position_embeddings),
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "rope_parameters": dict(rope),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": cfg.target_vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "norm_before_residual": False,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [layer + 1 for layer in cfg.hidden_layers]},
        # the suite's own record of the target, checked on import (the engines ignore unknown keys)
        "kvshot": {
            "target_name": cfg.target_name,
            "target_fingerprint": cfg.target_fingerprint,
            "name": cfg.name,
            "regime": cfg.regime,
        },
    }


def load_eagle3(path: str | Path, target: Target, dtype: torch.dtype | None = None) -> HiddenDrafter:
    """An EAGLE-3 folder as a suite hidden drafter over ``target`` (same decode contract, notebooks, ``bench``)."""
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    _check_variant(raw, path)
    info = target.info
    layers = [
        int(x) - 1 for x in (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []
    ]
    layers = layers or list(info.default_hidden_layers())
    mine = raw.get("kvshot") or {}
    if mine.get("target_fingerprint") not in (None, info.fingerprint):
        raise DrafterTargetMismatch(
            f"the EAGLE-3 drafter at {path} was exported for target {mine.get('target_name')!r} (fingerprint "
            f"{mine['target_fingerprint']}), not {info.name!r} ({info.fingerprint}). Load the target it was trained for."
        )
    for key, want in (
        ("target_hidden_size", info.hidden_size),
        ("hidden_size", info.hidden_size),
        ("vocab_size", info.vocab_size),
    ):
        if int(raw.get(key, want)) != want:
            raise DrafterTargetMismatch(
                f"the EAGLE-3 drafter at {path} has {key}={raw.get(key)}, but target {info.name!r} has {want}: it "
                "was trained for another target. Load that target, or a drafter trained for this one."
            )
    try:
        state = load_file(str(path / "model.safetensors")) if (path / "model.safetensors").is_file() else {}
    except SafetensorError as e:
        raise UsageError(
            f"{path / 'model.safetensors'} is damaged or not a safetensors file ({e}); export or download it again."
        ) from None
    if not state:
        raise FileNotFoundError(f"{path} has no model.safetensors (EAGLE-3 weights).")
    state = {k.replace("layers.0.", "midlayer.", 1): v for k, v in state.items()}
    V = int(raw.get("draft_vocab_size") or raw["vocab_size"])
    d2t = state["d2t"].long() + torch.arange(V) if "d2t" in state else torch.arange(V)  # target ids
    cfg = drafter_config_for(
        target,
        "hidden",
        hidden_layers=layers,
        draft_vocab_size=V,
        name=mine.get("name") or path.name,
        regime=mine.get("regime", ""),
        fc_norm=bool(raw.get("fc_norm", False)),
        norm_output=bool(raw.get("norm_output", False)),
    )
    _check_shapes(raw, cfg, path)
    cfg.vocab_hash = vocab_hash(d2t)
    drafter = HiddenDrafter(cfg, target, d2t).to(target.model.model.embed_tokens.weight.device)
    ours = {"fc.weight": state["fc.weight"], "final_norm.weight": state["norm.weight"]}
    for i in range(len(layers) if cfg.fc_norm else 0):
        ours[f"fc_norms.{i}.weight"] = state[f"fc_norm.{i}.weight"]
    for mine_name, theirs in LAYER_NAMES.items():
        ours[f"layers.0.{mine_name}"] = state[f"midlayer.{theirs}"]
    dev = drafter.head.device
    missing = drafter.load_state_dict({k: v.float().to(dev) for k, v in ours.items()}, strict=False)
    left = [k for k in missing.missing_keys if k not in ("d2t", "target_probe")]
    if left or missing.unexpected_keys:
        raise DrafterConfigError(f"{path}: weights do not fit an EAGLE-3 layer: missing {left}.")
    if "lm_head.weight" in state:  # a public drafter's own trained head
        drafter.head = state["lm_head.weight"].float().to(dev)
    if "embed_tokens.weight" in state:  # its own embedding, where it ships one
        drafter._frozen.embed_weight = state["embed_tokens.weight"].to(dev)
    drafter.eval()
    return drafter if dtype is None else drafter.to(dtype)


def _check_variant(raw: dict, path: Path) -> None:
    if ARCHITECTURE not in (raw.get("architectures") or []):
        raise DrafterConfigError(
            f"{path}/config.json is not an EAGLE-3 config (architectures: {ARCHITECTURE})."
        )
    ec = raw.get("eagle_config") or {}
    for key in ("norm_before_residual", "norm_before_fc", "attention_bias", "mlp_bias"):
        if raw.get(key) or ec.get(key):
            raise DrafterConfigError(
                f"{path}: {key}=true changes the EAGLE-3 layer's arithmetic, and the suite's hidden drafter computes "
                "the plain variant only; this checkpoint cannot be measured here as it is."
            )
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise DrafterConfigError(f"{path}: {raw['num_hidden_layers']} decoder layers; the suite reads one.")


def _check_shapes(raw: dict, cfg: DrafterConfig, path: Path) -> None:
    for key, want in (
        ("num_attention_heads", cfg.n_heads),
        ("num_key_value_heads", cfg.n_kv_heads),
        ("intermediate_size", cfg.intermediate_size),
    ):
        if key in raw and int(raw[key]) != want:
            raise DrafterConfigError(
                f"{path}: {key}={raw[key]}, but the suite's hidden drafter for this target has {want}; a drafter "
                "with other widths than its target's cannot be loaded here."
            )
