"""Variance interventions: :func:`amplify` a token's deviation from the mean (``α > 1``: first-token-like), or
:func:`calibrate` the sink's deviation to the other positions' RMS deviation."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any, Literal, Union

import torch
from torch import Tensor

from sinklens.errors import InvalidArgumentError
from sinklens.hooks import (K, V, Z, check_hook_names, hook_name, hooks_silenced, model_device, model_dims,
                            weight_fingerprint)
from sinklens.inputs import TokenBatch, random_token_batches
from sinklens.interventions.masks import Hooks, IndexLike, IntLike, NumberLike, check_in_sequence, heads_arg, layers_arg, positions_arg
from sinklens.interventions.sites import edit_site
from sinklens.options import RunOptions
from sinklens.residual_sites import on_the_residual_stream
from sinklens.streaming import BatchFold, Reducer, per_layer_hooks, real_tokens, stream
from sinklens.validate import choice, finite_number, index_list, positive_int

Reference = Union[Literal["random", "batch"], Tensor, Mapping[int, Tensor]]

#: model -> (weight fingerprint, {settings: {layer: mean}}); see :func:`weight_fingerprint`.
_CACHE: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


class MeanActivationReducer(Reducer[dict[int, Tensor]]):
    """Streams the mean of a per-layer activation over valid positions ``>= skip_first`` (float64 sums),
    keeping its trailing shape."""

    statistics = ("sums", "count")

    def __init__(self, model: Any, site: str, *, layers: IndexLike | None = None, skip_first: IntLike = 1):
        dims = model_dims(model)
        self.layers = layers_arg(layers, dims.n_layers)
        self.site = site
        check_hook_names(model, [hook_name(layer, site) for layer in self.layers])
        self.skip_first = positive_int(skip_first, what="skip_first", minimum=0)
        self.reset()

    def reset(self) -> None:
        self.sums: dict[int, Tensor] = {}
        self.count = 0

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        keep = batch.valid[:, self.skip_first :]  # [batch, pos - skip_first]

        def fold(act: Tensor, layer: int) -> None:  # act: [batch, pos, ...]
            summed = act[:, self.skip_first :][keep].double().sum(dim=0)
            self.sums[layer] = self.sums[layer] + summed if layer in self.sums else summed

        return BatchFold(per_layer_hooks(self.site, self.layers, fold))

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        self.count += int(batch.valid[:, self.skip_first :].sum())

    def result(self) -> dict[int, Tensor]:
        if self.count == 0:
            raise InvalidArgumentError(f"No positions >= skip_first={self.skip_first} to average over; use longer sequences.")
        return {layer: (s / self.count).float() for layer, s in self.sums.items()}


def reference_mean(
    model: Any, *, site: str = Z, layers: IndexLike | None = None, n_sequences: IntLike = 32,
    seq_len: IntLike = 64, skip_first: IntLike = 1, seed: IntLike = 0, cache: bool = True,
) -> dict[int, Tensor]:
    """``{layer: mean}`` of ``blocks.{l}.{site}`` over uniform random-token positions ``>= skip_first`` (no
    BOS), with the model's own hooks silenced; cached per model and weights, on the model's device."""
    dims = model_dims(model)
    layer_list = layers_arg(layers, dims.n_layers)
    n_sequences = positive_int(n_sequences, what="n_sequences")
    skip_first = positive_int(skip_first, what="skip_first", minimum=0)
    seq_len = min(positive_int(seq_len, what="seq_len", minimum=skip_first + 1), dims.n_ctx)
    key = (site, tuple(layer_list), n_sequences, seq_len, skip_first, int(seed))
    store: dict = {}
    if cache:
        fingerprint = weight_fingerprint(model)
        if _CACHE.get(model, (None, None))[0] != fingerprint:
            _CACHE[model] = (fingerprint, {})
        store = _CACHE[model][1]
    if key not in store:
        batches = random_token_batches(model, n_sequences=n_sequences, seq_len=seq_len, seed=int(seed))
        batches = [b.to(model_device(model)) for b in batches]
        reducer = MeanActivationReducer(model, site, layers=layer_list, skip_first=skip_first)
        with hooks_silenced(model) if isinstance(model, torch.nn.Module) else nullcontext():  # the weights' mean
            (means,) = stream(model, batches, [reducer], options=RunOptions(progress=False, desc="reference mean"))
        store[key] = {layer: m.clone() for layer, m in means.items()}  # clone: leave inference mode
    return store[key]


def clear_reference_cache(model: Any | None = None) -> None:
    """Forget cached reference means (of one model, or of all)."""
    if model is None:
        _CACHE.clear()
    else:
        _CACHE.pop(model, None)


def _reference_for(model: Any, reference: Reference, site: str, layers: list[int], kw: dict) -> dict[int, Tensor] | None:
    """``{layer: mean}`` for ``amplify``'s ``reference=`` (None = per-batch means, computed in the hook)."""
    named = isinstance(reference, str)
    if named and choice(reference, ("random", "batch"), what="reference") == "random":
        allowed = ("n_sequences", "seq_len", "skip_first", "seed", "cache")
        if unknown := sorted(k for k in kw if k not in allowed):
            own = [name for name in inspect.signature(amplify).parameters if name not in ("model", "reference_kw")]
            raise InvalidArgumentError(f"amplify has no option {unknown[0]!r}; its options are {own} and, with "
                                       f"reference='random', reference_mean's {list(allowed)}.")
        return reference_mean(model, site=site, layers=layers, **kw)
    if kw:
        raise InvalidArgumentError(f"Options {sorted(kw)} only apply to reference='random' (they configure "
                                   f"reference_mean), not to reference={reference!r}.")
    if named:  # "batch"
        return None
    if not isinstance(reference, (Tensor, Mapping)):
        raise InvalidArgumentError(f"reference must be 'random', 'batch', a tensor or a {{layer: tensor}} mapping, "
                                   f"got {type(reference).__name__}.")
    if isinstance(reference, Mapping) and (missing := [layer for layer in layers if layer not in reference]):
        raise InvalidArgumentError(f"reference has no mean for layers {missing}.")
    means = {layer: reference if isinstance(reference, Tensor) else reference[layer] for layer in layers}
    for layer, mean in means.items():
        if not isinstance(mean, Tensor) or not bool(torch.isfinite(mean).all()):
            raise InvalidArgumentError(f"reference for layer {layer} must be a finite tensor, got {mean!r}.")
    return means


def _other_positions(act: Tensor, targets: list[int]) -> Tensor:
    """``[batch, pos]``: the real-token positions ``>= 1`` that are not targets."""
    keep = torch.ones(act.shape[1], dtype=torch.bool, device=act.device)
    keep[[0, *targets]] = False
    if not bool(keep.any()):
        raise InvalidArgumentError("The sequence has no position other than 0 and the targets to take statistics from.")
    keep = keep.expand(act.shape[0], -1)
    real = real_tokens(act.shape[0], act.shape[1])
    return keep if real is None else keep & real.to(act.device)


def _mean_over(x: Tensor, where: Tensor) -> Tensor:
    """Per-sequence mean of ``x`` over the positions ``where`` is True: ``[batch, 1, ...]`` (0 where none)."""
    weight = where.to(x.dtype).reshape(*where.shape, *[1] * (x.ndim - 2))
    return (x * weight).sum(dim=1, keepdim=True) / weight.sum(dim=1, keepdim=True).clamp_min(1.0)


def _reference_at(mean: Tensor, act: Tensor) -> Tensor:
    """A reference mean on ``act``'s device and dtype; its shape must be ``act``'s trailing shape."""
    if tuple(mean.shape) != tuple(act.shape[2:]):
        raise InvalidArgumentError(f"reference mean has shape {tuple(mean.shape)}; this site's activation needs "
                                   f"{tuple(act.shape[2:])} (its shape after [batch, pos]).")
    return mean.to(act.device, act.dtype)


def _rewrite(act: Tensor, pos: list[int], heads: list[int] | None, new: Tensor) -> Tensor:
    """A copy of ``act`` with positions ``pos`` set to ``new``, in ``heads`` only (None: all) of a per-head site."""
    if heads is not None:
        if act.ndim != 4:
            raise InvalidArgumentError(f"heads= needs a per-head site ([batch, pos, head, d_head]); this activation is {tuple(act.shape)}.")
        sel = torch.zeros(act.shape[2], 1, dtype=torch.bool, device=act.device)  # [head, 1]: over d_head
        sel[heads] = True
        new = torch.where(sel, new, act[:, pos])
    out = act.clone()
    out[:, pos] = new
    return out


def _targets(model: Any, positions: Any, site: str, layers: Any, heads: Any) -> tuple[list[int], list[int], Any, str]:
    """Checked ``(positions, layers, heads, edited site)``; ``heads`` index the key/value heads at ``hook_k``/``hook_v``
    of a grouped-query model, else the query heads (None: all)."""
    dims = model_dims(model)
    pos, layer_list = positions_arg(positions, dims.n_ctx), layers_arg(layers, dims.n_layers)
    if heads is None or site not in (K, V) or dims.n_kv_heads == dims.n_heads:
        heads = heads_arg(heads, dims.n_heads)
    else:
        heads = index_list(heads, dims.n_kv_heads, allow_negative=False,
                           what=f"heads= at {site} indexes the {dims.n_kv_heads} key/value heads of this grouped-query "
                                f"model (its {dims.n_heads} query heads share them); head")
    site = edit_site(model, site)
    check_hook_names(model, [hook_name(layer, site) for layer in layer_list])
    return pos, layer_list, heads, site


def amplify(
    model: Any, *, positions: IndexLike, alpha: NumberLike, site: str = Z,
    layers: IndexLike | None = None, heads: IndexLike | None = None,
    reference: Reference = "random", **reference_kw: Any,
) -> Hooks:
    """``x ← μ + α (x − μ)`` at ``positions`` of ``site`` (in ``heads``), as ``x + (α − 1)(x − μ)`` so that
    ``α = 1`` is bit-exact. ``μ``: ``reference="random"`` (:func:`reference_mean` with ``reference_kw``),
    ``"batch"`` (per sequence, over real positions other than 0 and the targets; use it in training), a
    tensor, or ``{layer: tensor}``."""
    alpha = finite_number(alpha, what="alpha")
    if not alpha > 0:
        raise InvalidArgumentError(f"alpha must be a number > 0 (1 = no change), got {alpha:g}.")
    pos, layer_list, heads, site = _targets(model, positions, site, layers, heads)
    means = _reference_for(model, reference, site, layer_list, reference_kw)

    def fn(act: Tensor, layer: int) -> Tensor:  # act: [batch, pos, ...]
        check_in_sequence(pos, act.shape[1])
        x = act[:, pos]
        mu = _mean_over(act, _other_positions(act, pos)) if means is None else _reference_at(means[layer], act)
        return _rewrite(act, pos, heads, x + (alpha - 1.0) * (x - mu))

    return on_the_residual_stream(model, per_layer_hooks(site, layer_list, fn))


def calibrate(
    model: Any, *, positions: IndexLike = 0, site: str = Z, layers: IndexLike | None = None,
    heads: IndexLike | None = None, eps: NumberLike = 1e-6,
) -> Hooks:
    """Each target ``x`` becomes ``μ + (x − μ) · s / ||x − μ||``, per sequence (and head), with ``μ`` the mean
    and ``s = sqrt(mean_t ||x_t − μ||²)`` over real positions ``t >= 1`` that are not targets (norms over the
    last dimension). ``site`` and ``heads`` as in :func:`amplify`."""
    pos, layer_list, heads, site = _targets(model, positions, site, layers, heads)
    eps = finite_number(eps, what="eps", low=0.0, low_open=True)

    def fn(act: Tensor, layer: int) -> Tensor:
        check_in_sequence(pos, act.shape[1])
        others = _other_positions(act, pos)
        mu = _mean_over(act, others)
        rms = _mean_over((act - mu).norm(dim=-1, keepdim=True).pow(2), others).sqrt()
        dev = act[:, pos] - mu
        return _rewrite(act, pos, heads, mu + dev * rms / dev.norm(dim=-1, keepdim=True).clamp_min(eps))

    return on_the_residual_stream(model, per_layer_hooks(site, layer_list, fn))

