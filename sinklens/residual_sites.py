"""Where each block's attention write and the residual right after it are read, with one meaning on every
architecture (sequential, sandwich-norm, parallel and post-LN blocks) and TransformerLens 3.x and 4.x."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from sinklens.hooks import ATTN_OUT, RESID_MID, RESID_PRE, Z, check_hook_names, hook_name, layer_weight
from sinklens.probes import resid_mid_is_a_copy, silent_hooks
from sinklens.options import HookFn
from sinklens.residual_units import attn_out_bias, input_norm, post_ln_reason, post_norm_map

__all__ = ["after_attention_hooks", "attention_write_hooks", "has_resid_mid", "on_the_residual_stream"]


def has_resid_mid(model: Any, layers: Sequence[int]) -> bool:
    """True when every one of ``layers`` has a ``hook_resid_mid`` that runs (probed on the first): False for a
    parallel block (GPT-NeoX/Pythia, GPT-J)."""
    mid = [hook_name(layer, RESID_MID) for layer in layers]
    return all(name in model.hook_dict for name in mid) and not silent_hooks(model, mid[:1])


def on_the_residual_stream(model: Any, hooks: Sequence[tuple[str, HookFn]]) -> list[tuple[str, HookFn]]:
    """``hooks`` with every ``hook_resid_mid`` edit ``f`` moved where it reaches the residual stream: where that
    hook is a copy (:func:`~sinklens.probes.resid_mid_is_a_copy`), the attention write ``w`` becomes
    ``w + f(r + w) − (r + w)`` at ``hook_attn_out`` (``r`` = ``hook_resid_pre``). ``f`` may return None."""
    hooks = list(hooks)
    if (not any(name.endswith("." + RESID_MID) for name, _ in hooks) or post_ln_reason(model) is not None
            or not resid_mid_is_a_copy(model)):
        return hooks
    return [pair for name, fn in hooks for pair in (
        _edit_through_the_write(name[: -len(RESID_MID)], model.hook_dict[name], fn)
        if name.endswith("." + RESID_MID) else [(name, fn)])]


def _edit_through_the_write(block: str, mid_hook: Any, fn: HookFn) -> list[tuple[str, HookFn]]:
    """The two hooks of :func:`on_the_residual_stream` for one block (``block`` = ``"blocks.l."``)."""
    block_input: list[Tensor] = []
    def keep(act: Tensor, hook: Any) -> None:
        block_input.append(act)
    def write(act: Tensor, hook: Any) -> Tensor:
        resid = block_input.pop() + act
        edited = fn(resid, hook=mid_hook)
        return act + ((resid if edited is None else edited) - resid)
    return [(block + RESID_PRE, keep), (block + ATTN_OUT, write)]


def after_attention_hooks(model: Any, layers: Sequence[int], consume: Callable[[int, Tensor], None]) -> list[tuple[str, HookFn]]:
    """Hooks that call ``consume(layer, x)`` with each layer's residual right after its attention write:
    ``hook_resid_mid``; ``hook_resid_pre + hook_attn_out`` in a parallel block; ``ln1``'s output in a post-LN one."""
    if post_ln_reason(model) is not None:
        maps = {layer: input_norm(model, layer, "mlp") for layer in layers}
        def normed(act: Tensor, layer: int) -> None:
            consume(layer, act * maps[layer].gain.to(act.device, act.dtype) + maps[layer].offset(act))
        return [(f"{maps[layer].path}.hook_normalized", lambda act, hook, layer=layer: normed(act, layer)) for layer in layers]
    if has_resid_mid(model, layers):
        return [(hook_name(layer, RESID_MID), lambda act, hook, layer=layer: consume(layer, act)) for layer in layers]
    check_hook_names(model, [hook_name(layer, site) for layer in layers for site in (RESID_PRE, ATTN_OUT)])
    block_input: dict[int, Tensor] = {}
    def keep(act: Tensor, layer: int) -> None:
        block_input[layer] = act
    return [hook for layer in layers for hook in (
        (hook_name(layer, RESID_PRE), lambda act, hook, layer=layer: keep(act, layer)),
        (hook_name(layer, ATTN_OUT),
         lambda act, hook, layer=layer: consume(layer, block_input.pop(layer) + act)))]


def attention_write_hooks(model: Any, layers: Sequence[int], consume: Callable[[int, Tensor], None]) -> list[tuple[str, HookFn]]:
    """Hooks that call ``consume(layer, w)`` with each attention write where it reaches the residual stream:
    ``hook_attn_out``, or on a post-LN block ``z·W_O + b_O`` mapped through ``ln1`` at its scale."""
    if post_ln_reason(model) is None:
        return [(hook_name(layer, ATTN_OUT), lambda act, hook, layer=layer: consume(layer, act)) for layer in layers]
    maps = {layer: post_norm_map(model, layer, "attn") for layer in layers}
    raw: dict[int, Tensor] = {}
    def write(z: Tensor, layer: int) -> None:  # [batch, pos, head, d_head]
        w_o = layer_weight(model, "W_O", layer).to(z.device, z.dtype)  # [head, d_head, d_model]
        raw[layer] = torch.einsum("bphd,hdm->bpm", z, w_o) + attn_out_bias(model, layer).to(z.device, z.dtype)
    return [hook for layer in layers for hook in (
        (hook_name(layer, Z), lambda act, hook, layer=layer: write(act, layer)),
        (maps[layer].scale_hook,
         lambda act, hook, layer=layer: consume(layer, maps[layer].linear(raw.pop(layer), act))))]
