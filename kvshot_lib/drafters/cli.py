"""``kvshot export``: a trained hidden drafter in the EAGLE-3 layout that vLLM, SGLang and speculators load
(:mod:`.eagle3_format`). The drafter's config is read, and refused if it has no such layout, before the target loads.

    kvshot export --drafter runs/onpolicy/drafters/hidden31-ttt --format eagle3 --out exported/hidden31-ttt
"""

from __future__ import annotations

from .checkpoint import load_drafter, read_config
from .eagle3_format import ARCHITECTURE, export_eagle3, exportable


def add_cli(sub) -> None:
    p = sub.add_parser(
        "export", help="write a trained hidden drafter in the EAGLE-3 layout that vLLM/SGLang load"
    )
    p.add_argument(
        "--drafter", required=True, help="a trained drafter folder (runs/<profile>/drafters/<name>)"
    )
    p.add_argument("--format", default="eagle3", choices=["eagle3"], help="the layout to write")
    p.add_argument("--out", required=True, help="the folder to write (config.json, model.safetensors)")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=_cli_export)


def _cli_export(args) -> int:
    from ..target import load_target

    cfg = read_config(args.drafter)  # checked before the target loads: a KV or hybrid drafter stops here
    exportable(cfg)
    target = load_target(cfg.target_name, device=args.device, dtype="float32")
    out = export_eagle3(load_drafter(args.drafter, target), target, args.out)
    print(
        f"wrote {out} ({ARCHITECTURE}, draft vocabulary {cfg.draft_vocab_size}, fc_norm={cfg.fc_norm}, "
        f"norm_output={cfg.norm_output}); serve it with vLLM's speculative_config "
        f"{{'method': 'eagle3', 'model': '{out}'}}"
    )
    return 0
