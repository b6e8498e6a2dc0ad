"""Helpers shared by the analyzers: sink-position checks, stream indices, row lookup, the common body."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from sinklens.errors import InvalidArgumentError
from sinklens.hooks import PATTERN, RESID_POST, RESID_PRE, SCORES, hook_name
from sinklens.inputs import TokenBatch, is_encoder, require_a_later_position
from sinklens.options import ATTENTION_METHODS, checked_options, settings_from
from sinklens.streaming import batches_for, stream
from sinklens.validate import optional_index_list, positive_int

#: Floor for denominators (norms, medians) so that an all-zero row gives 0, not NaN.
TINY = 1e-12


def sink_position_arg(sink_position: Any) -> int:
    """The ``sink_position=`` argument of every analyzer: an integer >= 0."""
    return positive_int(sink_position, what="sink_position", minimum=0)


def check_sink_position(batch: TokenBatch, sink_position: int) -> None:
    """A named error if a sequence of ``batch`` has no token at ``sink_position``."""
    lengths = batch.host_lengths()
    shortest = min(lengths)
    if not 0 <= sink_position < shortest:
        raise InvalidArgumentError(
            f"sink_position={sink_position} is beyond sequence {lengths.index(shortest)} of this batch, which has "
            f"{shortest} tokens; it must lie in [0, {shortest - 1}] for every sequence.")


def other_positions(batch: TokenBatch, sink_position: int) -> Tensor:
    """``[batch, pos]`` mask of the valid (non-padding) positions other than ``sink_position``."""
    other = batch.valid.clone()
    other[:, sink_position] = False
    return other


def resolve_streams(streams: int | Sequence[int] | None, n_layers: int) -> list[int]:
    """Residual-stream indices ``0..n_layers`` (:func:`stream_hook`); None = all, negatives count from the end."""
    return optional_index_list(streams, n_layers + 1, what="residual stream index")


def stream_hook(stream_index: int, n_layers: int) -> str:
    """Hook name of residual-stream index ``stream_index`` (see :func:`resolve_streams`)."""
    return hook_name(stream_index, RESID_PRE) if stream_index < n_layers else hook_name(n_layers - 1, RESID_POST)


class SettingsFields:
    """Mixin for results holding a frozen ``settings`` dataclass: ``result.x`` reads ``result.settings.x``."""

    def __getattr__(self, name: str) -> Any:  # called only when normal lookup fails
        settings = self.__dict__.get("settings")
        if settings is not None and name in {f.name for f in dataclasses.fields(settings)}:
            return getattr(settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def row_index(labels: Sequence[int], label: int, *, what: str = "Layer") -> int:
    """Row of ``label`` in a result whose rows are ``labels``; a named error if it was not analysed."""
    if label not in labels:
        raise InvalidArgumentError(f"{what} {label} was not analysed; analysed: {list(labels)}.")
    return list(labels).index(label)


def layer_head_position_rows(layers: Sequence[int], n_heads: int, n_positions: int,
                             columns: dict[str, tuple[str, Tensor | None]]) -> list[dict[str, Any]]:
    """Long format: one row per (layer, head, position) with every column, a column being ``(axes, tensor)``
    with ``axes`` its dimensions among ``"layer head pos"``; a None tensor is left out.

    Examples:
        >>> import torch
        >>> layer_head_position_rows([3], 2, 1, {"x": ("layer head pos", torch.tensor([[[1.0], [2.0]]])),
        ...                                      "n": ("pos", torch.tensor([7])), "no": ("pos", None)})
        [{'layer': 3, 'head': 0, 'position': 0, 'x': 1.0, 'n': 7}, {'layer': 3, 'head': 1, 'position': 0, 'x': 2.0, 'n': 7}]
    """
    lists = {name: (axes.split(), t.tolist()) for name, (axes, t) in columns.items() if t is not None}
    pick = lambda values, axes, at: functools.reduce(lambda v, axis: v[at[axis]], axes, values)  # noqa: E731
    return [{"layer": layer, "head": h, "position": p}
            | {name: pick(values, axes, {"layer": i, "head": h, "pos": p}) for name, (axes, values) in lists.items()}
            for i, layer in enumerate(layers) for h in range(n_heads) for p in range(n_positions)]


def once_per_forward(fold: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    """``fold(act, key)`` on the first call per key only (TransformerLens 3.x runs ``ln1.hook_normalized`` once
    per q/k/v input); wrap it in ``fwd_hooks`` so each forward starts afresh."""
    seen: set[Any] = set()

    def wrapped(act: Any, key: Any) -> None:
        if key not in seen:
            seen.add(key)
            fold(act, key)

    return wrapped


def method_for_hooks(method: str, extra_hooks: Sequence[tuple[str, Any]]) -> str:
    """``method``, or ``"pattern"`` where extra hooks edit ``hook_attn_scores``/``hook_pattern`` (after the
    queries and keys the q/k path reads; an error with ``method="qk"``)."""
    edits = [name for name, _ in extra_hooks if name.endswith((SCORES, PATTERN))]
    if edits and method == "qk":
        raise InvalidArgumentError(f"method='qk' reads attention from queries and keys, so the extra hooks on {edits[:2]} "
                                   "would change nothing it measures; use method='pattern'.")
    return "pattern" if edits else method


def run_analyzer(model: Any, inputs: Any, reducer: Callable[..., Any], *, where: str, options: Any,
                 kwargs: dict[str, Any] | None = None, settings_cls: type | None = None, settings: Any = None,
                 **reducer_kwargs: Any) -> Any:
    """Check ``options`` and the inputs before any forward, then stream ``reducer(model, **reducer_kwargs)``
    (``settings`` from ``settings_cls``/``settings``/``kwargs``, ``method`` by :func:`method_for_hooks`)."""
    options = checked_options(options, where)
    if settings_cls is not None:
        settings = settings_from(settings_cls, settings, kwargs or {}, where)
        if getattr(settings, "method", None) in ATTENTION_METHODS:
            settings = dataclasses.replace(settings, method=method_for_hooks(settings.method, options.extra_hooks))
        reducer_kwargs["settings"] = settings
    if "method" in reducer_kwargs:
        reducer_kwargs["method"] = method_for_hooks(reducer_kwargs["method"], options.extra_hooks)
    batches = batches_for(model, inputs, options)
    sink = reducer_kwargs.get("sink_position", getattr(reducer_kwargs.get("settings"), "sink_position", None))
    require_a_later_position(batches, what=where, sink_position=None if sink is None else sink_position_arg(sink),
                             bidirectional=is_encoder(model),
                             min_query=getattr(reducer_kwargs.get("settings"), "min_query", None))
    (result,) = stream(model, batches, [reducer(model, **reducer_kwargs)], options=options)
    return result
