"""Variance interventions: amplify a token's deviation from the mean, or calibrate the sink's away.

The theory: a head's output ``z`` at position ``t`` averages ``t + 1`` values, so its variance
shrinks like ``σ²/(t+1)`` and the first token, which averages a single value, stands out. Two
hook factories act on that directly:

* :func:`amplify` — mean-centred amplification ``x ← μ + α (x − μ)`` of the tokens at
  ``positions`` at one hook site (``attn.hook_z``, ``attn.hook_v``, ``hook_attn_out``,
  ``hook_resid_pre`` …). ``α > 1`` gives a mid-sequence token first-token-like statistics.
* :func:`calibrate` — the reverse: rescale the target's deviation ``x − μ`` (per head for
  ``z``/``v``) to the root-mean-square deviation of the other positions of the same sequence, so the
  sink no longer differs from them.

The reference mean ``μ`` of :func:`amplify` defaults to the mean of the activation over many
random-token positions (:func:`reference_mean`; position 0 left out), computed once per model,
site and settings with :func:`sinklens.stream` and cached. Weights that change (training) make the
cache stale: use ``reference="batch"`` there, or :func:`clear_reference_cache`.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.hooks import Z, check_hook_names, hook_name, layer_of, model_device, model_dims, resolve_layers
from sinklens.inputs import TokenBatch, random_token_batches
from sinklens.interventions.masks import Hooks, as_positions, check_in_sequence
from sinklens.options import RunOptions
from sinklens.streaming import BatchFold, HookFn, Reducer, per_layer_hooks, stream

Reference = Union[Literal["random", "batch"], Tensor, Mapping[int, Tensor]]

_CACHE: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


class MeanActivationReducer(Reducer):
    """Streams the mean of a per-layer activation over valid positions ``>= skip_first``.

    The mean is over (sequence, position) pairs and keeps the activation's trailing shape
    (``[head, d_head]`` for ``attn.hook_z``, ``[d_model]`` for ``hook_resid_pre``).
    """

    def __init__(self, model: Any, site: str, *, layers=None, skip_first: int = 1):
        dims = model_dims(model)
        self.layers = resolve_layers(layers, dims.n_layers)
        self.names = [hook_name(layer, site) for layer in self.layers]
        check_hook_names(model, self.names)
        self.site = site
        self.skip_first = skip_first
        self.reset()

    def reset(self) -> None:
        self.sums: dict[int, Tensor] = {}
        self.count = 0

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        keep = batch.valid[:, self.skip_first :]

        def fold(act: Tensor, layer: int) -> None:  # act: [batch, pos, ...]
            summed = act[:, self.skip_first :][keep].double().sum(dim=0)
            self.sums[layer] = self.sums[layer] + summed if layer in self.sums else summed

        return BatchFold(per_layer_hooks(self.site, self.layers, fold))

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        self.count += int(batch.valid[:, self.skip_first :].sum())

    def result(self) -> dict[int, Tensor]:
        if self.count == 0:
            raise ValueError(f"No positions >= {self.skip_first} to average over; use longer sequences.")
        return {layer: (s / self.count).float() for layer, s in self.sums.items()}


def reference_mean(
    model: Any,
    *,
    site: str = Z,
    layers=None,
    n_sequences: int = 32,
    seq_len: int = 64,
    skip_first: int = 1,
    seed: int = 0,
    cache: bool = True,
) -> dict[int, Tensor]:
    """Mean of ``blocks.{l}.{site}`` over random-token positions, per layer (cached per model).

    Computed with :func:`sinklens.stream` over :func:`sinklens.inputs.random_token_batches`
    (``n_sequences × seq_len`` uniform tokens, no BOS); positions ``< skip_first`` are left out
    because position 0 is the sink and its activations are atypical. Returns ``{layer: mean}``
    with the activation's trailing shape, on the model's device.
    """
    dims = model_dims(model)
    layer_list = resolve_layers(layers, dims.n_layers)
    seq_len = min(seq_len, dims.n_ctx)
    key = (site, tuple(layer_list), n_sequences, seq_len, skip_first, seed)
    store = _CACHE.setdefault(model, {}) if cache else {}
    if key not in store:
        batches = random_token_batches(model, n_sequences=n_sequences, seq_len=seq_len, seed=seed)
        batches = [b.to(model_device(model)) for b in batches]
        reducer = MeanActivationReducer(model, site, layers=layer_list, skip_first=skip_first)
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
    if isinstance(reference, str):
        if reference == "batch":
            return None
        if reference == "random":
            return reference_mean(model, site=site, layers=layers, **kw)
        raise ValueError(f"reference must be 'random', 'batch', a tensor or a {{layer: tensor}} mapping, got {reference!r}.")
    if isinstance(reference, Tensor):
        return {layer: reference for layer in layers}
    missing = [layer for layer in layers if layer not in reference]
    if missing:
        raise ValueError(f"reference has no mean for layers {missing}.")
    return dict(reference)


def _others_mean(act: Tensor, targets: list[int]) -> Tensor:
    """Mean over positions ``>= 1`` that are not targets, per sequence: ``[batch, 1, ...]``."""
    keep = torch.ones(act.shape[1], dtype=torch.bool, device=act.device)
    keep[0] = False
    keep[targets] = False
    if not bool(keep.any()):
        raise ValueError("The sequence has no position other than 0 and the targets to take statistics from.")
    return act[:, keep].mean(dim=1, keepdim=True)


def _head_select(act: Tensor, heads) -> Tensor | None:
    if heads is None:
        return None
    if act.ndim != 4:
        raise ValueError(f"heads= needs a per-head site ([batch, pos, head, d_head]); this activation is {tuple(act.shape)}.")
    sel = torch.zeros(act.shape[2], dtype=torch.bool, device=act.device)
    sel[heads] = True
    return sel[:, None]  # broadcast over d_head


def amplify(
    model: Any,
    *,
    positions: int | Sequence[int],
    alpha: float | int,
    site: str = Z,
    layers=None,
    heads: int | Sequence[int] | None = None,
    reference: Reference = "random",
    **reference_kw: Any,
) -> Hooks:
    """Mean-centred amplification ``x ← μ + α (x − μ)`` of the tokens at ``positions``.

    Computed as ``x + (α − 1)(x − μ)`` so that ``α = 1`` returns the activation unchanged, bit for bit.

    Args:
        positions: token positions to amplify.
        alpha: amplification factor, ``> 0`` (``< 1`` shrinks the deviation).
        site: per-layer hook site, e.g. ``"attn.hook_z"`` (default), ``"attn.hook_v"``,
            ``"hook_attn_out"``, ``"hook_resid_pre"``.
        layers: layers to intervene in (default all).
        heads: only these heads (per-head sites only; for ``hook_v`` under grouped-query attention
            on TransformerLens 4.x these index key/value heads).
        reference: ``"random"`` (default: :func:`reference_mean` over random tokens, cached),
            ``"batch"`` (per sequence, the mean over the run's positions other than 0 and the
            targets — no cache, right for training), a tensor, or ``{layer: tensor}``.
        **reference_kw: passed to :func:`reference_mean` (``n_sequences``, ``seq_len``, ``seed``...).

    Examples:
        >>> from sinklens.testing import tiny_model
        >>> model = tiny_model()
        >>> toks = torch.tensor([[0, 5, 6, 7, 8]])
        >>> hooks = amplify(model, positions=2, alpha=1.0, reference="batch")
        >>> bool(torch.equal(model.run_with_hooks(toks, fwd_hooks=hooks), model(toks)))
        True
    """
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
        raise ValueError(f"alpha must be a number > 0 (1 = no change), got {alpha!r}.")
    dims = model_dims(model)
    pos = as_positions(positions, dims.n_ctx)
    layer_list = resolve_layers(layers, dims.n_layers)
    names = [hook_name(layer, site) for layer in layer_list]
    check_hook_names(model, names)
    means = _reference_for(model, reference, site, layer_list, reference_kw)

    def fn(act: Tensor, hook: Any) -> Tensor:  # act: [batch, pos, ...]
        check_in_sequence(pos, act.shape[1])
        x = act[:, pos]
        mu = _others_mean(act, pos) if means is None else means[layer_of(hook.name)].to(act.device, act.dtype)
        delta = (alpha - 1.0) * (x - mu)
        sel = _head_select(act, heads)
        if sel is not None:
            delta = delta * sel
        out = act.clone()
        out[:, pos] = x + delta
        return out

    return [(name, fn) for name in names]


def calibrate(
    model: Any,
    *,
    positions: int | Sequence[int] = 0,
    site: str = Z,
    layers=None,
    heads: int | Sequence[int] | None = None,
    eps: float = 1e-6,
) -> Hooks:
    """Rescale the target tokens' deviation to the statistics of the other positions (remove the discrepancy).

    Per sequence (and per head for ``[batch, pos, head, d_head]`` sites), with ``μ`` the mean and
    ``s = sqrt(mean_t ||x_t − μ||²)`` the root-mean-square deviation over the positions ``t >= 1``
    that are not targets, each target becomes ``μ + (x − μ) · s / ||x − μ||``: same direction, the
    typical size. Norms are over the last dimension. The default target is the sink at position 0.
    """
    dims = model_dims(model)
    pos = as_positions(positions, dims.n_ctx)
    layer_list = resolve_layers(layers, dims.n_layers)
    names = [hook_name(layer, site) for layer in layer_list]
    check_hook_names(model, names)

    def fn(act: Tensor, hook: Any) -> Tensor:
        check_in_sequence(pos, act.shape[1])
        mu = _others_mean(act, pos)
        keep = torch.ones(act.shape[1], dtype=torch.bool, device=act.device)
        keep[0] = False
        keep[pos] = False
        rms = (act[:, keep] - mu).norm(dim=-1, keepdim=True).pow(2).mean(dim=1, keepdim=True).sqrt()
        x = act[:, pos]
        dev = x - mu
        scale = rms / dev.norm(dim=-1, keepdim=True).clamp_min(eps)
        new = mu + dev * scale
        sel = _head_select(act, heads)
        if sel is not None:
            new = torch.where(sel, new, x)
        out = act.clone()
        out[:, pos] = new
        return out

    return [(name, fn) for name in names]


def deviation_norm(act: Float[Tensor, "batch pos *feature"], mean: Tensor) -> Float[Tensor, "batch pos *head"]:
    """``||x − μ||`` over the last dimension (per head for per-head sites): what :func:`amplify` scales by α."""
    return (act - mean).norm(dim=-1)
