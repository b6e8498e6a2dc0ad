"""Hook factories that create, remove and patch attention sinks, each registered below by name in
:mod:`sinklens.interventions.registry`. Every factory returns ``(hook_name, fn)`` pairs for
``model.run_with_hooks`` or ``RunOptions(extra_hooks=hooks)``; no function modifies its input."""

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

register("self_only", self_only, role="create",
         summary="the token at `positions` attends only to itself, so it keeps a single value's variance")
register("restart", restart, role="create",
         summary="queries at or after `positions` ignore every earlier key: the position becomes a new first token")
register("amplify", amplify, role="create", defaults={"alpha": 8.0},
         summary="x <- mu + alpha (x - mu) on head outputs at `positions` (option alpha, default 8)")
register("transplant_dims", transplant_dims, role="create", requires={"dims": _DIMS}, sink_option="source",
         summary="copy the sink's residual values in `dims` onto `positions`")
register("block_keys", block_keys, role="remove",
         summary="no query may attend to the keys at `positions`")
register("calibrate", calibrate, role="remove",
         summary="rescale head outputs so `positions` has the spread of later positions")
register("variance_calibration", variance_calibration, role="remove", sink_defaults={"mode": "attenuate"},
         summary="remove_sink: scale the sink's head outputs by sqrt(min_t' s_t' / s_t), s_t = sum_j A_tj^2, down to "
                 "the most-aggregated query's level (mode=attenuate); as a spec (trainer, measure_intervention) "
                 "mode=amplify by default: divide by sqrt(s_t), causal")
register("clamp_dims", clamp_dims, role="remove", requires={"dims": _DIMS},
         summary="set (or bound) residual dimensions `dims` at `positions`")
register("edit_neurons", edit_neurons, role="remove", requires={"neurons": "neurons=[...] (FFN neuron indices)"},
         summary="zero, scale or set FFN neurons `neurons` at `positions` (needs explicit layers)")

__all__ = [
    "InterventionResult", "SinkPatchResult", "amplify", "block_keys", "calibrate", "clamp_dims",
    "clear_reference_cache", "create_sink", "custom_mask", "edit_neurons", "measure_intervention",
    "patch_sink", "reference_mean", "registry", "remove_sink", "restart", "self_only", "sweep",
    "transplant_dims",
]
