"""The ``kvshot`` command. Each subcommand's arguments and implementation live in the module that owns it;
this file only wires them up."""

from __future__ import annotations

import argparse
import sys

from . import runner
from .decoding import cli as generate_cli
from .evaluation import cli as bench_cli
from .plots import figures
from .training import cli as train_cli


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
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
