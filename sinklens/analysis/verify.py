"""The causal check of a super-neuron attribution: zero the top writers of each massive dimension at the sink.

For each massive dimension ``d`` of a :class:`~sinklens.analysis.neurons.SuperNeurons` result, the neurons
credited with writing it (its ``top_neurons`` whose residual-unit contribution is at least ``super_share`` of
the peak, at most ``max_writers``, and at least the best one) are zeroed at the sink position only
(:func:`sinklens.interventions.neurons.edit_neurons`, ``mlp.hook_post``), and the same inputs run again. Two
numbers say how much of the attribution is causal:

* ``dim_removed = 1 − value_after / value_before``: the dimension's mean value at the sink at its peak residual
  stream (``path.peak_layer``), after vs before (1: all of it gone, 0: untouched, < 0: grew);
* ``attention_removed = 1 − attention_after / attention_before``: the attention the sink receives, mean over
  layers and heads of ``received[l, h, sink]`` (mean of ``hook_pattern`` over the valid queries that see the
  sink, queries before ``min_query`` = 1 left out, as in :class:`~sinklens.analysis.sinks.SinkResult`).

Both passes (before and after) run here, on the same batches, so the fractions compare like with like.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from sinklens.analysis._common import TINY, stream_hook
from sinklens.analysis.attention import AttentionReceivedReducer
from sinklens.analysis.neurons import SuperNeurons
from sinklens.analysis.weight_super_neurons import SinkMeanReducer
from sinklens.display import StructuralEq
from sinklens.export import to_json
from sinklens.hooks import model_dims
from sinklens.inputs import Inputs, TokenBatch
from sinklens.interventions.neurons import edit_neurons
from sinklens.options import RunOptions, checked_options
from sinklens.streaming import batches_for, stream
from sinklens.validate import positive_int

#: Queries before this position are left out of the sink's received attention (as in ``SinkSettings.min_query``).
MIN_QUERY = 1


@dataclass(eq=False)
class DimCheck(StructuralEq):
    """The causal check of one massive dimension (see the module docstring).

    Attributes:
        dim: the residual dimension; ``peak_stream``: the residual-stream index its value is read at.
        writers: ``(layer, neuron, contribution)`` of the zeroed neurons (residual units, from the attribution).
        value_before / value_after: mean value of ``dim`` at the sink at ``peak_stream``, without / with the ablation.
        dim_removed: ``1 − value_after / value_before``.
        attention_before / attention_after: mean over layers and heads of the attention the sink receives.
        attention_removed: ``1 − attention_after / attention_before``.
    """

    dim: int
    peak_stream: int
    writers: list[tuple[int, int, float]]
    value_before: float
    value_after: float
    dim_removed: float
    attention_before: float
    attention_after: float
    attention_removed: float


@dataclass(eq=False)
class CausalCheck(StructuralEq):
    """Result of :func:`verify_attribution`: one :class:`DimCheck` per massive dimension.

    ``causal_threshold``: a dimension's attribution is called causal when ``dim_removed`` reaches it (default 0.5).
    """

    sink_position: int
    checks: list[DimCheck] = field(default_factory=list)
    causal_threshold: float = 0.5

    def is_causal(self, dim: int) -> bool:
        """Whether zeroing ``dim``'s writers removed at least ``causal_threshold`` of it."""
        return next(c for c in self.checks if c.dim == dim).dim_removed >= self.causal_threshold

    def lines(self) -> list[str]:
        """One summary line per dimension."""
        out = []
        for c in self.checks:
            who = ", ".join(f"L{l}N{n}" for l, n, _ in c.writers)
            verdict = "attribution is causal" if c.dim_removed >= self.causal_threshold else "attribution NOT confirmed"
            out.append(f"  dim {c.dim}: {verdict}: zeroing its top-{len(c.writers)} writers ({who}) at position "
                       f"{self.sink_position} removes {100 * c.dim_removed:.0f}% of dim {c.dim} (stream {c.peak_stream}: "
                       f"{c.value_before:+.1f} -> {c.value_after:+.1f}) and {100 * c.attention_removed:.0f}% of the "
                       f"sink's attention ({c.attention_before:.3f} -> {c.attention_after:.3f})")
        return out

    def to_dict(self) -> dict[str, Any]:
        return to_json({"sink_position": self.sink_position, "causal_threshold": self.causal_threshold,
                        "min_query": MIN_QUERY, "checks": self.checks})


def _measure(model: Any, batches: Sequence[TokenBatch], sink: int, streams: Sequence[int], hooks: list,
             options: RunOptions, what: str) -> tuple[Tensor, float]:
    """(residual at the sink at ``streams``, mean received attention of the sink) with ``hooks`` attached; the
    progress bar (``options.progress``) is labelled ``what``."""
    attention = AttentionReceivedReducer(model, min_query=MIN_QUERY)
    at_sink = SinkMeanReducer(model, sink, [stream_hook(s, model_dims(model).n_layers) for s in streams])
    resid, received = stream(model, batches, [at_sink, attention],
                             options=options.replace(extra_hooks=tuple(options.extra_hooks) + tuple(hooks),
                                                     desc=f"verify_attribution: {what}"))
    return resid, float(torch.nanmean(received.received[:, :, sink]))


def _contribution(neurons: SuperNeurons, layer: int, neuron: int, dim: int) -> float:
    """The attributed residual-unit contribution of one neuron to ``dim`` (NaN if its layer was not analysed)."""
    if layer not in neurons.layers:
        return float("nan")
    return float(neurons.contribution[neurons.layers.index(layer), neuron, neurons.dims.index(dim)])


def default_writers(neurons: SuperNeurons, dim: int, max_writers: int = 10) -> list[tuple[int, int, float]]:
    """The neurons credited with ``dim``: its top writers whose contribution reaches ``super_share`` of the peak
    (at most ``max_writers``; at least the best one)."""
    path = neurons.path(dim)
    floor = neurons.settings.super_share * abs(path.peak_value)
    top = neurons.top(dim, max_writers)
    return [w for w in top if abs(w[2]) >= floor] or top[:1]


def verify_attribution(
    model: Any,
    inputs: Inputs | None,
    neurons: SuperNeurons,
    *,
    writers: dict[int, Sequence[tuple[int, int]]] | None = None,
    max_writers: int = 10,
    causal_threshold: float = 0.5,
    options: RunOptions = RunOptions(),
) -> CausalCheck:
    """Zero each massive dimension's top writers at the sink and measure what disappears (module docstring).

    Args:
        inputs: the inputs the attribution was computed on (anything :func:`sinklens.inputs.as_batches` takes).
        neurons: the :class:`SuperNeurons` result whose ``paths`` are checked.
        writers: ``{dim: [(layer, neuron), ...]}`` to zero instead of the attributed writers (e.g. a control).
        max_writers: at most this many attributed writers per dimension.
        causal_threshold: a dimension's attribution is called causal (``CausalCheck.is_causal``, "attribution
            is causal" in the summary) when zeroing its writers removes at least this share of it,
            ``dim_removed >= causal_threshold`` (default 0.5).
        options: run settings (:class:`~sinklens.options.RunOptions`). Besides the baseline pass (no ablation)
            there is one pass per massive dimension, each over all of ``inputs``.

    Examples:
        >>> from sinklens.analysis.neurons import find_super_neurons
        >>> from sinklens.testing.planted import planted_model
        >>> model, spec = planted_model(n_layers=2, layer=0, neuron=7, dim=5)
        >>> quiet = RunOptions(progress=False)
        >>> check = verify_attribution(model, "t3 t4 t5 t6", find_super_neurons(model, "t3 t4 t5 t6", options=quiet),
        ...                            options=quiet)
        >>> [(c.dim, c.writers[0][:2], round(c.dim_removed, 2)) for c in check.checks]
        [(5, (0, 7), 1.0)]
    """
    options = checked_options(options, "verify_attribution")
    max_writers = positive_int(max_writers, what="max_writers")
    sink = neurons.sink_position
    batches = batches_for(model, inputs, options)
    paths = neurons.paths
    streams = sorted({p.peak_layer for p in paths})
    result = CausalCheck(sink, causal_threshold=causal_threshold)
    if not paths:
        return result
    before, attn_before = _measure(model, batches, sink, streams, [], options, "baseline")
    for path in paths:
        if writers is not None and path.dim in writers:
            chosen = [(int(l), int(n), _contribution(neurons, int(l), int(n), path.dim)) for l, n in writers[path.dim]]
        else:
            chosen = default_writers(neurons, path.dim, max_writers)
        per_layer: dict[int, list[int]] = {}
        for l, n, _ in chosen:
            per_layer.setdefault(l, []).append(n)
        hooks = edit_neurons(model, per_layer, positions=[sink])
        after, attn_after = _measure(model, batches, sink, streams, hooks, options, f"dim {path.dim} ablated")
        i = streams.index(path.peak_layer)
        v0, v1 = float(before[i, path.dim]), float(after[i, path.dim])
        result.checks.append(DimCheck(
            dim=path.dim, peak_stream=path.peak_layer, writers=chosen, value_before=v0, value_after=v1,
            dim_removed=1.0 - v1 / v0 if abs(v0) > TINY else float("nan"),
            attention_before=attn_before, attention_after=attn_after,
            attention_removed=1.0 - attn_after / attn_before if attn_before > TINY else float("nan"),
        ))
    return result
