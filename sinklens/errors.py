"""Named exceptions: every bad input surfaces as one of these, with the bad value and what is accepted."""

from __future__ import annotations


class SinklensError(Exception):
    """Base class of every error sinklens raises on purpose."""


class UnknownModelError(SinklensError, ValueError):
    """A model spec that is neither a known name, a local path, nor a model object."""


class ModelFileNotFoundError(SinklensError, FileNotFoundError):
    """A model spec that names a local file or directory that does not exist."""


class OfflineModelError(SinklensError, OSError):
    """A hub model name that cannot be fetched because there is no network."""


class UnknownHookError(SinklensError, KeyError):
    """A hook name that the model does not have."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0]) if self.args else ""


class PatternNotExposedError(SinklensError, RuntimeError):
    """The model's attention implementation does not run ``hook_pattern`` (e.g. fused SDPA)."""


class SequenceTooLongError(SinklensError, ValueError):
    """A sequence longer than the model's context window ``cfg.n_ctx``."""


class DataFileNotFoundError(SinklensError, FileNotFoundError):
    """A training data path (text file or folder, memmap ``.bin``) that does not exist or holds no data."""


class ConfigFileNotFoundError(SinklensError, FileNotFoundError):
    """A training config file (``--config``) that does not exist."""


class OfflineDataError(SinklensError, OSError):
    """A Hugging Face dataset that cannot be streamed because there is no network."""


class InvalidArgumentError(SinklensError, ValueError):
    """An argument outside its accepted range or of the wrong type; the message names both."""


class UnknownInterventionError(SinklensError, ValueError):
    """An intervention name that is not registered (see :mod:`sinklens.interventions.registry`)."""


class OutputNotWritableError(SinklensError, OSError):
    """An output path (``--out``, ``--json``, a run directory) that cannot be written; checked before the work."""


# --- error contract (issue 11): loading, inputs, devices, and the CLI exit-code mapping -------------


class DeviceUnavailableError(SinklensError, ValueError):
    """A device that this machine does not have (``cuda`` without a GPU, ``cuda:3`` with one GPU, ``mps`` off a Mac)."""


class InputFileError(SinklensError, ValueError):
    """A prompts file that is missing, a folder, binary, not UTF-8, or holds no non-empty lines."""


class CorruptModelFileError(SinklensError, OSError):
    """A model file that exists but is truncated or corrupt (GGUF, safetensors, a converted cache)."""


class ModelLoadError(SinklensError, RuntimeError):
    """A local model that exists and looks intact but could not be loaded (e.g. an unsupported architecture)."""


class UnsupportedArchitectureError(SinklensError, ValueError):
    """The model's architecture has a feature this analysis cannot measure correctly (it refuses rather than guess)."""


class IncompatibleModelsError(SinklensError, ValueError):
    """Two models that cannot be compared as asked (e.g. different hidden sizes for a SeedPrint test)."""


# ---- trainer run directories (sinklens.sinklm.checkpoint, sinklens.train.loop)
class RunNotFoundError(ModelFileNotFoundError):
    """A path that is not a sinklens run directory, or a run that has no checkpoint yet."""


class CorruptCheckpointError(SinklensError, OSError):
    """A checkpoint whose files are missing, truncated or fail their checksum, with no good one to fall back to."""


class RunExistsError(SinklensError, FileExistsError):
    """A new training run aimed at a directory that already holds a run (pass resume or overwrite)."""


class RunLockedError(RunExistsError):
    """A training run aimed at a directory that another process is training right now (its ``.lock`` is held)."""


class OutputExistsError(SinklensError, FileExistsError):
    """A command whose output would replace a finished result (an analysis's ``report.json``, a ``--json``
    file); pass ``--overwrite`` or another output path."""


class OutputLockedError(OutputExistsError):
    """A command writing a result folder (``analyze``/``origins --out``) that another sinklens process is writing
    right now (its ``.sinklens.lock`` is held)."""


class ResumeMismatchError(SinklensError, ValueError):
    """A resume whose config changes what the run is (its model, data or initialisation seed)."""


class TrainingInterrupted(KeyboardInterrupt):
    """A training run stopped by Ctrl-C or SIGTERM after a whole step, its checkpoint written (exit code 130)."""


class TrainingDivergedError(SinklensError, RuntimeError):
    """A training step whose loss or gradient norm is NaN or infinite (the last finite checkpoint is kept)."""


#: Exit codes of the ``sinklens`` command line.
EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

# Usage errors: fixing the command line fixes them. Checked before the generic rules below, so that
# e.g. a missing model file (a FileNotFoundError, hence an OSError) is a usage error.
_USAGE_CLASSES: tuple[type[BaseException], ...] = (
    ModelFileNotFoundError, DataFileNotFoundError, ConfigFileNotFoundError, OutputNotWritableError, DeviceUnavailableError,
    InputFileError,
    RunExistsError, OutputExistsError,
)


def exit_code_for(err: BaseException) -> int:
    """The ``sinklens`` exit code for an exception that ended a command (the one mapping, used by the CLI).

    * 130 — ``KeyboardInterrupt`` (Ctrl-C).
    * 2 (usage) — the arguments are wrong: any :class:`SinklensError` that is also a ``ValueError``,
      ``LookupError`` or ``TypeError``, the missing-file and unwritable-output errors, a malformed config
      file, and a plain ``ValueError``/``TypeError`` from sinklens' own validation code.
    * 1 (failure) — the work failed: ``OSError``, ``CorruptModelFileError``, ``ModelLoadError``,
      ``PatternNotExposedError`` and every unexpected exception (reported as an internal error).

    Examples:
        >>> exit_code_for(InvalidArgumentError("batch_size must be >= 1, got 0."))
        2
        >>> exit_code_for(PatternNotExposedError("fused attention"))
        1
        >>> exit_code_for(KeyboardInterrupt())
        130
    """
    if isinstance(err, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(err, _USAGE_CLASSES):
        return EXIT_USAGE
    if isinstance(err, SinklensError):
        return EXIT_USAGE if isinstance(err, (ValueError, LookupError, TypeError)) else EXIT_FAILURE
    if is_config_syntax_error(err) or (isinstance(err, (ValueError, TypeError)) and raised_by_sinklens(err)):
        return EXIT_USAGE
    return EXIT_FAILURE


def is_config_syntax_error(err: BaseException) -> bool:
    """A JSON or TOML file that does not parse (a user's config file)."""
    import json

    try:
        import tomllib
    except ImportError:  # Python < 3.11
        return isinstance(err, json.JSONDecodeError)
    return isinstance(err, (json.JSONDecodeError, tomllib.TOMLDecodeError))


def raised_by_sinklens(err: BaseException) -> bool:
    """True when the innermost frame of ``err``'s traceback is sinklens code (a deliberate check),
    False when it comes from inside a library (torch, transformers, numpy ...)."""
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return str(tb.tb_frame.f_globals.get("__name__", "")).split(".")[0] == "sinklens"


def is_internal_error(err: BaseException) -> bool:
    """An exception that no sinklens check raised on purpose: the CLI calls it an internal error."""
    if isinstance(err, (SinklensError, OSError, KeyboardInterrupt)) or is_config_syntax_error(err):
        return False
    return not (isinstance(err, (ValueError, TypeError)) and raised_by_sinklens(err))


def one_line(err: BaseException) -> str:
    """The exception's message on one line (newlines folded; an ``OSError`` as ``strerror: 'filename'``)."""
    if isinstance(err, OSError) and not isinstance(err, SinklensError) and err.strerror:
        text = err.strerror + (f": {err.filename!r}" if err.filename is not None else "")
    else:
        text = str(err)
    text = " ".join(text.split())
    return text or type(err).__name__
