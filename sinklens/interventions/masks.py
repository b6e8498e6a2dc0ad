"""Attention-mask interventions: hooks on ``attn.hook_attn_scores`` that set hidden keys to ``-inf``. Every query
keeps its own key, so each pattern row still sums to 1; queries are absolute positions (fewer queries than keys:
the last ones). Models whose attention hooks fire after the fact are refused."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Union

import numpy as np

import torch
from torch import Tensor

from sinklens.errors import InvalidArgumentError
from sinklens.hooks import SCORES, hook_name, model_dims
from sinklens.probes import require_attention_seams
from sinklens.options import HookFn
from sinklens.validate import index_list, optional_index_list
from sinklens.visibility import attention_visibility

Hooks = list[tuple[str, HookFn]]
# What sinklens.validate's as_int, index_list (one index or several) and as_float accept (0-d tensors included).
IntLike = Union[numbers.Integral, Tensor]
IndexLike = Union[numbers.Integral, Tensor, np.ndarray, Sequence[Any]]
NumberLike = Union[numbers.Real, Tensor]


def positions_arg(positions: Any, n_ctx: int) -> list[int]:
    return index_list(positions, n_ctx, what="position", allow_negative=False)


def layers_arg(layers: Any, n_layers: int) -> list[int]:
    return optional_index_list(layers, n_layers, what="layer")


def heads_arg(heads: Any, n_heads: int) -> list[int] | None:
    return None if heads is None else index_list(heads, n_heads, what="head", allow_negative=False)


def check_in_sequence(positions: Sequence[int], seq_len: int) -> None:
    """Raise :class:`InvalidArgumentError` if a position lies beyond a sequence of ``seq_len`` tokens."""
    if bad := [p for p in positions if p >= seq_len]:
        raise InvalidArgumentError(
            f"Position {bad[0]} is out of range for a sequence of {seq_len} tokens (0..{seq_len - 1}).")


def _block_scores(scores: Tensor, blocked: Tensor, head_list: list[int] | None) -> Tensor:
    """``scores`` with the ``blocked`` entries set to ``-inf`` in the heads ``head_list`` (None: all)."""
    if head_list is not None:
        blocked = blocked & torch.isin(torch.arange(scores.shape[1], device=scores.device),
                                       torch.tensor(head_list, device=scores.device))[:, None, None]
    return scores.masked_fill(blocked, float("-inf"))


def _mask_hooks(model: Any, positions: IndexLike, block: Callable[[list[int], Tensor, int], Tensor], *,
                layers: IndexLike | None, heads: IndexLike | None) -> Hooks:
    """Hooks setting the ``block(positions, query_positions, n_key)`` ``[query, key]`` scores to ``-inf``."""
    dims = model_dims(model)
    pos = positions_arg(positions, dims.n_ctx)
    require_attention_seams(model, "mask interventions")
    layer_list = layers_arg(layers, dims.n_layers)
    head_list = heads_arg(heads, dims.n_heads)
    bridge = getattr(model, "original_model", None) is not None
    longest = [0]  # the most keys a forward through these hooks has shown them

    def fn(scores: Tensor, hook: Any) -> Tensor:  # scores: [batch, head, query, key]
        n_q, n_k = scores.shape[-2:]
        if bridge and n_q == n_k == 1 and longest[0] > 1:
            raise InvalidArgumentError(
                f"{hook.name} shows one query and one key after a forward of {longest[0]} keys: a generate() step with "
                "a KV cache, whose earlier keys the 4.x bridge leaves out of hook_attn_scores, so no mask can act on it. "
                "Generate with use_past_kv_cache=False (or attach fresh hooks for a separate 1-token forward).")
        longest[0] = max(longest[0], n_k)
        check_in_sequence(pos, n_k)
        q_pos = torch.arange(n_k - n_q, n_k, device=scores.device)
        blocked = block(pos, q_pos, n_k).to(scores.device)  # [query, key]
        blocked = blocked & (torch.arange(n_k, device=scores.device)[None, :] != q_pos[:, None])  # own key kept
        return _block_scores(scores, blocked, head_list)

    return [(hook_name(layer, SCORES), fn) for layer in layer_list]


def self_only(model: Any, *, positions: IndexLike, layers: IndexLike | None = None, heads: IndexLike | None = None) -> Hooks:
    """Make each token at ``positions`` attend only to itself: it aggregates one value, like the first token."""

    def block(pos: list[int], q_pos: Tensor, n_k: int) -> Tensor:
        return torch.isin(q_pos, torch.tensor(pos, device=q_pos.device))[:, None].expand(-1, n_k)

    return _mask_hooks(model, positions, block, layers=layers, heads=heads)


def restart(model: Any, *, positions: IndexLike, layers: IndexLike | None = None, heads: IndexLike | None = None) -> Hooks:
    """A restart mask: queries ``q >= k`` cannot see keys ``< k``, so ``k`` acts as a new first token (several
    positions cut independent segments; in an encoder the cut goes both ways)."""
    both_ways = not attention_visibility(model).causal

    def block(pos: list[int], q_pos: Tensor, n_k: int) -> Tensor:
        k_pos = torch.arange(n_k, device=q_pos.device)
        out = torch.zeros(q_pos.numel(), n_k, dtype=torch.bool, device=q_pos.device)
        for k in pos:  # causal: later queries lose earlier keys; both ways: also earlier queries lose later keys
            q_after, k_after = q_pos[:, None] >= k, k_pos[None, :] >= k
            out |= (q_after != k_after) if both_ways else (q_after & ~k_after)
        return out

    return _mask_hooks(model, positions, block, layers=layers, heads=heads)


def block_keys(model: Any, *, positions: IndexLike, layers: IndexLike | None = None, heads: IndexLike | None = None) -> Hooks:
    """Hide the keys at ``positions`` from every later query (``positions=0`` removes the sink); the blocked
    token still sees itself, and the attention it received is redistributed over the other keys."""

    def block(pos: list[int], q_pos: Tensor, n_k: int) -> Tensor:
        cols = torch.isin(torch.arange(n_k, device=q_pos.device), torch.tensor(pos, device=q_pos.device))
        return cols[None, :].expand(q_pos.numel(), -1)

    return _mask_hooks(model, positions, block, layers=layers, heads=heads)


def custom_mask(model: Any, allowed: Tensor, *, layers: IndexLike | None = None, heads: IndexLike | None = None) -> Hooks:
    """Apply a boolean mask ``allowed[..., q, k]`` (``[query, key]``, ``[head, query, key]`` or
    ``[batch, head, query, key]`` over absolute positions; a shorter run uses its top-left block). Keys the
    model hides stay hidden; a row with no visible key raises :class:`~sinklens.errors.InvalidArgumentError`."""
    if not isinstance(allowed, Tensor) or allowed.dtype != torch.bool:
        raise InvalidArgumentError(f"allowed must be a bool tensor, got {getattr(allowed, 'dtype', type(allowed).__name__)}.")
    if allowed.ndim not in (2, 3, 4) or allowed.shape[-1] != allowed.shape[-2]:
        raise InvalidArgumentError(f"allowed must have shape [query, key], [head, query, key] or [batch, head, query, "
                                   f"key] with query == key, got {tuple(allowed.shape)}.")
    dims = model_dims(model)
    if allowed.ndim >= 3 and allowed.shape[-3] not in (1, dims.n_heads):
        raise InvalidArgumentError(f"allowed has {allowed.shape[-3]} heads; the model has {dims.n_heads} (or pass 1 to broadcast).")
    require_attention_seams(model, "mask interventions")
    layer_list = layers_arg(layers, dims.n_layers)
    head_list = heads_arg(heads, dims.n_heads)
    visibility = attention_visibility(model)

    def fn(scores: Tensor, hook: Any, layer: int) -> Tensor:
        n_q, n_k = scores.shape[-2:]
        if allowed.shape[-1] < n_k:
            raise InvalidArgumentError(f"allowed is {tuple(allowed.shape)} but the run has {n_k} positions: the last two "
                                       f"dims must be at least ({n_k}, {n_k}) (a larger mask is cut to the run's).")
        if allowed.ndim == 4 and allowed.shape[0] not in (1, scores.shape[0]):
            raise InvalidArgumentError(f"allowed has batch size {allowed.shape[0]}, the run has {scores.shape[0]}.")
        mask = allowed.to(scores.device)[..., n_k - n_q : n_k, :n_k]  # absolute positions: the run's top-left block
        visible = mask & visibility.visible(layer, n_k, scores.device)[n_k - n_q :]
        if not bool(visible.any(dim=-1).all()):
            raise InvalidArgumentError(f"allowed leaves some query with no visible key in layer {layer} (after the "
                                       f"model's own {visibility.describe()} mask); every row needs one.")
        blocked = ~mask.expand(scores.shape) if mask.ndim == 4 else ~mask.expand(scores.shape[1:])
        return _block_scores(scores, blocked, head_list)

    return [(hook_name(layer, SCORES), partial(fn, layer=layer)) for layer in layer_list]
