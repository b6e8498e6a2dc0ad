"""A head's write where it reaches the residual stream: the post-attention norm as an affine map.

Gemma 2/3 normalise the attention output (``ln1_post``) and post-LN models (BERT) normalise ``resid_pre`` plus
it (``ln1``); :func:`post_attention_map` reads either as ``gain ⊙ C(w) / s``, and
:func:`attention_output_grams` turns ``W_O`` into Gram matrices in those residual units.
"""

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
    """``layer``'s post-attention norm as an affine map (:func:`~sinklens.residual_units.post_norm_map`), or None.

    Gemma 2/3 bridges and TransformerLens 3.x models with ``use_normalization_before_and_after`` have
    ``blocks.{layer}.ln1_post``, an RMS norm of the attention output; a post-LN model (BERT) has ``ln1``, a
    LayerNorm of ``resid_pre`` plus the attention output (it centres and adds a bias). Either way a head's
    write ``w`` reaches the stream as ``gain ⊙ C(w) / s`` with ``s`` the norm's ``hook_scale`` (``scale_hook``).
    """
    norm = post_norm_map(model, layer, "attn")  # probes the norm module: the gain whatever the convention
    if norm.is_identity:
        return None
    if norm.center and post_ln_reason(model) is None:
        raise UnsupportedArchitectureError(
            f"The post-attention norm of layer {layer} centres its input (a LayerNorm of the attention output alone); "
            "sinklens maps head outputs through RMS post-norms, and through the LayerNorm of a post-LN block."
        )
    return norm


def post_attention_scale_hooks(model: Any, layers: Sequence[int]) -> dict[int, str]:
    """``{layer: hook}``: the ``hook_scale`` of each layer's post-attention norm (:func:`post_attention_map`);
    layers without one are left out."""
    norms = {layer: post_attention_map(model, layer) for layer in layers}
    return {layer: norm.scale_hook for layer, norm in norms.items() if norm is not None}


def post_attention_gain(model: Any, layer: int) -> Float[Tensor, " d_model"] | None:
    """The effective per-dimension gain ``g`` of ``layer``'s post-attention norm, or None if it has none.

    The norm is :func:`post_attention_map`'s. The gain is read by probing the norm module itself, so it
    is the gain the model applies whatever the weight convention (Gemma stores ``w`` and multiplies by
    ``1 + w``; TransformerLens 3.x stores ``1 + w``).

    Examples:
        >>> from sinklens.testing.zoo import zoo_model
        >>> post_attention_gain(zoo_model("gemma2"), 0)[:3]  # Gemma initialises w = 0: gain 1 + 0
        tensor([1., 1., 1.])
        >>> post_attention_gain(zoo_model("llama"), 0) is None
        True
    """
    norm = post_attention_map(model, layer)
    return None if norm is None else norm.gain.float().cpu()


def attention_output_grams(model: Any, layers: Sequence[int]) -> tuple[Float[Tensor, "layer head d_head d_head"], Float[Tensor, "layer head d_head d_head"]]:
    """Float64 Gram matrices ``W_O[h] W_O[h]ᵀ`` and, in residual units, ``M_h M_hᵀ`` per layer.

    ``M_h = C(W_O[h]) diag(g)``, with ``g`` the post-attention norm's gain and ``C`` its mean removal over
    ``d_model`` when it centres (:func:`post_attention_map`; ``M_h = W_O[h]`` without a post-attention norm),
    so ``‖z W_O[h]‖² = z G zᵀ``.
    Computed one layer at a time from :func:`~sinklens.hooks.layer_weight` (no stacked ``W_O``), on the
    model's device, and kept until the weights change (:func:`~sinklens.hooks.weight_cached`); callers get copies.
    """

    def compute() -> tuple[Tensor, Tensor]:
        device, grams, grams_res = model_device(model), [], []
        for layer in layers:
            w_o = layer_weight(model, "W_O", layer).to(device, torch.float64)  # [head, d_head, d_model]
            grams.append(w_o @ w_o.transpose(-1, -2))
            norm = post_attention_map(model, layer)
            if norm is None:  # no post norm: the residual-unit map is W_O itself
                grams_res.append(grams[-1])
            else:
                m_res = w_o - w_o.mean(-1, keepdim=True) if norm.center else w_o
                m_res = m_res * norm.gain.to(device, torch.float64)
                grams_res.append(m_res @ m_res.transpose(-1, -2))
        return torch.stack(grams), torch.stack(grams_res)

    gram, gram_res = weight_cached(model, ("attention_output_grams", tuple(layers)), compute)
    return gram.clone(), gram_res.clone()
