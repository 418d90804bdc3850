"""The ``kvshot`` command. Each subcommand's arguments and implementation live in the module that owns it;
this file only wires them up.

An error the user can cause (a wrong target, a bad setting or count, an unknown method, a missing asset, a
damaged checkpoint, an ``--out`` that would destroy something) ends the command with one line on stderr,
``kvshot: <what was wrong and what to pass>``, and a documented exit status (:mod:`kvshot_lib.user_errors`:
1 a failure, 2 a usage error, 3 this machine is short), never a traceback: the subcommands check their arguments
before loading any model and raise :class:`~kvshot_lib.user_errors.UsageError`, and :func:`main` turns it and
the library's other named errors (:data:`EXIT_CODES`) into that line. A traceback is for bugs only.
``tests/test_cli_errors.py`` runs each case through the command line.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

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
from .user_errors import EXIT_CODES_HELP, EXIT_FAILURE, EXIT_USAGE, UserError

# the library's named errors and the exit status each ends ``kvshot`` with (UserError carries its own)
EXIT_CODES = {
    TargetLoadError: EXIT_USAGE,
    DrafterConfigError: EXIT_USAGE,
    DrafterTargetMismatch: EXIT_USAGE,
    TrainConfigError: EXIT_USAGE,
    PrecisionError: EXIT_USAGE,
    runner.ProfileError: EXIT_USAGE,
    MissingAssetError: EXIT_FAILURE,
    FeatureStoreMismatch: EXIT_FAILURE,
    FigureDataError: EXIT_FAILURE,
}
USER_ERRORS = (UserError, *EXIT_CODES)


class Refused(SystemExit):
    """How ``kvshot`` ends on a user error: its exit status as ``code``, its one line (already on stderr) as
    ``str()``."""

    def __init__(self, message: str, code: int):
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


def one_line(message: str) -> str:
    """``message`` with its line breaks and runs of spaces folded into single spaces."""
    return " ".join(str(message).split())


def exit_code(error: BaseException) -> int:
    """The exit status ``kvshot`` ends with on ``error``, one of :data:`USER_ERRORS`."""
    if isinstance(error, UserError):
        return error.exit_code
    return next(code for kind, code in EXIT_CODES.items() if isinstance(error, kind))


def refuse(message: str, code: int) -> NoReturn:
    """Print ``kvshot: message`` as one line on stderr and end the command with status ``code``."""
    line = one_line(message)
    line = line if line.startswith("kvshot") else f"kvshot: {line}"
    print(line, file=sys.stderr)
    raise Refused(line, code) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvshot", description="KVShot: speculative decoding research suite.", epilog=EXIT_CODES_HELP
    )
    sub = parser.add_subparsers(dest="command", required=True)
    runner.add_cli(sub)  # kvshot run
    figures.add_cli(sub)  # kvshot figures
    train_cli.add_cli(sub)  # kvshot train
    generate_cli.add_cli(sub)  # kvshot generate
    bench_cli.add_cli(sub)  # kvshot bench
    export_cli.add_cli(sub)  # kvshot export
    doctor.add_cli(sub)  # kvshot doctor
    for command in sub.choices.values():  # every subcommand's --help lists the exit codes too
        command.epilog = command.epilog or EXIT_CODES_HELP
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as e:
        refuse(str(e), exit_code(e))
    except SystemExit as e:
        if isinstance(e.code, str) and not isinstance(e, Refused):  # a bare message: a usage error, one line
            refuse(e.code, EXIT_USAGE)
        raise


if __name__ == "__main__":
    sys.exit(main())
