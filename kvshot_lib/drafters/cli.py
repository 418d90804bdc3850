"""``kvshot export``: a trained hidden drafter in the EAGLE-3 layout that vLLM, SGLang and speculators load
(:mod:`.eagle3_format`). The drafter's config is read, and refused if it has no such layout, before the target loads;
so is an ``--out`` that would destroy something: the drafter's own folder or one holding it (always), a folder
with files in it (without ``--force``), a file.

    kvshot export --drafter runs/onpolicy/drafters/hidden31-ttt --format eagle3 --out exported/hidden31-ttt
"""

from __future__ import annotations

from ..user_errors import UsageError
from .checkpoint import check_weights, load_drafter, read_config
from .eagle3_format import ARCHITECTURE, export_eagle3, exportable
from .output_folder import check_output_folder


def add_cli(sub) -> None:
    p = sub.add_parser(
        "export", help="write a trained hidden drafter in the EAGLE-3 layout that vLLM/SGLang load"
    )
    p.add_argument(
        "--drafter", required=True, help="a trained drafter folder (runs/<profile>/drafters/<name>)"
    )
    p.add_argument("--format", default="eagle3", choices=["eagle3"], help="the layout to write")
    p.add_argument(
        "--out",
        required=True,
        help="the folder to write (config.json, model.safetensors): new or empty, never the drafter's own",
    )
    p.add_argument("--force", action="store_true", help="replace --out whole when it already holds files")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=_cli_export)


def _cli_export(args) -> int:
    from ..target import load_target

    # checked before the target loads: an --out that would destroy something, a KV or hybrid drafter, bad files
    out = check_output_folder(args.out, source=args.drafter, force=args.force)
    try:
        cfg = read_config(args.drafter)
        check_weights(args.drafter)
    except FileNotFoundError as e:
        raise UsageError(f"--drafter {args.drafter}: {e}") from None
    exportable(cfg)
    target = load_target(cfg.target_name, device=args.device, dtype="float32")
    out = export_eagle3(load_drafter(args.drafter, target), target, out, force=args.force)
    print(
        f"wrote {out} ({ARCHITECTURE}, draft vocabulary {cfg.draft_vocab_size}, fc_norm={cfg.fc_norm}, "
        f"norm_output={cfg.norm_output}); serve it with vLLM's speculative_config "
        f"{{'method': 'eagle3', 'model': '{out}'}}"
    )
    return 0
