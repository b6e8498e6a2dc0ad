"""Test-only models: a post-norm zoo model with a planted super neuron, and a TransformerLens 3.x encoder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from sinklens.testing.models import transformer_lens_major
from support.zoo import POST_NORM_FAMILIES, FamilyUnavailableError, zoo_model


@dataclass(frozen=True)
class PostNormPlantedSpec:
    """Where :func:`planted_post_norm_model` planted its neurons (the answers a test expects).

    Attributes:
        family: the zoo family (``gemma2`` or ``gemma3``).
        layer / neuron: the super neuron; its block's post-MLP norm multiplies ``dim`` by ``gain``.
        decoy_layer / decoy_neuron: a neuron whose raw write at the sink is ``decoy_ratio`` times the super
            neuron's, behind a post-MLP gain of ``decoy_gain`` (small) on ``dim``.
        dim: the massive residual dimension; ``bos_dim``: the BOS-only direction both neurons read.
    """

    family: str
    layer: int
    neuron: int
    decoy_layer: int
    decoy_neuron: int
    dim: int
    bos_dim: int
    gain: float
    decoy_gain: float
    decoy_ratio: float


def planted_post_norm_model(
    family: Literal["gemma2", "gemma3"] = "gemma2",
    *,
    n_layers: int = 2,
    seed: int = 0,
    layer: int = 0,
    neuron: int = 7,
    decoy_layer: int = 1,
    decoy_neuron: int = 11,
    dim: int = 5,
    bos_dim: int = 2,
    gain: float = 250.0,
    decoy_gain: float = 0.01,
    decoy_ratio: float = 10.0,
) -> tuple[Any, PostNormPlantedSpec]:
    """A zoo post-norm model (:func:`support.zoo.zoo_model`) with a super neuron behind a large post-norm gain.

    Planted in the Hugging Face weights (Gemma RMSNorm gain ``1 + w``): a BOS-only ``bos_dim``; the super neuron
    reads it and writes ``dim``, and block ``layer``'s ``post_feedforward_layernorm`` has gain ``gain`` on ``dim``;
    the decoy writes ``dim`` with a raw ``act × W_out`` ``decoy_ratio`` times larger but behind gain ``decoy_gain``:
    an activation-times-weight ranking puts it first, a residual-unit ranking last. Raises
    :class:`~support.zoo.FamilyUnavailableError` under TransformerLens 3.x.

    Examples:
        >>> model, spec = planted_post_norm_model("gemma2")
        >>> _, cache = model.run_with_cache(model.to_tokens("t3 t4 t5"), names_filter="blocks.1.hook_resid_pre")
        >>> resid = cache["blocks.1.hook_resid_pre"][0]
        >>> bool(resid[0, 5].abs() > 100), float(resid[1:, 5].abs().max())
        (True, 0.0)
    """
    if family not in POST_NORM_FAMILIES:
        raise ValueError(f"family must be a post-norm zoo family {list(POST_NORM_FAMILIES)}, got {family!r}.")
    if transformer_lens_major() < 4:
        raise FamilyUnavailableError("planted_post_norm_model edits the Hugging Face weights of a TransformerBridge "
                                     "(TransformerLens 4.x).")
    if not 0 <= layer < n_layers - 1 or not 0 <= decoy_layer < n_layers or decoy_layer == layer:
        raise ValueError(f"layer={layer} must leave a later layer and differ from decoy_layer={decoy_layer} "
                         f"(both in [0, {n_layers})).")
    if dim == bos_dim:
        raise ValueError(f"dim and bos_dim must differ, got {dim}.")
    model = zoo_model(family, n_layers=n_layers, seed=seed)
    hf = model.original_model.model
    layers = hf.layers
    protected = [bos_dim, dim]
    bos = model.tokenizer.bos_token_id
    with torch.no_grad():
        W_E = hf.embed_tokens.weight
        typical = float(W_E.norm(dim=-1).mean())
        W_E[:, protected] = 0.0
        W_E[bos, bos_dim] = 4.0 * typical
        for block in layers:  # nothing but the plants writes into the protected dims
            block.self_attn.o_proj.weight[protected, :] = 0.0
            block.mlp.down_proj.weight[protected, :] = 0.0

        def reader(block: int, n: int, write: float) -> None:
            mlp = layers[block].mlp
            for proj in (mlp.gate_proj, mlp.up_proj):  # weight [d_mlp, d_model]
                proj.weight[n, :] = 0.0
                proj.weight[n, bos_dim] = 3.0
            mlp.down_proj.weight[:, n] = 0.0  # weight [d_model, d_mlp]
            mlp.down_proj.weight[dim, n] = write

        reader(layer, neuron, 1.0)
        reader(decoy_layer, decoy_neuron, 1.0)
        layers[layer].post_feedforward_layernorm.weight[dim] = gain - 1.0  # Gemma RMSNorm multiplies by 1 + w
        layers[decoy_layer].post_feedforward_layernorm.weight[dim] = decoy_gain - 1.0
        names = [f"blocks.{layer}.mlp.hook_post", f"blocks.{decoy_layer}.mlp.hook_post"]
        _, cache = model.run_with_cache(torch.tensor([[bos]]), names_filter=lambda n: n in names)
        act, decoy_act = float(cache[names[0]][0, 0, neuron]), float(cache[names[1]][0, 0, decoy_neuron])
        layers[decoy_layer].mlp.down_proj.weight[dim, decoy_neuron] = decoy_ratio * act / decoy_act
    spec = PostNormPlantedSpec(family, layer, neuron, decoy_layer, decoy_neuron, dim, bos_dim, gain, decoy_gain,
                               decoy_ratio)
    return model, spec


def tl3_encoder() -> Any:
    """A TransformerLens 3.x ``HookedEncoder`` (post-LN BERT blocks) built from a config, with seeded weights
    (3.x leaves a config-built encoder's parameters uninitialised) and non-trivial LayerNorm gains and biases.
    Under 3.x its ``hook_attn_out`` is the raw attention write and ``hook_resid_mid`` is ``resid_pre`` plus it,
    before ``ln1``: the opposite of the 4.x bridge, which fires both after a LayerNorm."""
    import warnings

    from transformer_lens import HookedEncoder, HookedTransformerConfig

    cfg = HookedTransformerConfig(n_layers=2, d_model=16, n_heads=4, d_head=4, d_mlp=32, n_ctx=64, d_vocab=64,
                                  act_fn="gelu", normalization_type="LN", original_architecture="BertForMaskedLM",
                                  attention_dir="bidirectional")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.x points encoder users to 4.x
        model = HookedEncoder(cfg, move_to_device=False)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln" in f".{name}":
                p.copy_((1.0 if name.endswith(".w") else 0.0) + 0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.05))
    return model.eval()
