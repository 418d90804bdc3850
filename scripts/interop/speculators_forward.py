"""Run an exported EAGLE-3 folder through vLLM's ``speculators`` (its converter, then its own EAGLE-3 model) and save
the first draft step's logits; run with ``.venv-serve/bin/python`` (``make interop-env``), which has speculators.

    .venv-serve/bin/python scripts/interop/speculators_forward.py EXPORT_DIR TARGET_DIR INPUTS OUT

INPUTS is a safetensors file with ``hidden`` ``[1, N, 3H]`` (the target's captured states of positions 0..N-1) and
``input_ids`` ``[1, N]`` (the tokens of positions 1..N, EAGLE-3's pairing); OUT gets ``logits`` ``[N, V_draft]``.
``tests/test_eagle3_format.py`` compares them with the suite's own drafter.
"""

import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from speculators.convert.eagle.eagle3_converter import Eagle3Converter
from speculators.models.eagle3 import Eagle3DraftModel


def main(export_dir: str, target_dir: str, inputs: str, out: str) -> None:
    cfg = json.loads((Path(export_dir) / "config.json").read_text())
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    with tempfile.TemporaryDirectory() as conv:
        Eagle3Converter().convert(
            export_dir, conv, base_model=target_dir, validate=False, eagle_aux_hidden_state_layer_ids=ids
        )
        conf = json.loads((Path(conv) / "config.json").read_text())
        conf["transformer_layer_config"]["_attn_implementation"] = "eager"
        (Path(conv) / "config.json").write_text(json.dumps(conf))
        model = Eagle3DraftModel.from_pretrained(conv).float().eval()
    exported = load_file(str(Path(export_dir) / "model.safetensors"))
    for i, norm in enumerate(
        model.fc_norm or []
    ):  # speculators 0.9.0's converter drops fc_norm.* (EAGLE 3.1)
        norm.weight.data.copy_(exported[f"fc_norm.{i}.weight"])  # with a warning: its legacy class has none
    if not model.embed_tokens.weight.any():  # left at zero for a target with tied embeddings (SmolLM2): the
        target = load_file(
            str(Path(target_dir) / "model.safetensors")
        )  # engines share the target's, so do we
        model.embed_tokens.weight.data.copy_(target["model.embed_tokens.weight"])
    x = load_file(inputs)
    seen = []
    model.lm_head.register_forward_hook(lambda m, a, o: seen.append(o.detach()))
    n = x["input_ids"].shape[1]
    with torch.no_grad():
        model(
            hidden_states=x["hidden"].float(),
            input_ids=x["input_ids"].long(),
            document_ids=torch.zeros(1, n, dtype=torch.long),
            ttt_steps=1,
        )
    save_file({"logits": seen[0][0].contiguous()}, out)
    print(
        json.dumps(
            {
                "speculators": __import__("importlib.metadata").metadata.version("speculators"),
                "steps": len(seen),
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:5])
