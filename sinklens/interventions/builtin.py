"""Registers the built-in interventions with :mod:`sinklens.interventions.registry`."""

from __future__ import annotations

from sinklens.interventions import calibration, masks, neurons, variance
from sinklens.interventions.registry import register

_DIMS = "dims=[...] (residual dimensions, e.g. 507 for SmolLM2)"

register("self_only", masks.self_only, role="create",
         summary="the token at `positions` attends only to itself, so it keeps a single value's variance")
register("restart", masks.restart, role="create",
         summary="queries at or after `positions` ignore every earlier key: the position becomes a new first token")
register("amplify", variance.amplify, role="create", defaults={"alpha": 8.0},
         summary="x <- mu + alpha (x - mu) on head outputs at `positions` (option alpha, default 8)")
register("transplant_dims", neurons.transplant_dims, role="create", requires={"dims": _DIMS}, sink_option="source",
         summary="copy the sink's residual values in `dims` onto `positions`")
register("block_keys", masks.block_keys, role="remove",
         summary="no query may attend to the keys at `positions`")
register("calibrate", variance.calibrate, role="remove",
         summary="rescale head outputs so `positions` has the spread of later positions")
register("variance_calibration", calibration.variance_calibration, role="remove", sink_defaults={"mode": "attenuate"},
         summary="remove_sink: scale the sink's head outputs by sqrt(min_t' s_t' / s_t), s_t = sum_j A_tj^2, down to "
                 "the most-aggregated query's level (mode=attenuate); as a spec (trainer, measure_intervention) "
                 "mode=amplify by default: divide by sqrt(s_t), causal")
register("clamp_dims", neurons.clamp_dims, role="remove", requires={"dims": _DIMS},
         summary="set (or bound) residual dimensions `dims` at `positions`")
register("edit_neurons", neurons.edit_neurons, role="remove", requires={"neurons": "neurons=[...] (FFN neuron indices)"},
         summary="zero, scale or set FFN neurons `neurons` at `positions` (needs explicit layers)")

