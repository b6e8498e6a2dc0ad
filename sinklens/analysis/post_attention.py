"""A head's write where it reaches the residual stream, through a post-attention norm read as an affine map."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.errors import UnsupportedArchitectureError
from sinklens.hooks import layer_weight, model_device, weight_cached
from sinklens.residual_units import NormMap, post_ln_reason, post_norm_map


def post_attention_map(model: Any, layer: int) -> NormMap | None:
    """``layer``'s post-attention norm as an affine map, or None: Gemma 2/3's ``ln1_post`` or a post-LN model's
    ``ln1``. A head's write ``w`` reaches the stream as ``gain ⊙ C(w) / s`` (``s``: the norm's ``hook_scale``;
    ``C``: the mean removal if it centres)."""
    norm = post_norm_map(model, layer, "attn")
    if norm.is_identity:
        return None
    if norm.center and post_ln_reason(model) is None:
        raise UnsupportedArchitectureError(
            f"The post-attention norm of layer {layer} centres its input (a LayerNorm of the attention output alone); "
            "sinklens maps head outputs through RMS post-norms, and through the LayerNorm of a post-LN block.")
    return norm


def post_attention_scale_hooks(model: Any, layers: Sequence[int]) -> dict[int, str]:
    """``{layer: hook_scale}`` of the layers that have a post-attention norm."""
    return {layer: norm.scale_hook for layer in layers if (norm := post_attention_map(model, layer)) is not None}


def attention_output_grams(model: Any, layers: Sequence[int]) -> tuple[Float[Tensor, "layer head d_head d_head"], Float[Tensor, "layer head d_head d_head"]]:
    """Float64 Gram matrices ``W_O[h] W_O[h]ᵀ`` and, in residual units, ``M_h M_hᵀ`` with ``M_h = C(W_O[h]) diag(g)``
    (``W_O[h]`` without a post norm), so ``‖z M_h‖² = z G zᵀ``; cached until the weights change, returned as copies."""

    def compute() -> tuple[Tensor, Tensor]:
        device, grams, grams_res = model_device(model), [], []
        for layer in layers:
            w_o = layer_weight(model, "W_O", layer).to(device, torch.float64)  # [head, d_head, d_model]
            grams.append(w_o @ w_o.transpose(-1, -2))
            norm = post_attention_map(model, layer)
            if norm is not None:  # else the residual-unit map is W_O itself
                w_o = w_o - w_o.mean(-1, keepdim=True) if norm.center else w_o
                w_o = w_o * norm.gain.to(device, torch.float64)
            grams_res.append(w_o @ w_o.transpose(-1, -2))
        return torch.stack(grams), torch.stack(grams_res)

    gram, gram_res = weight_cached(model, ("attention_output_grams", tuple(layers)), compute)
    return gram.clone(), gram_res.clone()
