"""Neuron and residual-dimension edits (:func:`edit_neurons`, :func:`clamp_dims`, :func:`transplant_dims`); hooks never
modify the tensor they receive."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch import Tensor

from sinklens.errors import InvalidArgumentError, UnsupportedArchitectureError
from sinklens.hooks import MLP_POST, RESID_POST, check_hook_names, hook_name, layer_of, model_dims
from sinklens.interventions.masks import Hooks, IndexLike, IntLike, NumberLike, check_in_sequence, layers_arg, positions_arg
from sinklens.interventions.sites import edit_site
from sinklens.residual_sites import on_the_residual_stream
from sinklens.residual_units import moe_reason, no_mlp_reason
from sinklens.validate import choice, finite_number, index, index_list

NeuronMode = Literal["zero", "scale", "set"]
ClampMode = Literal["set", "bound"]


def _edit_columns(act: Tensor, pos: list[int] | None, idx: list[int], new: Callable[[Tensor], Tensor]) -> Tensor:
    """A copy of ``act`` ``[batch, pos, dim]`` with columns ``idx`` at ``pos`` (None: all) set to ``new(old)``."""
    if pos is not None:
        check_in_sequence(pos, act.shape[1])
    at = (slice(None), slice(None) if pos is None else torch.tensor(pos, device=act.device)[:, None], idx)
    out = act.clone()
    out[at] = new(act[at])
    return out


def edit_neurons(
    model: Any, neurons: IndexLike | Mapping[Any, Any], *, mode: NeuronMode = "zero",
    value: NumberLike = 0.0, positions: IndexLike | None = None, layers: IndexLike | None = None,
) -> Hooks:
    """Zero, scale by or set to ``value`` FFN neurons (``mlp.hook_post``) at ``positions`` (default all).
    ``neurons``: indices applied in each of ``layers``, or ``{layer: [neurons]}``. Attention-only and
    mixture-of-experts models raise :class:`~sinklens.errors.UnsupportedArchitectureError`."""
    mode = choice(mode, ("zero", "scale", "set"), what="mode")
    value = finite_number(value, what="value")
    if (reason := no_mlp_reason(model) or moe_reason(model)) is not None:
        raise UnsupportedArchitectureError(f"Neuron edits are not supported for this model: {reason}.")
    dims = model_dims(model)
    if isinstance(neurons, Mapping):
        if layers is not None:
            raise InvalidArgumentError("Pass either neurons={layer: [...]} or layers=, not both.")
        if not neurons:
            raise InvalidArgumentError("neurons: an empty mapping was given; pass {layer: [neuron, ...]}.")
        per_layer = {index(k, dims.n_layers, what="layer"): index_list(v, dims.d_mlp, what="neuron", allow_negative=False)
                     for k, v in neurons.items()}
    else:
        idx = index_list(neurons, dims.d_mlp, what="neuron", allow_negative=False)
        if layers is None:
            raise InvalidArgumentError(f"edit_neurons needs explicit layers: neuron indices {idx} name a different "
                                       "neuron in each layer; pass layers=[...] or neurons={layer: [...]}.")
        per_layer = {layer: idx for layer in layers_arg(layers, dims.n_layers)}
    pos = None if positions is None else positions_arg(positions, dims.n_ctx)
    names = [hook_name(layer, MLP_POST) for layer in per_layer]
    check_hook_names(model, names)

    def new(sub: Tensor) -> Tensor:
        return sub * value if mode == "scale" else torch.full_like(sub, 0.0 if mode == "zero" else value)

    def fn(act: Tensor, hook: Any) -> Tensor:  # act: [batch, pos, d_mlp]
        return _edit_columns(act, pos, per_layer[layer_of(hook.name)], new)

    return [(name, fn) for name in names]


def clamp_dims(
    model: Any, dims: IndexLike, *, positions: IndexLike | None = 0, mode: ClampMode = "set",
    value: NumberLike = 0.0, site: str = RESID_POST, layers: IndexLike | None = None,
) -> Hooks:
    """Set residual dimensions to ``value`` (``mode="set"``) or bound them to ``[-value, value]`` (``"bound"``),
    by default at the sink's ``hook_resid_post``: ``clamp_dims(model, 507)`` removes SmolLM2's massive activation."""
    mode = choice(mode, ("set", "bound"), what="mode")
    value = finite_number(value, what="value")
    if mode == "bound" and value < 0:
        raise InvalidArgumentError(f"A bound must be >= 0, got value={value:g}.")
    md = model_dims(model)
    idx = index_list(dims, md.d_model, what="residual dimension", allow_negative=False)
    pos = None if positions is None else positions_arg(positions, md.n_ctx)
    names = [hook_name(layer, edit_site(model, site)) for layer in layers_arg(layers, md.n_layers)]
    check_hook_names(model, names)

    def new(sub: Tensor) -> Tensor:
        return torch.full_like(sub, value) if mode == "set" else sub.clamp(-value, value)

    def fn(act: Tensor, hook: Any) -> Tensor:  # act: [batch, pos, d_model]
        return _edit_columns(act, pos, idx, new)

    return on_the_residual_stream(model, [(name, fn) for name in names])


def transplant_dims(
    model: Any, dims: IndexLike, *, positions: IndexLike, source: IntLike = 0,
    site: str = RESID_POST, layers: IndexLike | None = None,
) -> Hooks:
    """Copy residual dimensions ``dims`` from position ``source`` (the sink) to ``positions`` in the same run."""
    md = model_dims(model)
    idx = index_list(dims, md.d_model, what="residual dimension", allow_negative=False)
    pos = positions_arg(positions, md.n_ctx)
    src = index(source, md.n_ctx, what="source position", allow_negative=False)
    names = [hook_name(layer, edit_site(model, site)) for layer in layers_arg(layers, md.n_layers)]
    check_hook_names(model, names)

    def fn(act: Tensor, hook: Any) -> Tensor:  # act: [batch, pos, d_model]
        check_in_sequence([src], act.shape[1])
        return _edit_columns(act, pos, idx, lambda sub: act[:, src, idx][:, None, :].expand_as(sub))

    return on_the_residual_stream(model, [(name, fn) for name in names])
