"""The stateless pieces of :class:`~sinklens.sinklm.model.SinkLM`: rotary position tables and rotation, and the
next-token loss the model, the training step and the evaluation share."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from sinklens.sinklm.variants import at_least_float32


def next_token_loss(
    logits: Float[Tensor, "batch pos d_vocab"], targets: Int[Tensor, "batch pos"]
) -> Float[Tensor, ""]:
    """Mean over every ``batch × pos`` prediction of ``-log softmax(logits[b, t])[targets[b, t]]``, nats, in float32
    (fused into the log-softmax under ``torch.compile``); the one loss of the model, the training step and the eval."""
    return F.cross_entropy(at_least_float32(logits).flatten(0, 1), targets.flatten())


def rotary_tables(n_ctx: int, d_head: int, base: float) -> tuple[Tensor, Tensor]:
    """``cos`` and ``sin`` of the RoPE angles ``t·θ_i`` (``θ_i = base^(-2i/d_head)``), each ``[n_ctx, d_head]``
    with the ``d_head/2`` frequencies repeated for both halves (rotate-half convention), float64."""
    inv_freq = 1.0 / (base ** (torch.arange(0, d_head, 2, dtype=torch.float64) / d_head))
    angles = torch.outer(torch.arange(n_ctx, dtype=torch.float64), inv_freq).repeat(1, 2)  # (n_ctx, d_head)
    return angles.cos(), angles.sin()


def rope(x: Float[Tensor, "batch pos head d_head"], cos: Tensor, sin: Tensor) -> Float[Tensor, "batch pos head d_head"]:
    """Rotate ``x[:, t]`` by position ``t``'s angles: ``x ⊙ cos + rotate_half(x) ⊙ sin``, ``rotate_half(x) = [-x₂, x₁]``."""
    T = x.shape[1]
    cos, sin = cos[:T, None, :].to(x.dtype), sin[:T, None, :].to(x.dtype)  # (T, 1, d_head)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
