"""sinklens: find, explain and control attention sinks in TransformerLens models."""

from sinklens.errors import (
    ModelFileNotFoundError,
    OfflineModelError,
    PatternNotExposedError,
    SequenceTooLongError,
    SinklensError,
    UnknownHookError,
    UnknownModelError,
)
from sinklens.inputs import TokenBatch, as_batches, builtin_prompts, random_token_batches, stdlib_text_prompts
from sinklens.streaming import Reducer, stream

__version__ = "0.1.0"
