"""Hook factories that create, remove and patch attention sinks.

Every factory returns a list of ``(hook_name, fn)`` pairs that composes with any TransformerLens
call — ``model.run_with_hooks(tokens, fwd_hooks=hooks)``, ``with model.hooks(fwd_hooks=hooks):``,
or ``sinklens.stream(..., options=RunOptions(extra_hooks=hooks))`` so the analyzers measure the intervened model —
and with each other (concatenate the lists). The functions never modify the activation they
receive; they return a new tensor.

A factory given ``site="hook_resid_mid"`` (:func:`amplify`, :func:`calibrate`, :func:`clamp_dims`,
:func:`transplant_dims`, and :func:`patch_sink`'s ``"resid_mid"``) edits the residual stream after the
attention on every version: on the TransformerLens 4.x bridges that hook is a copy read by the MLP, which the
block does not carry on from, so the edit is made through the attention write there
(:func:`sinklens.residual_sites.on_the_residual_stream`; the hook names it returns are then
``hook_resid_pre`` and ``hook_attn_out``). On a post-LN block (BERT) the residual after the attention is
``resid_pre + write``, before ``ln1``: 3.x's ``HookedEncoder`` fires ``hook_resid_mid`` there, the 4.x bridge
after the MLP, so the edit factories edit the bridge's ``ln1.hook_in`` instead
(:func:`sinklens.interventions.sites.edit_site`); :func:`patch_sink` patches a whole position, the same at either.

* masks (``hook_attn_scores``): :func:`self_only`, :func:`restart`, :func:`block_keys`, :func:`custom_mask`
* variance: :func:`amplify` (``x ← μ + α(x − μ)``), :func:`calibrate`, :func:`reference_mean`
* neurons and dimensions: :func:`edit_neurons`, :func:`clamp_dims`, :func:`transplant_dims`
* experiments: :func:`create_sink`, :func:`remove_sink`, :func:`measure_intervention`, :func:`sweep`
* patching: :func:`patch_sink`

Every factory is registered under one canonical name in :mod:`sinklens.interventions.registry`
(``self_only``, ``restart``, ``amplify``, ``transplant_dims``, ``block_keys``, ``calibrate``,
``clamp_dims``, ``edit_neurons``, ``variance_calibration``; the CLI also accepts hyphens, and the sinklens 0.1 names
``variance``, ``transplant``, ``block``, ``clamp``, ``ablate_neurons`` still work). Experiments, the
trainer and ``sinklens intervene`` build hooks by those names.
"""

from sinklens.interventions import builtin, registry  # builtin registers the built-in interventions
from sinklens.interventions.experiments import (
    InterventionResult,
    create_sink,
    measure_intervention,
    register_method,
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
    "patch_sink", "reference_mean", "register_method", "registry", "remove_sink", "restart", "self_only", "sweep",
    "transplant_dims",
]
