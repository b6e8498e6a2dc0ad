"""Hook factories that create, remove and patch attention sinks, registered by name below (:mod:`.registry`); each
returns ``(hook_name, fn)`` pairs (for ``run_with_hooks`` or ``RunOptions(extra_hooks=...)``), modifying no input."""

from sinklens.interventions import registry
from sinklens.interventions.calibration import variance_calibration
from sinklens.interventions.experiments import (
    InterventionResult, create_sink, measure_intervention, remove_sink, sweep)
from sinklens.interventions.masks import block_keys, custom_mask, restart, self_only
from sinklens.interventions.neurons import clamp_dims, edit_neurons, transplant_dims
from sinklens.interventions.patching import SinkPatchResult, patch_sink
from sinklens.interventions.registry import register
from sinklens.interventions.variance import amplify, calibrate, clear_reference_cache, reference_mean

_DIMS = "dims=[...] (residual dimensions, e.g. 507 for SmolLM2)"

register("self_only", self_only, role="create")
register("restart", restart, role="create")
register("amplify", amplify, role="create", defaults={"alpha": 8.0})
register("transplant_dims", transplant_dims, role="create", requires={"dims": _DIMS}, sink_option="source")
register("block_keys", block_keys, role="remove")
register("calibrate", calibrate, role="remove")
# remove_sink attenuates the sink to the most-aggregated query's level; a spec keeps the factory's mode="amplify"
register("variance_calibration", variance_calibration, role="remove", sink_defaults={"mode": "attenuate"})
register("clamp_dims", clamp_dims, role="remove", requires={"dims": _DIMS})
register("edit_neurons", edit_neurons, role="remove", requires={"neurons": "neurons=[...] (FFN neuron indices)"})

__all__ = [
    "InterventionResult", "SinkPatchResult", "amplify", "block_keys", "calibrate", "clamp_dims",
    "clear_reference_cache", "create_sink", "custom_mask", "edit_neurons", "measure_intervention",
    "patch_sink", "reference_mean", "registry", "remove_sink", "restart", "self_only", "sweep",
    "transplant_dims",
]
