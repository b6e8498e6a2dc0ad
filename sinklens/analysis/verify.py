"""The causal check of a super-neuron attribution: zero what each massive dimension is credited to, at the sink.

Per dimension three sets are zeroed at the sink only and the inputs run again (each distinct set once): its top
writers by direct contribution (``"direct"``) and by total effect (``"total"``), those reaching ``super_share`` of
the peak (at most ``max_writers``, at least the best one; zeroed at ``mlp.hook_post`` by ``edit_neurons``), and
the block-level control, the whole ``hook_mlp_out`` of its writing blocks (``"blocks"``).
An :class:`Ablation` reports ``dim_removed = 1 − value_after / value_before`` (the dim's mean at the sink at its peak
stream) and ``attention_removed = 1 − attention_after / attention_before`` (the sink's received attention: mean
over layers and heads of ``received[l, h, sink]``, queries from ``MIN_QUERY``, as in ``SinkResult``).
"""

from __future__ import annotations

import math
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
from sinklens.hooks import MLP_OUT, hook_name, model_dims
from sinklens.inputs import Inputs, TokenBatch
from sinklens.interventions.neurons import edit_neurons
from sinklens.options import RunOptions, checked_options
from sinklens.streaming import batches_for, stream
from sinklens.validate import positive_int

#: Queries before this position are left out of the sink's received attention (as in ``SinkSettings.min_query``).
MIN_QUERY = 1


@dataclass(eq=False)
class Ablation(StructuralEq):
    """One set zeroed at the sink (see the module docstring).

    Attributes:
        kind: ``"direct"`` / ``"total"`` (neurons ranked by direct contribution / total effect) or ``"blocks"``.
        zeroed: ``(layer, neuron, attributed effect)`` rows (residual units), or ``(block, mlp_out in the dim)``.
        value_after / dim_removed: the dim at the peak stream with the set zeroed; ``1 − value_after / value_before``.
        attention_after / attention_removed: the sink's received attention; ``1 − after / before``.
    """

    kind: str
    zeroed: list[tuple[Any, ...]]
    value_after: float
    dim_removed: float
    attention_after: float
    attention_removed: float


@dataclass(eq=False)
class DimCheck(StructuralEq):
    """The causal check of one massive dimension (see the module docstring).

    Attributes:
        dim: the residual dimension; ``peak_stream``: the residual-stream index its value is read at.
        value_before / attention_before: the dim at ``peak_stream`` and the sink's received attention, unablated.
        ablations: the neuron-level sets (``"direct"``, then ``"total"`` when computed) and the ``"blocks"`` control.
        writers_cause_dim: some neuron-level set removes at least ``causal_threshold`` of the dim.
        writers_cause_sink: that set (the one removing most of the dim) removes at least ``attention_threshold`` of
            the sink's attention.
        dim_causes_sink: the block control removes at least ``causal_threshold`` of the dim and ``attention_threshold``
            of the attention.
    """

    dim: int
    peak_stream: int
    value_before: float
    attention_before: float
    ablations: list[Ablation]
    writers_cause_dim: bool
    writers_cause_sink: bool
    dim_causes_sink: bool

    def ablation(self, kind: str) -> Ablation | None:
        """The ablation of that kind (None if not run)."""
        return next((a for a in self.ablations if a.kind == kind), None)


@dataclass(eq=False)
class CausalCheck(StructuralEq):
    """Result of :func:`verify_attribution`: one :class:`DimCheck` per massive dimension.

    ``causal_threshold`` / ``attention_threshold``: the share of the dim / of the sink's attention an ablation must
    remove to be called causal for it. ``n_passes``: forward passes over the inputs (baseline + one per distinct set).
    """

    sink_position: int
    checks: list[DimCheck] = field(default_factory=list)
    causal_threshold: float = 0.5
    attention_threshold: float = 0.1
    n_passes: int = 0

    def is_causal(self, dim: int) -> bool:
        """Whether zeroing ``dim``'s attributed writers removed at least ``causal_threshold`` of it."""
        return next(c for c in self.checks if c.dim == dim).writers_cause_dim

    def lines(self) -> list[str]:
        """Per dimension: one line per ablation, then the two verdicts."""
        out, pct = [], lambda x: f"{100 * x:.0f}%"
        label = {"direct": "top writers by direct contribution", "total": "top writers by total effect",
                 "blocks": "writing blocks' whole MLP output"}
        for c in self.checks:
            out.append(f"  dim {c.dim} (stream {c.peak_stream}: {c.value_before:+.1f}; sink attention "
                       f"{c.attention_before:.3f}), zeroed at position {self.sink_position}:")
            for a in c.ablations:
                who = ", ".join(f"L{z[0]}N{z[1]}" if len(z) == 3 else f"block {z[0]}" for z in a.zeroed)
                out.append(f"    {label[a.kind]} ({who}): removes {pct(a.dim_removed)} of dim {c.dim} ({a.value_after:+.1f}) "
                           f"and {pct(a.attention_removed)} of the sink's attention ({a.attention_after:.3f})")
            yes = {True: "causal", False: "NOT causal"}
            out.append(f"    verdict (>= {pct(self.causal_threshold)} of the dim, >= {pct(self.attention_threshold)} of "
                       f"the attention removed): writers -> dim {c.dim}: {yes[c.writers_cause_dim]}; writers -> sink: "
                       f"{yes[c.writers_cause_sink]}; dim {c.dim} -> sink (block control): {yes[c.dim_causes_sink]}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return to_json({"sink_position": self.sink_position, "causal_threshold": self.causal_threshold,
                        "attention_threshold": self.attention_threshold, "min_query": MIN_QUERY,
                        "n_passes": self.n_passes, "checks": self.checks})


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


def default_writers(neurons: SuperNeurons, dim: int, max_writers: int = 10, by: str = "direct") -> list[tuple[int, int, float]]:
    """The neurons credited with ``dim`` ranked ``by`` direct contribution or total effect (module docstring)."""
    floor = neurons.settings.super_share * abs(neurons.path(dim).peak_value)
    top = neurons.top(dim, max_writers, by=by)
    return [w for w in top if abs(w[2]) >= floor] or top[:1]


def _zero_mlp_out(sink: int):
    def hook(act: Tensor, hook: Any) -> Tensor:
        act = act.clone()
        act[:, sink] = 0.0
        return act

    return hook


def verify_attribution(
    model: Any,
    inputs: Inputs | None,
    neurons: SuperNeurons,
    *,
    writers: dict[int, Sequence[tuple[int, int]]] | None = None,
    max_writers: int = 10,
    causal_threshold: float = 0.5,
    attention_threshold: float = 0.1,
    options: RunOptions = RunOptions(),
) -> CausalCheck:
    """Zero each massive dimension's credited writers and writing blocks at the sink; measure what disappears.

    Args:
        inputs: the inputs the attribution was computed on (anything :func:`sinklens.inputs.as_batches` takes).
        neurons: the :class:`SuperNeurons` result whose ``paths`` are checked.
        writers: ``{dim: [(layer, neuron), ...]}`` to zero instead of the attributed writers (e.g. a control); that
            dim's ``"direct"`` ablation, and no ``"total"`` one.
        max_writers: at most this many attributed writers per set.
        causal_threshold / attention_threshold: the share of the dim / of the sink's attention an ablation must
            remove to be called causal for it (:class:`DimCheck`).
        options: run settings (:class:`~sinklens.options.RunOptions`). One pass for the baseline and one per distinct
            set over all of ``inputs``.

    Examples:
        >>> from sinklens.analysis.neurons import find_super_neurons
        >>> from sinklens.testing.planted import planted_model
        >>> model, spec = planted_model(n_layers=2, layer=0, neuron=7, dim=5)
        >>> quiet = RunOptions(progress=False)
        >>> check = verify_attribution(model, "t3 t4 t5 t6", find_super_neurons(model, "t3 t4 t5 t6", options=quiet),
        ...                            options=quiet)
        >>> [(c.dim, c.ablations[0].zeroed[0][:2], round(c.ablations[0].dim_removed, 2)) for c in check.checks]
        [(5, (0, 7), 1.0)]
    """
    options = checked_options(options, "verify_attribution")
    max_writers = positive_int(max_writers, what="max_writers")
    sink = neurons.sink_position
    batches = batches_for(model, inputs, options)
    paths = neurons.paths
    streams = sorted({p.peak_layer for p in paths})
    result = CausalCheck(sink, causal_threshold=causal_threshold, attention_threshold=attention_threshold)
    if not paths:
        return result
    passes: dict[frozenset, tuple[Tensor, float]] = {}

    def measure(key: frozenset, what: str) -> tuple[Tensor, float]:
        if key not in passes:
            neuron_sets: dict[int, list[int]] = {}
            for kind, l, n in sorted(key):
                if kind == "neuron":
                    neuron_sets.setdefault(l, []).append(n)
            hooks = edit_neurons(model, neuron_sets, positions=[sink]) if neuron_sets else []
            hooks += [(hook_name(b, MLP_OUT), _zero_mlp_out(sink)) for kind, b, _ in sorted(key) if kind == "block"]
            passes[key] = _measure(model, batches, sink, streams, hooks, options, what)
        return passes[key]

    before, attn_before = measure(frozenset(), "baseline")
    for path in paths:
        sets = {}
        if writers is not None and path.dim in writers:
            sets["direct"] = [(int(l), int(n), _contribution(neurons, int(l), int(n), path.dim)) for l, n in writers[path.dim]]
        else:
            sets["direct"] = default_writers(neurons, path.dim, max_writers)
            if neurons.total_effect is not None:
                sets["total"] = default_writers(neurons, path.dim, max_writers, by="total")
        blocks = [s.block for s in path.writers] or [path.write_layer]
        sets["blocks"] = [(b, float(neurons.mlp_out_sink[b, path.dim])) for b in blocks]
        i = streams.index(path.peak_layer)
        v0 = float(before[i, path.dim])
        ablations = []
        for kind, rows in sets.items():
            key = frozenset(("block", b, 0) for b, _ in rows) if kind == "blocks" else frozenset(
                ("neuron", l, n) for l, n, _ in rows)
            after, attn_after = measure(key, f"dim {path.dim} {kind} zeroed")
            v1 = float(after[i, path.dim])
            ablations.append(Ablation(kind, rows, v1, 1.0 - v1 / v0 if abs(v0) > TINY else float("nan"), attn_after,
                                      1.0 - attn_after / attn_before if attn_before > TINY else float("nan")))
        best = max(ablations[:-1], key=lambda a: -math.inf if math.isnan(a.dim_removed) else a.dim_removed)
        blk = ablations[-1]
        result.checks.append(DimCheck(
            path.dim, path.peak_layer, v0, attn_before, ablations,
            writers_cause_dim=best.dim_removed >= causal_threshold,
            writers_cause_sink=best.attention_removed >= attention_threshold,
            dim_causes_sink=blk.dim_removed >= causal_threshold and blk.attention_removed >= attention_threshold,
        ))
    result.n_passes = len(passes)
    return result
