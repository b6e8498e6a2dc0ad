"""Small helpers shared by the disparity, neuron and link analyzers: one-reducer runs and JSON output."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from sinklens.hooks import RESID_POST, RESID_PRE, hook_name
from sinklens.inputs import Inputs, TokenBatch, as_batches
from sinklens.streaming import Reducer, stream


def run_reducer(
    model: Any,
    inputs: Inputs | None,
    reducer: Reducer,
    *,
    batch_size: int = 8,
    prepend_bos: bool = True,
    max_length: int | None = None,
    extra_hooks: Sequence[tuple[str, Callable[..., Any]]] = (),
    progress: bool = False,
    desc: str = "sinklens",
) -> Any:
    """``as_batches`` + :func:`~sinklens.streaming.stream` for a single reducer; returns its result."""
    batches = as_batches(model, inputs, batch_size=batch_size, prepend_bos=prepend_bos, max_length=max_length)
    (result,) = stream(model, batches, [reducer], extra_hooks=extra_hooks, progress=progress, desc=desc)
    return result


def to_json(value: Any, digits: int = 6) -> Any:
    """Tensors -> nested lists, non-finite floats -> None, floats rounded to ``digits`` significant digits."""
    if isinstance(value, Tensor):
        value = value.detach().cpu().tolist()
    if isinstance(value, dict):
        return {str(k): to_json(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v, digits) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return float(f"{value:.{digits}g}")
    return value


def check_sink_position(batch: TokenBatch, sink_position: int) -> None:
    """Raise ``ValueError`` if some sequence of ``batch`` is too short to have ``sink_position``."""
    shortest = int(batch.lengths.min())
    if not 0 <= sink_position < shortest:
        raise ValueError(
            f"sink_position={sink_position} is beyond a sequence of {shortest} tokens in this batch; "
            f"it must lie in [0, {shortest - 1}] for every sequence."
        )


def resolve_streams(layers: int | list[int] | tuple[int, ...] | None, n_layers: int) -> list[int]:
    """Residual-stream indices ``0..n_layers``: ``s < n_layers`` is ``blocks.{s}.hook_resid_pre``, ``n_layers`` is
    the final ``blocks.{n_layers-1}.hook_resid_post``. None = all; negatives count from the end.

    Examples:
        >>> resolve_streams(None, 2), resolve_streams(-1, 2)
        ([0, 1, 2], [2])
    """
    n = n_layers + 1
    if layers is None:
        return list(range(n))
    out = []
    for layer in [layers] if isinstance(layers, int) else list(layers):
        idx = int(layer) + n if int(layer) < 0 else int(layer)
        if not 0 <= idx < n:
            raise ValueError(
                f"Residual stream index {layer} is out of range: 0..{n_layers - 1} are the inputs of blocks "
                f"0..{n_layers - 1} (hook_resid_pre) and {n_layers} is the output of the last block."
            )
        out.append(idx)
    return out


def stream_hook(stream_index: int, n_layers: int) -> str:
    """Hook name of residual-stream index ``stream_index`` (see :func:`resolve_streams`)."""
    if stream_index < n_layers:
        return hook_name(stream_index, RESID_PRE)
    return hook_name(n_layers - 1, RESID_POST)


def grow(t: Tensor, dim: int, size: int, fill: float | bool = 0.0) -> Tensor:
    """Pad ``t`` along ``dim`` with ``fill`` up to ``size`` (no-op if already that large)."""
    if t.shape[dim] >= size:
        return t
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, torch.full(shape, fill, dtype=t.dtype, device=t.device)], dim=dim)


def once_per_forward(fold: Callable[..., None]) -> Callable[..., None]:
    """Wrap a fold so that it runs only on the first call per key ``i`` within one forward pass.

    TransformerLens 3.x ``HookedTransformer`` runs ``ln1.hook_normalized`` once per query/key/value input
    (three times per forward, with the same tensor); folding every call would count tokens three times.
    Call this in ``fwd_hooks`` (once per batch) so the "seen" set is fresh for each forward.
    """
    seen: set[Any] = set()

    def wrapped(act: Any, hook: Any, i: Any, **kwargs: Any) -> None:
        if i in seen:
            return None
        seen.add(i)
        return fold(act, hook, i=i, **kwargs)

    return wrapped
