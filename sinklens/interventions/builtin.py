"""Registers the built-in interventions with :mod:`sinklens.interventions.registry`.

Each entry follows the registry's uniform signature ``factory(model, *, positions, layers=None, **options)``.
"""

from __future__ import annotations

from sinklens.interventions import calibration, masks, neurons, variance
from sinklens.interventions.registry import register, register_alias

register("self_only", masks.self_only, role="create",
         summary="the token at `positions` attends only to itself, so it keeps a single value's variance")
register("restart", masks.restart, role="create",
         summary="queries at or after `positions` ignore every earlier key: the position becomes a new first token")
register("amplify", variance.amplify, role="create",
         summary="x <- mu + alpha (x - mu) on head outputs at `positions` (option alpha)")
register("transplant_dims", neurons.transplant_dims, role="create",
         summary="copy the sink's residual values in `dims` onto `positions`")
register("block_keys", masks.block_keys, role="remove",
         summary="no query may attend to the keys at `positions`")
register("calibrate", variance.calibrate, role="remove",
         summary="rescale head outputs so `positions` has the spread of later positions")
register("variance_calibration", calibration.variance_calibration, role="remove", summary="divide each head's output by sqrt(sum_j A_tj^2) (mode=amplify|attenuate; `positions` None = all)")
register("clamp_dims", neurons.clamp_dims, role="remove",
         summary="set (or bound) residual dimensions `dims` at `positions`")
register("edit_neurons", neurons.edit_neurons, role="remove",
         summary="zero, scale or set FFN neurons `neurons` at `positions` (needs explicit layers)")

# The names of sinklens 0.1 experiments and CLI, kept working.
for _old, _new in {"variance": "amplify", "transplant": "transplant_dims", "block": "block_keys",
                   "clamp": "clamp_dims", "ablate_neurons": "edit_neurons"}.items():
    register_alias(_old, _new)
