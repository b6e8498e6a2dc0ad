"""Hook factories that create, remove and patch attention sinks.

Every factory returns ``(hook_name, fn)`` pairs for ``model.run_with_hooks`` or
``RunOptions(extra_hooks=hooks)``; lists compose by concatenation and no function modifies its input. Masks:
:func:`self_only`, :func:`restart`, :func:`block_keys`, :func:`custom_mask`; variance: :func:`amplify`,
:func:`calibrate`; neurons and dimensions: :func:`edit_neurons`, :func:`clamp_dims`, :func:`transplant_dims`;
experiments: :func:`create_sink`, :func:`remove_sink`, :func:`measure_intervention`, :func:`sweep`;
:func:`patch_sink`. Each is registered by name in :mod:`sinklens.interventions.registry`.
"""

from sinklens.interventions import builtin, registry  # builtin registers the built-in interventions
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
