"""Hook factories that create, remove and patch attention sinks, each registered by name in
:mod:`sinklens.interventions.registry`. Every factory returns ``(hook_name, fn)`` pairs for
``model.run_with_hooks`` or ``RunOptions(extra_hooks=hooks)``; no function modifies its input."""

from sinklens.interventions import builtin, registry  # noqa: F401  (builtin registers the built-ins)
from sinklens.interventions.experiments import (
    InterventionResult,
    create_sink,
    measure_intervention,
    remove_sink,
    sweep,
)
from sinklens.interventions.masks import block_keys, custom_mask, restart, self_only
from sinklens.interventions.neurons import clamp_dims, edit_neurons, transplant_dims
from sinklens.interventions.patching import SinkPatchResult, patch_sink
from sinklens.interventions.variance import amplify, calibrate, clear_reference_cache, reference_mean

__all__ = [
    "InterventionResult", "SinkPatchResult", "amplify", "block_keys", "calibrate", "clamp_dims",
    "clear_reference_cache", "create_sink", "custom_mask", "edit_neurons", "measure_intervention",
    "patch_sink", "reference_mean", "registry", "remove_sink", "restart", "self_only", "sweep",
    "transplant_dims",
]
