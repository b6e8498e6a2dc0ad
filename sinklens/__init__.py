"""sinklens: find, explain and control attention sinks in TransformerLens models.

Examples:
    >>> import sinklens
    >>> from sinklens.testing import tiny_model
    >>> report = sinklens.analyze(tiny_model(), ["t5 t6 t7 t8"], abs_threshold=None, rel_threshold=3.0,
    ...                           options=sinklens.RunOptions(progress=False))
    >>> report.sinks.received.shape[0]  # one row per layer
    2
"""

import importlib
from typing import Any

# Names are imported on first use (PEP 562): `sinklens --help` does not pay for torch and TransformerLens.
_EXPORTS = {
    "sinklens.analysis.disparity": ("MassiveActivations", "find_massive_activations"),
    "sinklens.analysis.neurons": ("SuperNeurons", "find_super_neurons"),
    "sinklens.analysis.normalized_disparity": ("normalized_disparity",),
    "sinklens.analysis.qk_locking": ("query_key_locking",),
    "sinklens.analysis.report": ("SinkReport", "analyze"),
    "sinklens.analysis.sinks": ("SinkResult", "find_sinks"),
    "sinklens.analysis.value_drain": ("ValueDrain", "measure_value_drain"),
    "sinklens.analysis.variance": ("VarianceResult", "measure_variance"),
    "sinklens.analysis.verify": ("CausalCheck", "verify_attribution"),
    "sinklens.analysis.weight_super_neurons": ("super_neurons_from_weights",),
    "sinklens.errors": ("CorruptFileError", "InvalidArgumentError", "NotFoundError", "OfflineError", "OutputExistsError",
                        "SinklensError", "UnsupportedArchitectureError"),
    "sinklens.inputs": ("TokenBatch", "as_batches", "random_token_batches"),
    "sinklens.interventions": ("InterventionResult", "SinkPatchResult", "create_sink", "patch_sink", "remove_sink",
                               "sweep"),
    "sinklens.loading": ("load_model",),
    "sinklens.options": ("RunOptions",),
    "sinklens.prompts": ("builtin_prompts", "stdlib_text_prompts"),
    "sinklens.origins": ("ContractionResult", "FingerprintResult", "PositionalDiscrepancy", "TokenPreference",
                         "contraction", "fingerprint", "positional_discrepancy", "token_preference"),
    "sinklens.streaming": ("BatchFold", "Reducer", "run", "stream"),
    "sinklens.visibility": ("Visibility", "attention_visibility"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


#: Subpackages reachable as attributes (``sinklens.origins.contraction``), imported on first use like the names.
_SUBPACKAGES = ("analysis", "interventions", "loading", "origins", "plotting", "sinklm", "testing", "train")


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"sinklens.{name}")
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'sinklens' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_MODULE_OF])


__version__ = "0.1.0"

__all__ = sorted(_MODULE_OF)
