"""Variance calibration: make each head's output variance independent of the position.

A head's output ``z_t = Σ_j A_tj v_j`` has ``Var(z_t) = σ² s_t``, ``s_t = Σ_j A_tj²`` (``1/(t+1)`` under
uniform causal attention, 1 at position 0: why the first token stands out; arXiv 2602.05927). Per batch
element, head and query (``s_t`` from ``attn.hook_pattern``, applied at ``attn.hook_z``):
``mode="amplify"``: ``z_t ← z_t / sqrt(s_t)`` (factors ≥ 1); ``mode="attenuate"``:
``z_t ← z_t · sqrt(min_t' s_t' / s_t)`` over the real queries (factors ≤ 1). ``remove_sink`` defaults to
``attenuate``; spec strings and direct calls to ``amplify``, since ``attenuate`` reads later queries.

Examples:
    >>> import torch
    >>> from sinklens.testing import tiny_model
    >>> model = tiny_model()
    >>> hooks = variance_calibration(model, positions=None)
    >>> len(hooks)  # a pattern hook and a z hook per layer
    4
"""

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
    ``s_t = Σ_j A_tj²`` in float32 (all-zero rows: 1); the minimum runs over ``queries`` (default all).

    Examples:
        >>> A = torch.tril(torch.ones(3, 3)) / torch.arange(1, 4)[:, None]  # uniform causal
        >>> calibration_factor(A[None, None])[0, :, 0] ** 2
        tensor([1.0000, 2.0000, 3.0000])
    """
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


def _refuse_identity_at_first_position(model: Any) -> None:
    """Refuse ``mode="amplify"`` at position 0 alone where it is the identity (causal, no sink logits: ``s_0 = 1``)."""
    if attention_visibility(model).causal and not has_sink_logits(model):
        raise InvalidArgumentError(
            "variance_calibration(mode='amplify', positions=[0]) does nothing on this model: in a causal model "
            "without sink logits query 0 attends only to key 0, so s_0 = sum_j A_0j^2 = 1 and its factor "
            "1/sqrt(s_0) is exactly 1. To take the sink away use mode='attenuate' (the default of remove_sink and "
            "`sinklens intervene --method variance-calibration`); to give later positions the first token's "
            "variance pass positions=None or positions after 0."
        )


def variance_calibration(
    model: Any,
    *,
    positions: int | Sequence[int] | None = None,
    layers: int | Sequence[int] | None = None,
    mode: Mode = "amplify",
) -> Hooks:
    """Hooks that rescale each head's output at query ``positions`` (None: all) by its aggregation factor
    (module docstring); ``mode="amplify"`` with ``positions=0`` alone, where every factor is 1, is refused."""
    mode = choice(mode, ("amplify", "attenuate"), what="mode")  # type: ignore[assignment]
    dims = model_dims(model)
    pos = None if positions is None else positions_arg(positions, dims.n_ctx)
    if mode == "amplify" and pos == [0]:
        _refuse_identity_at_first_position(model)
    layer_list = resolve_layers(layers, dims.n_layers)
    names = [hook_name(layer, site) for layer in layer_list for site in (PATTERN, Z)]
    check_hook_names(model, names)
    require_attention_seams(model, "variance calibration")  # it needs hook_pattern before hook_z
    factors: dict[int, Tensor] = {}
    hooks: Hooks = []
    for layer in layer_list:
        def keep(pattern: Tensor, hook: Any, layer: int = layer) -> None:
            factors[layer] = calibration_factor(pattern, mode, real_tokens(pattern.shape[0], pattern.shape[-2]))

        def rescale(z: Tensor, hook: Any, layer: int = layer) -> Tensor:  # z: (B, T, H, dh)
            f = factors.pop(layer)
            if f.shape[2] != z.shape[2]:  # grouped-query hook_z over kv heads is not expected; guard anyway
                raise ValueError(f"hook_z has {z.shape[2]} heads but the pattern {f.shape[2]}.")
            if pos is not None:
                check_in_sequence(pos, z.shape[1])  # as every other factory: a position beyond the sequence is named
                mask = torch.zeros(z.shape[1], dtype=torch.bool, device=z.device)
                mask[pos] = True
                f = torch.where(mask[None, :, None], f, torch.ones_like(f))
            return z * f[..., None].to(z.dtype)

        hooks.append((hook_name(layer, PATTERN), keep))
        hooks.append((hook_name(layer, Z), rescale))
    return hooks
