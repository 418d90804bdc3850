"""``kvshot train``: train one drafter from the command line, on one device or under ``accelerate launch``.

    kvshot train --paradigm kv --regime ttt --set kv_mode='"linear_rope"' --set train_steps=300 \\
        --out runs/default/drafters/kv-ttt
    accelerate launch --multi_gpu --num_processes 4 -m kvshot_lib.cli train --target Qwen/Qwen3-8B ...

It tokenizes the ShareGPT slices, extracts (or reuses) the feature stores with the target, and calls
:func:`kvshot_lib.training.train_drafter`. Under ``accelerate launch`` the main process extracts first and
the others reuse its store; every process then loads the target on its own device.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..drafters.config import PARADIGMS, REGIMES
from ..user_errors import UsageError


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("train", help="train one drafter (paradigm x regime) on the feature store")
    p.add_argument("--target", default="smollm2-135m", help="preset, Hugging Face id or local path")
    p.add_argument("--paradigm", required=True, choices=PARADIGMS)
    p.add_argument("--regime", required=True, choices=REGIMES)
    p.add_argument("--out", required=True, help="checkpoint folder, e.g. runs/default/drafters/kv-ttt")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="any training parameter, value in JSON: --set train_steps=300 --set kv_mode='\"linear\"'",
    )
    p.add_argument("--config", help="a JSON file of training parameters (--set overrides it)")
    p.add_argument("--n-train-conversations", type=int, default=300)
    p.add_argument("--n-eval-conversations", type=int, default=40)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0, help="data split seed and training seed")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-in-4bit", action="store_true")
    p.add_argument("--no-resume", action="store_true", help="start over even if a state or checkpoint exists")
    p.set_defaults(func=run)


def parse_sets(items: list[str]) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise UsageError(f"--set expects KEY=JSON, got {item!r}.")
        key, raw = item.split("=", 1)
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw  # a bare string
    return out


def read_config_file(path: str) -> dict:
    """The training parameters of a ``--config`` JSON file (an object), or a one-line error."""
    try:
        params = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"--config {path}: {e}; pass a JSON file of training parameters.") from None
    except UnicodeDecodeError as e:
        raise UsageError(
            f"--config {path} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8 JSON."
        ) from None
    if not isinstance(params, dict):
        raise UsageError(f"--config {path} must hold a JSON object of training parameters.")
    return params


def run(args) -> int:
    from ..corpus import extract_features, tokenize_sharegpt
    from ..target import load_target
    from .config import TrainConfig
    from .loop import make_accelerator, train_drafter

    params = read_config_file(args.config) if args.config else {}
    params.update(parse_sets(args.set))
    params.update(paradigm=args.paradigm, regime=args.regime)
    params.setdefault("seed", args.seed)
    params.setdefault("name", Path(args.out).name)
    cfg = TrainConfig.from_params(params)  # fail before any long work (kvshot: one line, see cli.py)
    acc = make_accelerator(cfg, "cpu" if args.device == "cpu" else "auto")
    device = str(acc.device) if args.device == "auto" else args.device
    target = load_target(args.target, device=device, dtype=args.dtype, load_in_4bit=args.load_in_4bit)
    with acc.main_process_first():
        train = tokenize_sharegpt(
            target.tokenizer, "train", args.n_train_conversations, args.max_len, seed=args.seed
        )
        held = tokenize_sharegpt(
            target.tokenizer, "eval", args.n_eval_conversations, args.max_len, seed=args.seed
        )
        train_store, eval_store = extract_features(target, train), extract_features(target, held)
    result = train_drafter(
        target, train_store, eval_store, cfg, args.out, resume=not args.no_resume, accelerator=acc
    )
    if acc.is_main_process:
        final = result.final_eval()
        steps = sorted(k for k in final if k.startswith("acc_"))
        print(
            f"{cfg.name}: {result.train_seconds:.0f} s; held-out per-step accuracy "
            + " ".join(f"{final[k]:.3f}" for k in steps)
            + f"; checkpoint in {args.out}"
        )
    return 0
