"""``python -m kvshot_lib.reference``: the reference run on this machine (:func:`~.run.run_reference`).

    python -m kvshot_lib.reference                                       # every step, every row, resumable
    python -m kvshot_lib.reference --steps train --rows none-ttt,hidden-ttt
    python -m kvshot_lib.reference --steps eval,notebooks                # MT-bench and notebook 04 on what trained
    python -m kvshot_lib.reference --smoke                               # the whole path on a tiny target, seconds
    python -m kvshot_lib.reference --status                              # where each row stands (while it runs)
    python -m kvshot_lib.reference --rows none-ttt --set train_steps=20  # a TrainConfig override for every row
    python -m kvshot_lib.reference --data n_train_conversations=16 --data min_train_tokens=0   # a smaller slice
    python -m kvshot_lib.reference --profile onpolicy --budget token_passes=2200000   # stage 1: every row to 2.2M
    python -m kvshot_lib.reference --profile onpolicy --steps heldout   # its rows and the reference's on both sets

Arguments are checked before anything is loaded: an unknown profile, step or row, CUDA asked for but absent.
A killed run started again with the same arguments resumes each row at its last saved step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from .plan import PlanError, load_plan
from .run import STEPS, run_reference


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvshot_lib.reference", description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="reference", help="a profile with a 'reference' section")
    ap.add_argument("--smoke", action="store_true", help="the profile's smoke overrides (tiny target, CPU)")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of {','.join(STEPS)}")
    ap.add_argument(
        "--rows", default=None, help="comma-separated rows (default: every row; eval: the plan's)"
    )
    ap.add_argument("--device", default=None, help="default: the profile's (auto: CUDA if there is one)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a TrainConfig override")
    ap.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a data override (n_train_conversations=16)",
    )
    ap.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a budget override (token_passes=2200000: every row's cap)",
    )
    ap.add_argument(
        "--root", default=None, help="where runs/ and figures/ are written (default: this checkout)"
    )
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--status", action="store_true", help="print where each row stands, then exit")
    args = ap.parse_args(argv)
    try:
        plan = load_plan(args.profile, smoke=args.smoke)
        steps = [s for s in args.steps.split(",") if s]
        rows = [plan.row(r).name for r in args.rows.split(",")] if args.rows else None
        if any(s not in STEPS for s in steps):
            raise PlanError(f"--steps takes {list(STEPS)}, got {steps}.")
        overrides = key_values(args.set, "--set")
        plan.override(key_values(args.data, "--data"), key_values(args.budget, "--budget"))
        if rows or overrides:
            for r in rows or plan.rows:
                plan.row(r).train_config(**overrides)  # a bad override fails here, not after hours
    except (PlanError, ValueError) as e:
        sys.exit(f"python -m kvshot_lib.reference: {e}")
    import torch

    from .run import resolve_device, status

    root = {"root": Path(args.root)} if args.root else {}
    if args.status:
        print(status(plan, **root).to_string(index=False, float_format=lambda x: f"{x:.3f}"))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)

    device = resolve_device(args.device or plan.device)

    if device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit(
            f"python -m kvshot_lib.reference: device {device!r} asked for, but CUDA is not available here."
        )
    record = run_reference(plan, device, steps, rows, progress=not args.quiet, **root, **overrides)
    print(record)
    return 0


def key_values(items: list[str], flag: str) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise PlanError(f"{flag} takes KEY=VALUE, got {item!r}.")
        out[key] = yaml.safe_load(value)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
