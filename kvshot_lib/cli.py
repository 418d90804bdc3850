"""The ``kvshot`` command. Each subcommand's arguments and implementation live in the module that owns it;
this file only wires them up."""

from __future__ import annotations

import argparse
import sys

from . import generate_cli, runner, train_cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvshot", description="KVShot: speculative decoding research suite."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    runner.add_cli(sub)  # kvshot run
    generate_cli.add_cli(sub)  # kvshot generate, kvshot bench
    train_cli.add_cli(sub)  # kvshot train
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
