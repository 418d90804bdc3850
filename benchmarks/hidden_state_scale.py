"""How large are the target hidden states an EAGLE-3 drafter fuses, layer by layer?

EAGLE-3 concatenates three of the target's layers and projects them with one ``fc``; EAGLE 3.1's ``fc_norm``
RMS-normalizes each layer first. Where the layers' scales differ by orders of magnitude, or one dimension holds
most of a layer's energy (a "massive activation"), ``fc`` without the norms sees mostly that. This measures, on
the on-policy run's held-out conversations (the target's own answers, float32), per fused layer: the RMS over all
entries, the largest magnitude, and the share of the layer's energy (mean square) held by its largest dimension.
Prints and saves ``benchmarks/results/hidden_state_scale.json``:

    python benchmarks/hidden_state_scale.py [--n-conversations 16]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvshot_lib.drafters import drafter_config_for
from kvshot_lib.reference import data, load_plan
from kvshot_lib.target import forward as target_forward
from kvshot_lib.target import load_target

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-conversations", type=int, default=16, help="held-out conversations read")
    args = ap.parse_args()
    plan = load_plan("onpolicy")
    target = load_target(plan.target, device="cpu", dtype="float32")
    _, held, what = data.data_splits(plan, target, "regenerated")
    layers = drafter_config_for(target, "hidden", draft_vocab_size=4096).hidden_layers
    energy = {layer: torch.zeros(target.info.hidden_size, dtype=torch.float64) for layer in layers}
    peak, tokens = dict.fromkeys(layers, 0.0), 0
    with torch.no_grad():
        for ids in held.ids[: args.n_conversations]:
            feats = target_forward.sequence_features(
                target.model, torch.as_tensor(ids)[None], hidden_layers=layers
            )
            for layer in layers:
                h = feats.hidden[layer][0].double()  # [T, H]
                energy[layer] += h.pow(2).sum(0)
                peak[layer] = max(peak[layer], float(h.abs().max()))
            tokens += len(ids)
    rows = []
    for layer in layers:
        e = energy[layer] / tokens  # mean square per dimension
        rows.append(
            dict(
                layer=layer,
                rms=round(float(e.mean().sqrt()), 3),
                max_abs=round(peak[layer], 1),
                largest_dim=int(e.argmax()),
                largest_dim_energy_share=round(float(e.max() / e.sum()), 4),
            )
        )
        print(rows[-1])
    out = dict(
        target=target.info.name,
        precision="fp32",
        data=f"on-policy held-out, {what}: first {args.n_conversations} conversations, {tokens:,} tokens",
        layers=rows,
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hidden_state_scale.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
