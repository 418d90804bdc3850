"""The ``kvshot`` command. Each subcommand's arguments and implementation live in the module that owns it;
this file only wires them up.

An error the user can cause (a wrong target, a bad setting or count, an unknown method, a missing asset) ends
the command with one line, ``kvshot: <what was wrong and what to pass>``, and exit status 1, never a
traceback: the subcommands check their arguments before loading any model and raise ``SystemExit`` with such
a line, and :func:`main` turns the library's own user-error exceptions (:data:`USER_ERRORS`) into one too.
``tests/test_cli_errors.py`` runs each case through the command line.
"""

from __future__ import annotations

import argparse
import sys

from . import doctor, runner
from .corpus import FeatureStoreMismatch
from .decoding import cli as generate_cli
from .drafters import DrafterConfigError, DrafterTargetMismatch
from .drafters import cli as export_cli
from .evaluation import cli as bench_cli
from .plots import FigureDataError, figures
from .target import MissingAssetError, PrecisionError, TargetLoadError
from .training import TrainConfigError
from .training import cli as train_cli

USER_ERRORS = (
    TargetLoadError,
    MissingAssetError,
    DrafterConfigError,
    DrafterTargetMismatch,
    TrainConfigError,
    FeatureStoreMismatch,
    FigureDataError,
    PrecisionError,
    runner.ProfileError,
)


def one_line(message: str) -> str:
    """``message`` with its line breaks and runs of spaces folded into single spaces."""
    return " ".join(str(message).split())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvshot", description="KVShot: speculative decoding research suite."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    runner.add_cli(sub)  # kvshot run
    figures.add_cli(sub)  # kvshot figures
    train_cli.add_cli(sub)  # kvshot train
    generate_cli.add_cli(sub)  # kvshot generate
    bench_cli.add_cli(sub)  # kvshot bench
    export_cli.add_cli(sub)  # kvshot export
    doctor.add_cli(sub)  # kvshot doctor
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as e:
        raise SystemExit(f"kvshot: {one_line(e)}") from None
    except SystemExit as e:
        if isinstance(e.code, str):  # a subcommand's message: one line
            raise SystemExit(one_line(e.code)) from None
        raise


if __name__ == "__main__":
    sys.exit(main())
