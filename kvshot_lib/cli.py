"""The ``kvshot`` command. Each subcommand's arguments and implementation live in the module that owns it;
this file only wires them up."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvshot", description="KVShot: speculative decoding research suite."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    from . import runner

    runner.add_cli(sub)  # kvshot run
    from . import generate_cli; generate_cli.add_cli(sub)
    from . import train_cli; train_cli.add_cli(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
