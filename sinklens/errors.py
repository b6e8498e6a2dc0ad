"""Named exceptions: every bad input surfaces as one of these, with the bad value and what is accepted."""

from __future__ import annotations

import json
import traceback

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as the package tomli
    import tomli as tomllib


class SinklensError(Exception):
    """Base class of every error sinklens raises on purpose."""


class InvalidArgumentError(SinklensError, ValueError):
    """A bad argument, flag or input file; the message names the value and what is accepted."""


class UnsupportedArchitectureError(SinklensError, ValueError):
    """A model this measurement cannot read correctly (it refuses rather than guess), or cannot load at all."""


class NotFoundError(SinklensError, FileNotFoundError):
    """A model, data, config or run path that does not exist or holds nothing usable (no checkpoint yet)."""


class OfflineError(SinklensError, OSError):
    """A Hub model or Hugging Face dataset that cannot be fetched because there is no network."""


class CorruptFileError(SinklensError, OSError):
    """A model file, checkpoint or run file that exists but is truncated, corrupt or fails its checksum."""


class OutputExistsError(SinklensError, FileExistsError):
    """An output that would replace a finished result or run, or that another sinklens process holds."""


class OutputNotWritableError(SinklensError, OSError):
    """An output path (``--out``, ``--json``, a run directory) that cannot be written; checked before the work."""


class TrainingInterrupted(KeyboardInterrupt):
    """A training run stopped by Ctrl-C or SIGTERM after a whole step, its checkpoint written (exit code 130)."""


class TrainingDivergedError(SinklensError, RuntimeError):
    """A training step whose loss or gradient norm is NaN or infinite (the last finite checkpoint is kept)."""


#: Exit codes of the ``sinklens`` command line.
EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

# Usage errors, checked first: e.g. a missing model file is an OSError but a usage error.
_USAGE_CLASSES: tuple[type[BaseException], ...] = (NotFoundError, OutputNotWritableError, OutputExistsError)


def exit_code_for(err: BaseException) -> int:
    """The ``sinklens`` exit code for an exception that ended a command: 130 for Ctrl-C; 2 (usage) for the
    ``ValueError`` and path errors above, a malformed config file, or a ``ValueError``/``TypeError`` raised by
    sinklens code; 1 (failure) for everything else (offline, corrupt files, divergence, internal errors)."""
    if isinstance(err, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    usage = isinstance(err, ValueError) if isinstance(err, SinklensError) else _checked(err)
    return EXIT_USAGE if usage or isinstance(err, _USAGE_CLASSES) else EXIT_FAILURE


def _checked(err: BaseException) -> bool:
    """A JSON or TOML config file that does not parse, or a ``ValueError``/``TypeError`` sinklens code raised."""
    frames = [frame for frame, _ in traceback.walk_tb(err.__traceback__)]  # the innermost one raised it
    ours = bool(frames) and str(frames[-1].f_globals.get("__name__", "")).split(".")[0] == "sinklens"
    syntax = isinstance(err, (json.JSONDecodeError, tomllib.TOMLDecodeError))
    return syntax or (isinstance(err, (ValueError, TypeError)) and ours)


def is_internal_error(err: BaseException) -> bool:
    """An exception that no sinklens check raised on purpose: the CLI calls it an internal error."""
    return not (isinstance(err, (SinklensError, OSError, KeyboardInterrupt)) or _checked(err))


def one_line(err: BaseException) -> str:
    """The exception's message on one line (newlines folded; an ``OSError`` as ``strerror: 'filename'``)."""
    if isinstance(err, OSError) and not isinstance(err, SinklensError) and err.strerror:
        text = err.strerror + (f": {err.filename!r}" if err.filename is not None else "")
    else:
        text = str(err)
    return " ".join(text.split()) or type(err).__name__
