"""The ``sinklens`` command line: one line ``sinklens CMD: error: ...`` and exit 2 for a user error, 1 for a failure,
130 for Ctrl-C (:func:`sinklens.errors.exit_code_for`); ``--debug`` or ``SINKLENS_DEBUG=1`` adds the traceback."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import os
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

from sinklens.errors import EXIT_FAILURE, EXIT_INTERRUPTED, exit_code_for, is_internal_error, one_line

COMMANDS = ("analyze", "intervene", "train", "compare", "origins", "fingerprint", "context", "peft", "layer-card")
DEBUG_ENV = "SINKLENS_DEBUG"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sinklens", description="Find, explain and control attention sinks.",
        epilog=f"Exit codes: 0 ok, 1 failure, 2 usage error, 130 interrupted. --debug or {DEBUG_ENV}=1 shows tracebacks.",
    )
    parser.add_argument("--debug", action="store_true", help=f"show Python tracebacks (also {DEBUG_ENV}=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        try:
            importlib.import_module(f"sinklens.commands.{name.replace('-', '_')}").add_parser(sub)
        except Exception as err:  # never drop a sub-command silently: main() reports this error when it is run
            sub.choices.pop(name, None)  # add_parser itself failed half-way
            sub.add_parser(name, add_help=False, help=f"(unavailable: {type(err).__name__}: {one_line(err)})"
                           ).set_defaults(_unavailable=err)
            continue
        sub.choices[name].set_defaults(_parser=sub.choices[name])
        # SUPPRESS: `--debug` after the sub-command sets the flag, its absence keeps the top-level value.
        sub.choices[name].add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                       help=f"show Python tracebacks (also {DEBUG_ENV}=1)")
    return parser


def report_error(command: str, err: BaseException, *, debug: bool) -> int:
    """Print ``err`` as the one-line contract says (traceback first when ``debug``); return the exit code."""
    code = exit_code_for(err)
    if debug:
        traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
    if code == EXIT_INTERRUPTED:
        print(f"sinklens {command}: interrupted" + (f": {one_line(err)}" if str(err) else ""), file=sys.stderr)
    elif is_internal_error(err):
        hint = "" if debug else f" (rerun with --debug or {DEBUG_ENV}=1 for the traceback, and report it)"
        print(f"sinklens {command}: internal error: {type(err).__name__}: {one_line(err)}{hint}", file=sys.stderr)
    else:
        print(f"sinklens {command}: error: {one_line(err)}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """Run one command; return its exit code (see :func:`sinklens.errors.exit_code_for`)."""
    try:
        args, extra = build_parser().parse_known_args(argv)
    except KeyboardInterrupt:
        print("sinklens: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    unavailable = getattr(args, "_unavailable", None)
    debug = (args.debug or (unavailable is not None and "--debug" in extra)
             or os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off"))
    # `train` parses its config field flags (--optim.lr 3e-4) itself; for any other command leftovers are an
    # error (exit 2, like parse_args, with the sub-command's usage line and the closest flag)
    if extra and unavailable is None and not getattr(args, "accepts_config_flags", False):
        match = difflib.get_close_matches(extra[0], list(args._parser._option_string_actions), n=1)
        args._parser.error(f"unrecognized arguments: {' '.join(extra)}" + (f" (did you mean {match[0]}?)" if match else ""))
    args.config_flags = extra
    if unavailable is not None:
        if debug:
            traceback.print_exception(type(unavailable), unavailable, unavailable.__traceback__, file=sys.stderr)
        print(f"sinklens {args.command}: error: this command could not be loaded ({type(unavailable).__name__}: "
              f"{one_line(unavailable)}); the other commands still work.", file=sys.stderr)
        return EXIT_FAILURE
    try:
        with _cli_context(args.command, debug=debug):
            return int(args.func(args) or 0)
    except BrokenPipeError:  # `sinklens analyze | head`: the reader left; files were written, say nothing more
        with contextlib.suppress(AttributeError, OSError, ValueError):  # no real file descriptor (a captured stdout)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE
    except (Exception, KeyboardInterrupt) as err:
        return report_error(args.command, err, debug=debug)


@contextlib.contextmanager
def _cli_context(command: str, *, debug: bool) -> Iterator[None]:
    """Warnings as ``sinklens CMD: warning: ...`` lines (unless ``debug``), and SIGTERM handled as Ctrl-C (exit
    130) except where it is ignored or outside the main thread."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    formatwarning = warnings.formatwarning
    if not debug:
        warnings.formatwarning = lambda message, *rest, **kw: f"sinklens {command}: warning: {message}\n"
    sigterm = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) != signal.SIG_IGN
    before = signal.signal(signal.SIGTERM, interrupt) if sigterm else None
    try:
        yield
    finally:
        warnings.formatwarning = formatwarning
        if sigterm:
            signal.signal(signal.SIGTERM, before)


if __name__ == "__main__":
    sys.exit(main())
