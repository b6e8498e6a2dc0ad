"""Hook factories that create, remove and patch attention sinks.

Every factory returns ``(hook_name, fn)`` pairs for ``model.run_with_hooks``, ``model.hooks(...)`` or
``sinklens.stream(..., options=RunOptions(extra_hooks=hooks))``; lists compose by concatenation, and no
function modifies the activation it receives. A ``site="hook_resid_mid"`` edit means the residual right after
the attention on every TransformerLens version (:func:`sinklens.residual_sites.on_the_residual_stream`,
:func:`sinklens.interventions.sites.edit_site`).

* masks (``hook_attn_scores``): :func:`self_only`, :func:`restart`, :func:`block_keys`, :func:`custom_mask`
* variance: :func:`amplify` (``x ← μ + α(x − μ)``), :func:`calibrate`, :func:`reference_mean`
* neurons and dimensions: :func:`edit_neurons`, :func:`clamp_dims`, :func:`transplant_dims`
* experiments: :func:`create_sink`, :func:`remove_sink`, :func:`measure_intervention`, :func:`sweep`
* patching: :func:`patch_sink`

Every factory is registered under one name in :mod:`sinklens.interventions.registry` (the CLI also accepts
hyphens); experiments, the trainer and ``sinklens intervene`` build hooks by those names.
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
