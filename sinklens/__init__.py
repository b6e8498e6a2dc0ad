"""sinklens: find, explain and control attention sinks in TransformerLens models.

Examples:
    >>> import sinklens
    >>> from sinklens.testing import tiny_model
    >>> report = sinklens.analyze(tiny_model(), ["t5 t6 t7 t8"], abs_threshold=None, rel_threshold=3.0,
    ...                           options=sinklens.RunOptions(progress=False))
    >>> report.sinks.received.shape[0]  # one row per layer
    2
"""

from sinklens.analysis.disparity import MassiveActivations, find_massive_activations
from sinklens.analysis.neurons import SuperNeurons, find_super_neurons
from sinklens.analysis.normalized_disparity import normalized_disparity
from sinklens.analysis.qk_locking import query_key_locking
from sinklens.analysis.report import SinkReport, analyze
from sinklens.analysis.sinks import SinkResult, find_sinks
from sinklens.analysis.value_drain import ValueDrain, measure_value_drain
from sinklens.analysis.variance import VarianceResult, measure_variance
from sinklens.analysis.verify import CausalCheck, verify_attribution
from sinklens.analysis.weight_super_neurons import super_neurons_from_weights
from sinklens.errors import (
    ModelFileNotFoundError,
    OfflineModelError,
    PatternNotExposedError,
    SequenceTooLongError,
    SinklensError,
    UnsupportedArchitectureError,
    UnknownHookError,
    UnknownModelError,
)
from sinklens.inputs import TokenBatch, as_batches, builtin_prompts, random_token_batches, stdlib_text_prompts
from sinklens.interventions import (
    InterventionResult,
    SinkPatchResult,
    create_sink,
    patch_sink,
    remove_sink,
    sweep,
)
from sinklens.loading import load_model
from sinklens.options import RunOptions
from sinklens.origins import (
    ContractionResult, FingerprintResult, PositionalDiscrepancy, TokenPreference, contraction, fingerprint,
    positional_discrepancy, token_preference,
)
from sinklens.streaming import BatchFold, Reducer, run, stream
from sinklens.visibility import Visibility, attention_visibility

__version__ = "0.1.0"

__all__ = [
    "BatchFold", "InterventionResult", "MassiveActivations", "ModelFileNotFoundError", "OfflineModelError",
    "PatternNotExposedError", "Reducer", "RunOptions", "SequenceTooLongError", "SinkPatchResult", "SinkReport",
    "SinkResult", "SinklensError", "SuperNeurons", "TokenBatch", "UnknownHookError", "UnknownModelError",
    "VarianceResult", "analyze", "as_batches", "builtin_prompts", "create_sink", "find_massive_activations",
    "find_sinks", "find_super_neurons", "load_model", "measure_variance", "normalized_disparity",
    "patch_sink", "query_key_locking", "random_token_batches", "remove_sink", "run", "stdlib_text_prompts",
    "stream", "super_neurons_from_weights", "sweep",
    # architecture awareness (issue 8)
    "CausalCheck", "UnsupportedArchitectureError", "ValueDrain", "Visibility", "attention_visibility",
    "measure_value_drain", "verify_attribution",
    # origins (issue 9)
    "ContractionResult", "FingerprintResult", "PositionalDiscrepancy", "TokenPreference", "contraction",
    "fingerprint", "positional_discrepancy", "token_preference",
]
