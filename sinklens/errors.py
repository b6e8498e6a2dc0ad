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


class OfflineDataError(SinklensError, OSError):
    """A Hugging Face dataset that cannot be streamed because there is no network."""


class InvalidArgumentError(SinklensError, ValueError):
    """An argument outside its accepted range or of the wrong type; the message names both."""


class UnknownInterventionError(SinklensError, ValueError):
    """An intervention name that is not registered (see :mod:`sinklens.interventions.registry`)."""


class OutputNotWritableError(SinklensError, OSError):
    """An output path (``--out``, ``--json``, a run directory) that cannot be written; checked before the work."""


# ---- trainer run directories (sinklens.train.checkpoint, sinklens.train.loop)
class RunNotFoundError(ModelFileNotFoundError):
    """A path that is not a sinklens run directory, or a run that has no checkpoint yet."""


class CorruptCheckpointError(SinklensError, OSError):
    """A checkpoint whose files are missing, truncated or fail their checksum, with no good one to fall back to."""


class RunExistsError(SinklensError, FileExistsError):
    """A new training run aimed at a directory that already holds a run (pass resume or overwrite)."""


class TrainingDivergedError(SinklensError, RuntimeError):
    """A training step whose loss or gradient norm is NaN or infinite (the last finite checkpoint is kept)."""
