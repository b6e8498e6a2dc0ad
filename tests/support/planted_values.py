"""Hooks that plant known value-aggregation mechanisms in any model, for tests with analytic answers.

Each function returns ``(hook_name, fn)`` pairs to pass as ``RunOptions(extra_hooks=...)``, so the
analyzers measure the planted model through their ordinary streaming pass:

* :func:`uniform_attention`: every real query attends uniformly to the keys it can see causally;
* :func:`gaussian_values`: ``hook_v`` replaced by i.i.d. ``N(0, σ²)`` values (independent across
  sequences, positions, heads and coordinates). With uniform attention the head output at position
  ``t`` is then the mean of ``t + 1`` such values: its coordinates are i.i.d. ``N(0, σ² / (t + 1))``,
  so the expected feature standard deviation (``torch.std``, Bessel-corrected, over ``n``
  coordinates) is ``c₄(n) σ / sqrt(t + 1)`` with ``c₄(n) = sqrt(2 / (n − 1)) Γ(n / 2) / Γ((n − 1) / 2)``
  (:func:`c4`);
* :func:`planted_sink`: one head attends with weight ``attention`` to key 0 from every query ``q >= 1``
  (the rest spread uniformly over keys ``1..q``), and key 0's value (of that head's key/value group) is
  set to zero (a **no-op** sink) or to a large shared vector (a **broadcast** sink).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor

from sinklens.hooks import SCORES, V, hook_name, model_dims

__all__ = ["c4", "gaussian_values", "planted_sink", "uniform_attention"]


def c4(n: int) -> float:
    """``E[s] / σ`` for the Bessel-corrected sample standard deviation ``s`` of ``n`` i.i.d. normal values.

    Examples:
        >>> round(c4(4), 4), round(c4(16), 4)
        (0.9213, 0.9835)
    """
    return math.sqrt(2.0 / (n - 1)) * math.exp(math.lgamma(n / 2) - math.lgamma((n - 1) / 2))


def _causal(n: int, device: Any) -> Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def uniform_attention(layer: int) -> list[tuple[str, Any]]:
    """Scores 0 on every causally visible key and the dtype's minimum elsewhere: uniform causal attention."""

    def scores_hook(scores: Tensor, hook: Any) -> Tensor:  # [batch, head, query, key]
        seen = _causal(scores.shape[-1], scores.device)
        return torch.where(seen, torch.zeros_like(scores), torch.full_like(scores, torch.finfo(scores.dtype).min))

    return [(hook_name(layer, SCORES), scores_hook)]


def gaussian_values(layer: int, *, sigma: float = 1.0, seed: int = 0) -> list[tuple[str, Any]]:
    """``hook_v`` of ``layer`` replaced by fresh i.i.d. ``N(0, sigma²)`` values on every forward (seeded)."""
    gen = torch.Generator().manual_seed(seed)

    def value_hook(v: Tensor, hook: Any) -> Tensor:  # [batch, pos, kv_head, d_head]
        noise = torch.randn(v.shape, generator=gen, dtype=torch.float32) * sigma
        return noise.to(device=v.device, dtype=v.dtype)

    return [(hook_name(layer, V), value_hook)]


def planted_sink(
    model: Any,
    layer: int,
    head: int,
    *,
    attention: float = 0.8,
    value: Literal["zero", "broadcast"] = "zero",
    scale: float = 20.0,
) -> list[tuple[str, Any]]:
    """Plant a sink in ``(layer, head)``: attention ``attention`` to key 0 from every query ``q >= 1``.

    The scores of ``head`` become ``log(attention · q / (1 − attention))`` for key 0 and 0 for keys
    ``1..q`` (future keys: the dtype's minimum), so ``A[q, 0] = attention`` exactly; other heads keep
    their scores. Key 0's value in the head's key/value group (``head // (n_heads / n_kv_heads)``) is set
    to zero (``value="zero"``) or to ``scale`` times the mean norm of the other values of that batch, along
    the first coordinate (``value="broadcast"``).
    """
    dims = model_dims(model)
    kv = head // (dims.n_heads // dims.n_kv_heads)
    odds = attention / (1.0 - attention)

    def scores_hook(scores: Tensor, hook: Any) -> Tensor:  # [batch, head, query, key]
        n = scores.shape[-1]
        q = torch.arange(n, device=scores.device, dtype=scores.dtype)
        planted = torch.zeros(n, n, device=scores.device, dtype=scores.dtype)
        planted[1:, 0] = torch.log(odds * q[1:])
        planted = torch.where(_causal(n, scores.device), planted, torch.finfo(scores.dtype).min)
        scores = scores.clone()
        scores[:, head] = planted
        return scores

    def value_hook(v: Tensor, hook: Any) -> Tensor:  # [batch, pos, kv_head, d_head]
        v = v.clone()
        if value == "zero":
            v[:, 0, kv] = 0.0
        else:
            typical = v[:, 1:, kv].norm(dim=-1).mean()
            v[:, 0, kv] = 0.0
            v[:, 0, kv, 0] = scale * typical
        return v

    return [(hook_name(layer, SCORES), scores_hook), (hook_name(layer, V), value_hook)]
