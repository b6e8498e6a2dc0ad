"""Small helpers shared by the analyzers: the sink-position checks, residual-stream indices, row
lookup, growing running sums and the body every public analyzer shares."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from sinklens.errors import InvalidArgumentError
from sinklens.hooks import RESID_POST, RESID_PRE, hook_name
from sinklens.inputs import TokenBatch, is_encoder, require_a_later_position
from sinklens.options import checked_options, settings_from
from sinklens.streaming import batches_for, stream
from sinklens.validate import index_list, optional_index_list, positive_int

#: Floor for denominators (norms, medians) so that an all-zero row gives 0, not NaN.
TINY = 1e-12


def sink_position_arg(sink_position: Any) -> int:
    """The ``sink_position=`` argument of every analyzer: an integer >= 0.

    Examples:
        >>> sink_position_arg(0)
        0
        >>> sink_position_arg(-1)
        Traceback (most recent call last):
        ...
        sinklens.errors.InvalidArgumentError: sink_position must be an integer >= 0, got -1.
    """
    return positive_int(sink_position, what="sink_position", minimum=0)


def check_sink_position(batch: TokenBatch, sink_position: int) -> None:
    """Raise :class:`~sinklens.errors.InvalidArgumentError` if a sequence of ``batch`` is too short
    to have a token at ``sink_position``."""
    lengths = batch.host_lengths()
    shortest = min(lengths)
    if not 0 <= sink_position < shortest:
        row = lengths.index(shortest)
        raise InvalidArgumentError(
            f"sink_position={sink_position} is beyond sequence {row} of this batch, which has {shortest} tokens; "
            f"it must lie in [0, {shortest - 1}] for every sequence."
        )


def other_positions(batch: TokenBatch, sink_position: int) -> Tensor:
    """``[batch, pos]`` mask of the valid (non-padding) positions other than ``sink_position``."""
    other = batch.valid.clone()
    other[:, sink_position] = False
    return other


def resolve_streams(streams: int | Sequence[int] | None, n_layers: int) -> list[int]:
    """Residual-stream indices ``0..n_layers``: ``s < n_layers`` is ``blocks.{s}.hook_resid_pre``, ``n_layers`` is
    the final ``blocks.{n_layers-1}.hook_resid_post``. None = all; negatives count from the end.

    Examples:
        >>> resolve_streams(None, 2), resolve_streams(-1, 2)
        ([0, 1, 2], [2])
    """
    return optional_index_list(streams, n_layers + 1, what="residual stream index")


def stream_hook(stream_index: int, n_layers: int) -> str:
    """Hook name of residual-stream index ``stream_index`` (see :func:`resolve_streams`)."""
    if stream_index < n_layers:
        return hook_name(stream_index, RESID_PRE)
    return hook_name(n_layers - 1, RESID_POST)


class SettingsFields:
    """Mixin for results that hold a frozen ``settings`` dataclass: its fields read as attributes.

    ``result.sink_threshold`` is ``result.settings.sink_threshold``.
    """

    def __getattr__(self, name: str) -> Any:  # called only when normal lookup fails
        settings = self.__dict__.get("settings")
        if settings is not None and name in {f.name for f in dataclasses.fields(settings)}:
            return getattr(settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def position_index(position: Any, n_positions: int) -> int:
    """Index of ``position`` (negatives count from the end) among ``n_positions`` measured positions.

    Examples:
        >>> position_index(-1, 6)
        5
    """
    return index_list(position, n_positions, what="position")[0]


def row_index(labels: Sequence[int], label: int, *, what: str = "Layer") -> int:
    """Row of ``label`` in a result whose rows are ``labels``; a named error if it was not analysed."""
    if label not in labels:
        raise InvalidArgumentError(f"{what} {label} was not analysed; analysed: {list(labels)}.")
    return list(labels).index(label)


def layer_head_position_rows(
    layers: Sequence[int], n_heads: int, n_positions: int, columns: dict[str, tuple[str, Tensor | None]],
) -> list[dict[str, Any]]:
    """Long format: one row per (layer, head, position) with ``layer``, ``head``, ``position`` and, in order,
    every column. A column is ``(axes, tensor)``: ``axes`` names the tensor's dimensions among
    ``"layer head pos"`` (e.g. ``"layer pos"``: one value for every head); a None tensor is left out.

    Examples:
        >>> import torch
        >>> rows = layer_head_position_rows([3], 2, 1, {"x": ("layer head pos", torch.tensor([[[1.0], [2.0]]])),
        ...                                             "n": ("pos", torch.tensor([7])), "no": ("pos", None)})
        >>> rows
        [{'layer': 3, 'head': 0, 'position': 0, 'x': 1.0, 'n': 7}, {'layer': 3, 'head': 1, 'position': 0, 'x': 2.0, 'n': 7}]
    """
    lists = {name: (axes.split(), t.tolist()) for name, (axes, t) in columns.items() if t is not None}
    rows = []
    for i, layer in enumerate(layers):
        for h in range(n_heads):
            for p in range(n_positions):
                at = {"layer": i, "head": h, "pos": p}
                row = {"layer": layer, "head": h, "position": p}
                for name, (axes, values) in lists.items():
                    for axis in axes:
                        values = values[at[axis]]
                    row[name] = values
                rows.append(row)
    return rows


def once_per_forward(fold: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    """Wrap a ``fold(act, key)`` so that it runs only on the first call per key within one forward pass.

    TransformerLens 3.x ``HookedTransformer`` runs ``ln1.hook_normalized`` once per query/key/value input
    (three times per forward, with the same tensor); folding every call would count tokens three times.
    Call this in ``fwd_hooks`` (once per batch) so the "seen" set is fresh for each forward.
    """
    seen: set[Any] = set()

    def wrapped(act: Any, key: Any) -> None:
        if key in seen:
            return None
        seen.add(key)
        return fold(act, key)

    return wrapped


def analyzer_sink_position(reducer_kwargs: dict[str, Any]) -> int | None:
    """The sink position an analyzer's reducer will be built with: its ``sink_position=`` keyword, else the
    ``sink_position`` field of its ``settings=``; None for an analyzer without one (e.g. ``find_sinks``).

    Examples:
        >>> analyzer_sink_position({"sink_position": 2}), analyzer_sink_position({"layers": None})
        (2, None)
    """
    if "sink_position" in reducer_kwargs:
        return sink_position_arg(reducer_kwargs["sink_position"])
    value = getattr(reducer_kwargs.get("settings"), "sink_position", None)
    return None if value is None else sink_position_arg(value)


def run_analyzer(
    model: Any,
    inputs: Any,
    reducer: Callable[..., Any],
    *,
    where: str,
    options: Any,
    kwargs: dict[str, Any] | None = None,
    settings_cls: type | None = None,
    settings: Any = None,
    **reducer_kwargs: Any,
) -> Any:
    """The body every public analyzer shares: resolve its keywords, build its reducer, stream, return the result.

    With ``settings_cls``, ``settings`` and the field keywords in ``kwargs`` (the public function's
    ``**settings_kwargs``) make the reducer's ``settings=`` (:func:`~sinklens.options.settings_from`).
    ``inputs`` are tokenized and checked before any forward pass
    (:func:`~sinklens.inputs.require_a_later_position`): for an analyzer with a sink position every
    sequence must reach it and some query must see it. Then ``reducer(model, **reducer_kwargs)`` is
    streamed over them (:func:`sinklens.streaming.stream`). ``where`` names the public function in errors.
    """
    options = checked_options(options, where)
    if settings_cls is not None:
        reducer_kwargs["settings"] = settings_from(settings_cls, settings, kwargs or {}, where)
    batches = batches_for(model, inputs, options)
    require_a_later_position(batches, what=where, sink_position=analyzer_sink_position(reducer_kwargs),
                             bidirectional=is_encoder(model),
                             min_query=getattr(reducer_kwargs.get("settings"), "min_query", None))
    (result,) = stream(model, batches, [reducer(model, **reducer_kwargs)], options=options)
    return result
