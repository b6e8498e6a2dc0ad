"""The ``sinklens`` command line: ``sinklens analyze | intervene | train | compare``.

Each sub-command lives in its own module under :mod:`sinklens.commands` and exposes
``add_parser(subparsers)`` (which sets ``func`` on its parser) — this file only dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from sinklens.errors import SinklensError

COMMANDS = ("analyze", "intervene", "train", "compare")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sinklens", description="Find, explain and control attention sinks.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"sinklens.commands.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"sinklens.commands.{name}":
                raise
            continue
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "accepts_config_flags", False):  # `train` hands field flags (--optim.lr 3e-4) to tyro
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.config_flags = rest
    try:
        return int(args.func(args) or 0)
    except SinklensError as err:
        print(f"sinklens {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
