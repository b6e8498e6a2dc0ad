"""Residual units: what a write inside a block adds to the residual stream. A post norm (Gemma's ``ln1_post``/
``ln2_post``; ``ln1``/``ln2`` on post-LN BERT) is affine at one position, ``y = gain ⊙ C(x) / scale + bias``
(``C``: mean removal for LayerNorm; ``scale``: its ``hook_scale``), so a write ``c`` counts as ``linear(c, scale)``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.display import CompactRepr
from sinklens.errors import InvalidArgumentError, UnsupportedArchitectureError
from sinklens.hooks import hook_name, hooks_silenced, model_device, model_dims

Site = Literal["attn", "mlp"]

#: Module paths of a post-LN model's embedding LayerNorm (TransformerLens 4.x bridge, 3.x ``HookedEncoder``).
EMBED_NORMS: tuple[str, ...] = ("embed_ln", "embed.ln")
#: Hugging Face model types that normalise *after* the residual add (post-LN, BERT style).
POST_LN_MODEL_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "camembert", "electra", "distilbert", "albert",
                                 "mpnet", "ernie"})


@dataclass(frozen=True, repr=False, eq=False)
class NormMap(CompactRepr):
    """A norm at a fixed position as an affine map. ``norm`` None: the identity; ``center``: LayerNorm's mean
    removal; ``convention``: ``"none"``, ``"w"`` or ``"1+w"`` (Gemma); ``path``: the module path when it is not
    ``blocks.{layer}.{norm}``."""

    layer: int
    site: str
    norm: str | None
    gain: Float[Tensor, " d_model"] | None = None
    bias: Float[Tensor, " d_model"] | None = None
    center: bool = False
    convention: str = "none"
    path: str | None = None

    def __hash__(self) -> int:
        return hash((type(self), self.layer, self.site, self.norm, self.center, self.convention, self.path))

    @property
    def is_identity(self) -> bool:
        return self.norm is None

    @property
    def scale_hook(self) -> str | None:
        """The hook whose value is the norm's per-position divisor (None for the identity)."""
        if self.norm is None:
            return None
        return f"{self.path}.hook_scale" if self.path else hook_name(self.layer, f"{self.norm}.hook_scale")

    def linear(self, x: Float[Tensor, "*batch d_model"], scale: Tensor | None = None) -> Float[Tensor, "*batch d_model"]:
        """What a write ``x`` into the norm's input adds to its output, at the ``scale_hook`` value ``scale``."""
        if self.norm is None:
            return x
        if scale is None:
            raise InvalidArgumentError(
                f"Block {self.layer}'s {self.site} output passes through the post norm {self.norm}: pass its "
                f"per-position scale (the value of {self.scale_hook}) to map a write into residual units.")
        if scale.dim() < x.dim() or scale.shape[-1] != 1:
            scale = scale[..., None]
        if self.center:
            x = x - x.mean(-1, keepdim=True)
        return x * (self.gain.to(x.dtype) / scale.to(x.dtype))

    def offset(self, like: Tensor) -> Float[Tensor, " d_model"]:
        """The norm's own additive term (zeros for RMSNorm and the identity)."""
        return like.new_zeros(like.shape[-1]) if self.bias is None else self.bias.to(like.device, like.dtype)

    def __call__(self, x: Float[Tensor, "*batch d_model"], scale: Tensor | None = None) -> Float[Tensor, "*batch d_model"]:
        """``linear(x, scale) + bias`` for the block's raw output ``x``."""
        return self.linear(x, scale) + self.offset(x)


def _param(module: Any, *names: str) -> Tensor | None:
    return next((v.detach() for name in names if isinstance(v := getattr(module, name, None), Tensor)), None)


def post_norm_map(model: Any, layer: int, site: Site) -> NormMap:
    """The :class:`NormMap` of ``blocks.{layer}``'s ``site`` output (``ln1``/``ln2`` on post-LN models, which
    normalise residual plus output); gain convention and centring are probed (:func:`_probed_norm`)."""
    norm = ("ln1" if site == "attn" else "ln2") + ("" if post_ln_reason(model) is not None else "_post")
    if hook_name(layer, f"{norm}.hook_scale") not in model.hook_dict:
        return NormMap(layer, site, None)
    return NormMap(layer, site, norm, **_probed_norm(model, hook_name(layer, norm)))


def input_norm_path(model: Any, layer: int, site: Site) -> str:
    """The module path of the norm that ``blocks.{layer}``'s ``site`` sublayer reads (:func:`input_norm`)."""
    hooks = model.hook_dict  # built on each read on some TransformerLens versions
    if post_ln_reason(model) is None:
        path = f"blocks.{layer}.{'ln1' if site == 'attn' else 'ln2'}"
    elif site == "mlp":
        path = f"blocks.{layer}.ln1"
    elif layer > 0:
        path = f"blocks.{layer - 1}.ln2"
    else:
        path = next((p for p in EMBED_NORMS if f"{p}.hook_normalized" in hooks), None)
        if path is None:
            raise UnsupportedArchitectureError(
                "This post-LN model exposes no embedding LayerNorm hook (looked for "
                f"{[p + '.hook_normalized' for p in EMBED_NORMS]}), so layer 0's attention input norm cannot be read.")
    if f"{path}.hook_normalized" not in hooks:
        if getattr(model.cfg, "normalization_type", "") is None:
            raise UnsupportedArchitectureError(
                f"This model has no normalization (cfg.normalization_type=None): block {layer}'s {site} reads the raw "
                "residual, so there is no norm input to measure (normalized disparity, the MLP input at the sink).")
        raise UnsupportedArchitectureError(f"Block {layer}'s {site} reads {path}, which has no hook {path}.hook_normalized.")
    return path


def input_norm_reason(model: Any, site: Site) -> str | None:
    """Why some layer's ``site`` input norm cannot be read (what :func:`input_norm_path` refuses), or None."""
    try:
        for layer in range(model_dims(model).n_layers):
            input_norm_path(model, layer, site)
    except UnsupportedArchitectureError as err:
        return str(err).rstrip(".")
    return None


def input_norm(model: Any, layer: int, site: Site) -> NormMap:
    """The :class:`NormMap` of the norm ``blocks.{layer}``'s ``site`` reads: ``ln1``/``ln2``; on post-LN blocks the
    attention reads the previous ``ln2`` (layer 0: the embedding LayerNorm) and the MLP ``ln1``."""
    path = input_norm_path(model, layer, site)
    return NormMap(layer, site, path.rsplit(".", 1)[-1], path=path, **_probed_norm(model, path))


def _probed_norm(model: Any, path: str) -> dict[str, Any]:
    """The ``gain``, ``bias``, ``center`` and ``convention`` that reproduce the norm at ``path`` on a probe vector
    (gain ``w`` or ``1 + w``, with or without mean removal); none fitting raises."""
    module = model.get_submodule(path)
    w, b = _param(module, "w", "weight"), _param(module, "b", "bias")
    d_model = model_dims(model).d_model
    if w is None:
        w = torch.ones(d_model, dtype=torch.float32, device=model_device(model))
    gen = torch.Generator().manual_seed(0)
    # A mean as large as the spread: removing it or not changes the output by O(1), above tol even in bfloat16.
    probe = ((torch.randn(1, 1, d_model, generator=gen) + 1.0) * 1e3).to(device=w.device, dtype=w.dtype)
    tol = max(1e-3, 4 * torch.finfo(w.dtype).eps) if w.dtype.is_floating_point else 1e-3
    with torch.inference_mode(), hooks_silenced(module):
        out = module(probe).float()[0, 0]
    p = probe.float()[0, 0]
    bias = torch.zeros(d_model, device=w.device, dtype=torch.float32) if b is None else b.float()
    for center in (False, True):
        x = p - p.mean() if center else p
        scale = x.square().mean().sqrt()
        for convention, gain in (("w", w.float()), ("1+w", 1.0 + w.float())):
            expected = gain * x / scale + bias
            if torch.allclose(expected, out, rtol=tol, atol=tol * float(out.abs().max()) + 1e-6):
                return {"gain": gain, "bias": bias, "center": center, "convention": convention}
    raise UnsupportedArchitectureError(
        f"Cannot express {path} as gain ⊙ x / scale + bias (tried gain = w and 1 + w, with and "
        "without mean removal): contributions through this norm cannot be put in residual units.")


def mlp_out_bias(model: Any, layer: int) -> Float[Tensor, " d_model"]:
    """``b_out[layer]``, or zeros for a bias-free MLP."""
    return _bias(model, "b_out", layer)


def attn_out_bias(model: Any, layer: int) -> Float[Tensor, " d_model"]:
    """``b_O[layer]``, or zeros without that bias."""
    return _bias(model, "b_O", layer)


def _bias(model: Any, name: str, layer: int) -> Tensor:
    try:
        b = getattr(model, name)
    except (AttributeError, TypeError):  # TypeError: the 3.9 bridge stacks the blocks' missing (None) biases
        b = None
    if b is None:
        return torch.zeros(model_dims(model).d_model, device=model_device(model))
    return b[layer].detach()


def moe_reason(model: Any) -> str | None:
    """Why the MLPs have no per-neuron attribution (mixture of experts), or None."""
    n_experts = getattr(model.cfg, "num_experts", None)
    routed = any(name.startswith("blocks.0.mlp.") and ("router" in name or "expert" in name) for name in model.hook_dict)
    if (n_experts or 0) > 1 or routed:
        return (f"the MLP is a mixture of experts ({n_experts or 'several'} experts per layer, routed per token): there "
                "is no single W_out per layer nor per-neuron mlp.hook_post, so neurons cannot be attributed")
    return None


def post_ln_reason(model: Any) -> str | None:
    """Why block outputs do not add up in the residual stream (post-LN: BERT and relatives), or None."""
    config = getattr(getattr(model, "original_model", None), "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in POST_LN_MODEL_TYPES or type(model).__name__ == "HookedEncoder":
        return (f"the model ({model_type or type(model).__name__}) normalises after each residual add (post-LN), so "
                "its residual stream does not sum the blocks' writes and the neuron paths that build the sink's "
                "massive dimensions step by step do not exist there")
    return None


def no_mlp_reason(model: Any) -> str | None:
    """Why ``model`` has no MLP (``d_mlp <= 0``, e.g. attention-only), or None."""
    no_mlp = model_dims(model).d_mlp <= 0
    return "the model has no MLP (attention-only: cfg.attn_only, or cfg.d_mlp 0), so there are no neurons" if no_mlp else None


def neuron_reason(model: Any) -> str | None:
    """Why neurons cannot be attributed in residual units (no MLP, mixture of experts or post-LN), or None."""
    return no_mlp_reason(model) or moe_reason(model) or post_ln_reason(model)


def check_neuron_mlp(model: Any) -> None:
    """Raise :class:`~sinklens.errors.UnsupportedArchitectureError` unless :func:`neuron_reason` is None."""
    if (reason := neuron_reason(model)) is not None:
        raise UnsupportedArchitectureError(f"Neuron attribution is not supported for this model: {reason}.")
