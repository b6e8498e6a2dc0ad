"""Variance calibration: a head's output ``z_t = Σ_j A_tj v_j`` has ``Var(z_t) = σ² s_t`` with
``s_t = Σ_j A_tj²`` (1 at position 0 of a causal model: why the first token stands out; arXiv 2602.05927);
rescaling ``z_t`` by ``s_t`` makes the variance independent of the position."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from sinklens.analysis.sinks import has_sink_logits
from sinklens.errors import InvalidArgumentError
from sinklens.hooks import PATTERN, Z, check_hook_names, hook_name, model_dims, resolve_layers
from sinklens.probes import require_attention_seams
from sinklens.interventions.masks import Hooks, check_in_sequence, positions_arg
from sinklens.streaming import real_tokens
from sinklens.validate import choice
from sinklens.visibility import attention_visibility

Mode = Literal["amplify", "attenuate"]


def calibration_factor(
    pattern: Float[Tensor, "batch head query key"], mode: Mode = "amplify",
    queries: Bool[Tensor, "batch query"] | None = None,
) -> Float[Tensor, "batch query head"]:
    """The multiplier of ``z`` per (batch, query, head): ``1/sqrt(s_t)`` or ``sqrt(min s / s_t)``, with
    ``s_t = Σ_j A_tj²`` in float32 (all-zero rows: 1); the minimum runs over ``queries`` (default all)."""
    s = pattern.float().pow(2).sum(dim=-1)  # (B, H, T)
    alive = s > 0
    s_safe = torch.where(alive, s, torch.ones_like(s))
    if mode == "amplify":
        factor = s_safe.rsqrt()
    else:
        counted = alive if queries is None else alive & queries[:, None, :].to(alive.device)
        floor = torch.where(counted, s, torch.full_like(s, float("inf"))).amin(dim=-1, keepdim=True)
        floor = torch.where(torch.isinf(floor), torch.ones_like(floor), floor)  # no row counted: factor 1
        factor = (floor / s_safe).sqrt()
    return torch.where(alive, factor, torch.ones_like(factor)).transpose(1, 2)  # (B, T, H)


def variance_calibration(
    model: Any, *, positions: int | Sequence[int] | None = None,
    layers: int | Sequence[int] | None = None, mode: Mode = "amplify",
) -> Hooks:
    """Hooks that multiply ``attn.hook_z`` at query ``positions`` (None: all) by :func:`calibration_factor` of
    ``attn.hook_pattern``, per batch element, head and query: ``mode="amplify"`` ``1/sqrt(s_t)`` (≥ 1),
    ``"attenuate"`` ``sqrt(min_t' s_t' / s_t)`` over the real queries (≤ 1; ``remove_sink``'s default)."""
    mode = choice(mode, ("amplify", "attenuate"), what="mode")  # type: ignore[assignment]
    dims = model_dims(model)
    pos = None if positions is None else positions_arg(positions, dims.n_ctx)
    if mode == "amplify" and pos == [0] and attention_visibility(model).causal and not has_sink_logits(model):
        raise InvalidArgumentError(
            "variance_calibration(mode='amplify', positions=[0]) does nothing on this model: causal without sink "
            "logits, query 0 attends only to key 0, so its factor 1/sqrt(s_0) is 1. To take the sink away use "
            "mode='attenuate' (remove_sink's default); to give later positions the first token's variance pass "
            "positions=None or positions after 0.")
    layer_list = resolve_layers(layers, dims.n_layers)
    check_hook_names(model, [hook_name(layer, site) for layer in layer_list for site in (PATTERN, Z)])
    require_attention_seams(model, "variance calibration")  # it needs hook_pattern before hook_z
    factors: dict[int, Tensor] = {}
    hooks: Hooks = []
    for layer in layer_list:
        def keep(pattern: Tensor, hook: Any, layer: int = layer) -> None:
            factors[layer] = calibration_factor(pattern, mode, real_tokens(pattern.shape[0], pattern.shape[-2]))

        def rescale(z: Tensor, hook: Any, layer: int = layer) -> Tensor:  # z: (B, T, H, dh)
            f = factors.pop(layer)
            if pos is not None:
                check_in_sequence(pos, z.shape[1])
                f, computed = torch.ones_like(f), f  # factor 1 outside ``pos``
                f[:, pos] = computed[:, pos]
            return z * f[..., None].to(z.dtype)

        hooks += [(hook_name(layer, PATTERN), keep), (hook_name(layer, Z), rescale)]
    return hooks
