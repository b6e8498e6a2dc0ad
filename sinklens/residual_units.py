"""Residual units: what a write inside a block actually adds to the residual stream.

In a pre-norm block (Llama, GPT-2, ...) the attention output ``z W_O (+ b_O)`` and the MLP output
``post W_out (+ b_out)`` are added to the residual stream as they are. A **post-norm** block (Gemma 2
and 3) normalises each output before the residual add: ``blocks.{l}.ln1_post`` after attention and
``blocks.{l}.ln2_post`` after the MLP. At one position such a norm is an *affine* map once its scale
is known::

    y = gain ⊙ C(x) / scale + bias

with ``x`` the norm's input (the raw block output), ``C`` the identity (RMSNorm) or mean removal
(LayerNorm), ``scale = blocks.{l}.ln{1,2}_post.hook_scale`` at that position
(``hook_normalized = C(x) / hook_scale``), ``gain`` the effective per-dimension gain (Gemma's
``1 + w``, found by running the norm module on a probe vector) and ``bias`` the norm's bias.

So if ``x = Σ_n c_n + b`` (neurons ``c_n = post_n W_out[n]``), each neuron's write in residual units is
``linear(c_n, scale)`` and the norm's output (``hook_mlp_out`` / ``hook_attn_out``) is exactly
``Σ_n linear(c_n, scale) + linear(b, scale) + bias``. Without a post norm the map is the identity.

A **post-LN** block (BERT) normalises the residual *plus* each output, ``ln1(resid_pre + attn_out)`` and
``ln2(resid_mid + mlp_out)``: the same affine map of the output plus the residual's own term, so
:func:`post_norm_map` gives ``ln1`` / ``ln2`` there. Neuron attribution refuses post-LN models
(:func:`post_ln_reason`).

Examples:
    >>> from sinklens.testing.zoo import zoo_model
    >>> m = post_norm_map(zoo_model("gemma2"), 0, "mlp")
    >>> m.norm, m.scale_hook, m.convention
    ('ln2_post', 'blocks.0.ln2_post.hook_scale', '1+w')
    >>> post_norm_map(zoo_model("llama"), 0, "mlp").is_identity
    True
"""

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

#: The post norm of each block output, relative to ``blocks.{layer}``.
POST_NORMS: dict[str, str] = {"attn": "ln1_post", "mlp": "ln2_post"}


@dataclass(frozen=True, repr=False, eq=False)
class NormMap(CompactRepr):
    """A norm at a fixed position as an affine map: how one block output (``site``: ``"attn"`` or ``"mlp"``)
    of ``layer`` reaches the residual stream through its post norm (:func:`post_norm_map`), or the norm that
    sublayer ``site`` of ``layer`` reads (:func:`input_norm`).

    Attributes:
        layer / site: the block and which of its outputs (or which norm).
        norm: ``"ln1_post"`` / ``"ln2_post"``, or None when the block has no post norm (identity map).
        gain: effective per-dimension gain (``[d_model]``; Gemma: ``1 + w``); None for the identity.
        bias: the norm's additive bias (``[d_model]``, zeros for RMSNorm); None for the identity.
        center: whether the norm removes the mean first (LayerNorm) — a linear step as well.
        convention: ``"none"`` (identity), ``"w"`` (gain = the stored weight) or ``"1+w"`` (Gemma).
        path: the norm's module path (set by :func:`input_norm`: on a post-LN model an input norm is the
            previous block's ``ln2`` or the embedding LayerNorm, not ``blocks.{layer}.{norm}``).
    """

    layer: int
    site: str
    norm: str | None
    gain: Float[Tensor, " d_model"] | None = None
    bias: Float[Tensor, " d_model"] | None = None
    center: bool = False
    convention: str = "none"
    path: str | None = None

    def __hash__(self) -> int:
        """Frozen, so hashable: by its fields other than the tensors (equal maps, by ``==``, hash equal)."""
        return hash((type(self), self.layer, self.site, self.norm, self.center, self.convention, self.path))

    @property
    def is_identity(self) -> bool:
        """True when the output enters the residual stream unchanged (no post norm)."""
        return self.norm is None

    @property
    def scale_hook(self) -> str | None:
        """The hook whose value is the norm's per-position divisor (None for the identity)."""
        if self.norm is None:
            return None
        return f"{self.path}.hook_scale" if self.path else hook_name(self.layer, f"{self.norm}.hook_scale")

    def linear(self, x: Float[Tensor, "*batch d_model"], scale: Tensor | None = None) -> Float[Tensor, "*batch d_model"]:
        """The linear part of the map: what a write ``x`` into the norm's input adds to its output.

        ``scale`` is the ``scale_hook`` value at the same position(s), broadcastable against ``x``
        after a trailing axis is added where it lacks one (``[*batch]`` or ``[*batch, 1]`` as the hook
        gives it). Ignored (may be None) for the identity map.
        """
        if self.norm is None:
            return x
        if scale is None:
            raise InvalidArgumentError(
                f"Block {self.layer}'s {self.site} output passes through the post norm {self.norm}: pass its "
                f"per-position scale (the value of {self.scale_hook}) to map a write into residual units."
            )
        if scale.dim() < x.dim() or scale.shape[-1] != 1:
            scale = scale[..., None]
        if self.center:
            x = x - x.mean(-1, keepdim=True)
        return x * (self.gain.to(x.dtype) / scale.to(x.dtype))

    def offset(self, like: Tensor) -> Float[Tensor, " d_model"]:
        """The norm's own additive term (``bias``; zeros for RMSNorm and for the identity map)."""
        if self.bias is None:
            return torch.zeros(like.shape[-1], dtype=like.dtype, device=like.device)
        return self.bias.to(like.dtype).to(like.device)

    def __call__(self, x: Float[Tensor, "*batch d_model"], scale: Tensor | None = None) -> Float[Tensor, "*batch d_model"]:
        """The whole map of the norm's input ``x`` (the block's raw output): ``linear(x, scale) + bias``."""
        return self.linear(x, scale) + self.offset(x)


#: The name used by the residual-unit maths (a post norm is the common case).
PostNormMap = NormMap


def has_post_norm(model: Any, layer: int, site: Site) -> bool:
    """Whether ``blocks.{layer}``'s ``site`` output passes through a post norm (its ``hook_scale`` exists)."""
    return hook_name(layer, f"{post_norm_name(model, site)}.hook_scale") in model.hook_dict


def post_norm_name(model: Any, site: Site) -> str:
    """The norm that follows a block's ``site`` output: ``ln1_post`` / ``ln2_post`` (Gemma 2/3's sandwich norms);
    on a post-LN model (BERT, :func:`post_ln_reason`) ``ln1`` / ``ln2``, which normalise the residual stream
    *plus* that output. At a fixed position both are affine in the output, so a write ``w`` reaches the stream
    as ``gain ⊙ C(w) / scale`` either way; on a post-LN model the residual's own term and the bias are added
    beside it, and do not depend on the write."""
    norm = _norm_of(site)
    return norm.removesuffix("_post") if post_ln_reason(model) is not None else norm


def _norm_of(site: str) -> str:
    if site not in POST_NORMS:
        raise InvalidArgumentError(f"site must be one of {sorted(POST_NORMS)}, got {site!r}.")
    return POST_NORMS[site]


def _param(module: Any, *names: str) -> Tensor | None:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, Tensor):
            return value.detach()
    return None


def post_norm_map(model: Any, layer: int, site: Site) -> PostNormMap:
    """The :class:`PostNormMap` of ``blocks.{layer}``'s ``site`` output (``"attn"`` or ``"mlp"``).

    The gain convention (``w`` or Gemma's ``1 + w``) and whether the norm centres are found by running
    the norm module on a probe vector of large norm (so its epsilon is negligible) and keeping the one
    candidate that reproduces the module's output; if none does, raises
    :class:`~sinklens.errors.UnsupportedArchitectureError`.
    """
    norm = post_norm_name(model, site)
    if not has_post_norm(model, layer, site):
        return NormMap(layer, site, None)
    return NormMap(layer, site, norm, **_probed_norm(model, hook_name(layer, norm)))


def input_norm_path(model: Any, layer: int, site: Site) -> str:
    """The module path of the norm whose output ``blocks.{layer}``'s ``site`` sublayer reads (see :func:`input_norm`),
    without probing it."""
    _norm_of(site)  # validates site
    hooks = model.hook_dict  # a property that builds a dict on some TransformerLens versions: read it once
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
    """Why the input norm of some ``site`` sublayer (``"attn"`` or ``"mlp"``) cannot be read on ``model`` (no
    normalization at all, ``cfg.normalization_type=None``, or a norm without a ``hook_normalized``), or None when
    every layer's can: what :func:`input_norm_path` would refuse, for a caller that skips rather than fails."""
    try:
        for layer in range(model_dims(model).n_layers):
            input_norm_path(model, layer, site)
    except UnsupportedArchitectureError as err:
        return str(err).rstrip(".")
    return None


def input_norm(model: Any, layer: int, site: Site) -> NormMap:
    """The norm whose output ``blocks.{layer}``'s ``site`` sublayer (``"attn"`` or ``"mlp"``) reads, as a
    :class:`NormMap` probed like :func:`post_norm_map`; its ``path`` is the norm's module path (hooks
    ``{path}.hook_normalized`` / ``.hook_scale``), and ``gain ⊙ hook_normalized + bias`` the norm's output.
    Pre-norm blocks read ``blocks.{l}.ln1`` (attention) and ``blocks.{l}.ln2`` (MLP); on a post-LN block
    (BERT) the attention reads the previous block's ``ln2`` (layer 0: the embedding LayerNorm), the MLP ``ln1``.

    Examples:
        >>> from sinklens.testing.zoo import zoo_model
        >>> input_norm(zoo_model("llama"), 1, "attn").path, input_norm(zoo_model("bert"), 1, "attn").path
        ('blocks.1.ln1', 'blocks.0.ln2')
    """
    path = input_norm_path(model, layer, site)
    return NormMap(layer, site, path.rsplit(".", 1)[-1], path=path, **_probed_norm(model, path))


#: Module paths of a post-LN model's embedding LayerNorm (TransformerLens 4.x bridge, 3.x ``HookedEncoder``).
EMBED_NORMS: tuple[str, ...] = ("embed_ln", "embed.ln")


def _probed_norm(model: Any, path: str) -> dict[str, Any]:
    """Run the norm at module ``path`` on a probe vector: its ``gain``, ``bias``, ``center`` and ``convention``."""
    module = model.get_submodule(path)
    w = _param(module, "w", "weight")
    b = _param(module, "b", "bias")
    d_model = model_dims(model).d_model
    if w is None:
        w = torch.ones(d_model, dtype=torch.float32, device=model_device(model))
    gen = torch.Generator().manual_seed(0)
    # A mean as large as the spread, so that removing it (LayerNorm) or not (RMSNorm) changes the output by O(1),
    # far above the tolerance below even in bfloat16.
    probe = (torch.randn(1, 1, d_model, generator=gen, dtype=torch.float32) + 1.0) * 1e3
    probe = probe.to(device=w.device, dtype=w.dtype)
    # The norm runs in the model's dtype: a bfloat16 output is within a few of its eps (2^-8) of the exact one.
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
        "without mean removal): contributions through this norm cannot be put in residual units."
    )


def mlp_out_bias(model: Any, layer: int) -> Float[Tensor, " d_model"]:
    """``b_out[layer]``, or zeros for a bias-free MLP (TransformerBridge exposes no ``b_out`` then)."""
    return _bias(model, "b_out", layer)


def attn_out_bias(model: Any, layer: int) -> Float[Tensor, " d_model"]:
    """``b_O[layer]``, or zeros for a bias-free attention output."""
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
    """Why this model's MLPs have no per-neuron attribution, or None when they do.

    A mixture-of-experts MLP (``cfg.num_experts``, or router hooks such as ``mlp.hook_router_scores``)
    has no single ``W_out`` per layer and its ``mlp.hook_post`` holds no per-neuron activations (the
    TransformerLens 4.x gpt-oss bridge fires it with the MLP's ``d_model`` output).
    """
    n_experts = getattr(model.cfg, "num_experts", None)
    routed = any(name.startswith("blocks.0.mlp.") and ("router" in name or "expert" in name) for name in model.hook_dict)
    if (n_experts or 0) > 1 or routed:
        return (f"the MLP is a mixture of experts ({n_experts or 'several'} experts per layer, routed per token): "
                "there is no single W_out per layer and mlp.hook_post holds no per-neuron activations, so neurons cannot "
                "be attributed")
    return None


#: Hugging Face model types that normalise *after* the residual add (post-LN, BERT style).
POST_LN_MODEL_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "camembert", "electra", "distilbert", "albert",
                                 "mpnet", "ernie"})


def post_ln_reason(model: Any) -> str | None:
    """Why this model's block outputs do not add up in its residual stream, or None when they do.

    A post-LN model (BERT and its relatives) applies a LayerNorm *after* each residual add, so the stream
    is re-normalised after every sublayer: a write reaches it only through that norm (linearly at a given
    scale, which is how head writes are put in residual units there: :func:`post_norm_map`), and dimension
    paths (each block's step = its attention plus MLP output) would not mean what they mean on a pre-norm
    model. Detected from the Hugging Face ``model_type`` behind a bridge, or a TransformerLens 3.x
    ``HookedEncoder``.
    """
    config = getattr(getattr(model, "original_model", None), "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in POST_LN_MODEL_TYPES or type(model).__name__ == "HookedEncoder":
        return (f"the model ({model_type or type(model).__name__}) normalises after each residual add (post-LN), so "
                "its residual stream is re-normalised by every block instead of summing the blocks' writes: the "
                "neuron paths that build the sink's massive dimensions step by step do not exist there")
    return None


def no_mlp_reason(model: Any) -> str | None:
    """Why ``model`` has no neurons at all (an attention-only model: TransformerLens 3.x keeps ``cfg.d_mlp`` at its
    default when ``cfg.attn_only`` is set, so both are read), or None when its blocks have MLPs."""
    if model_dims(model).d_mlp <= 0:
        return "the model has no MLP (attention-only: cfg.attn_only, or cfg.d_mlp 0), so there are no neurons"
    return None


def neuron_reason(model: Any) -> str | None:
    """Why neurons cannot be attributed in residual units on ``model`` (no MLP, mixture of experts or post-LN), or None."""
    return no_mlp_reason(model) or moe_reason(model) or post_ln_reason(model)


def check_neuron_mlp(model: Any) -> None:
    """Raise :class:`~sinklens.errors.UnsupportedArchitectureError` if the model's MLPs are not per-neuron
    attributable in residual units (see :func:`moe_reason` and :func:`post_ln_reason`)."""
    reason = neuron_reason(model)
    if reason is not None:
        raise UnsupportedArchitectureError(f"Neuron attribution is not supported for this model: {reason}.")
