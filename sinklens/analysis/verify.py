"""The causal check of a super-neuron attribution: zero what each dimension is credited to.

Per dimension, each set is zeroed at the sink only and the inputs run again: its top writers by direct contribution
(``"direct"``) and by total effect (``"total"``), those reaching ``super_share`` of the peak (at most
``MAX_WRITERS``, at least one), and the control, its writing blocks' whole ``hook_mlp_out`` (``"blocks"``).
``dim_removed = 1 − value_after / value_before`` (the dim at the sink at its peak stream); ``attention_removed``:
the same for the sink's mean received attention (queries from ``MIN_QUERY``)."""

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
from sinklens.inputs import Inputs
from sinklens.interventions.neurons import edit_neurons
from sinklens.options import RunOptions, checked_options
from sinklens.streaming import batches_for, stream

#: Queries before this position are left out of the sink's received attention (as in ``SinkSettings.min_query``).
MIN_QUERY = 1
MAX_WRITERS = 10


@dataclass(eq=False)
class Ablation(StructuralEq):
    """One set zeroed at the sink (module docstring): ``kind`` ``"direct"``, ``"total"`` or ``"blocks"``; ``zeroed``:
    ``(layer, neuron, attributed effect)`` or ``(block, mlp_out in the dim)`` rows."""

    kind: str
    zeroed: list[tuple[Any, ...]]
    value_after: float
    dim_removed: float
    attention_after: float
    attention_removed: float


@dataclass(eq=False)
class DimCheck(StructuralEq):
    """The causal check of one massive dim, read at ``peak_stream``. ``writers_cause_dim``: some neuron-level set
    removes at least ``causal_threshold`` of the dim; ``writers_cause_sink``: the one removing most of it removes
    ``attention_threshold`` of the sink's attention; ``dim_causes_sink``: the ``"blocks"`` control removes both."""

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
    """Result of :func:`verify_attribution`: one :class:`DimCheck` per massive dim; ``causal_threshold`` /
    ``attention_threshold``: the share of the dim / of the sink's attention a set must remove to be causal;
    ``n_passes``: passes over the inputs (baseline + one per set)."""

    sink_position: int
    checks: list[DimCheck] = field(default_factory=list)
    causal_threshold: float = 0.5
    attention_threshold: float = 0.1
    n_passes: int = 0

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


def verify_attribution(model: Any, inputs: Inputs | None, neurons: SuperNeurons, *,
                       writers: dict[int, Sequence[tuple[int, int]]] | None = None,
                       options: RunOptions = RunOptions()) -> CausalCheck:
    """Zero each massive dim's credited writers and writing blocks at the sink; measure what disappears.
    ``inputs``: those ``neurons`` was computed on; ``writers``: ``{dim: [(layer, neuron), ...]}`` zeroed instead of
    the attributed writers (then no ``"total"`` set).

    Examples:
        >>> from sinklens.analysis.neurons import find_super_neurons
        >>> from sinklens.testing.planted import planted_model
        >>> model, spec = planted_model(n_layers=2, layer=0, neuron=7, dim=5)
        >>> check = verify_attribution(model, "t3 t4 t5 t6", find_super_neurons(model, "t3 t4 t5 t6"))
        >>> [(c.dim, c.ablations[0].zeroed[0][:2], round(c.ablations[0].dim_removed, 2)) for c in check.checks]
        [(5, (0, 7), 1.0)]
    """
    options = checked_options(options, "verify_attribution")
    sink = neurons.sink_position
    batches = batches_for(model, inputs, options)
    paths = neurons.paths
    streams = sorted({p.peak_layer for p in paths})
    result = CausalCheck(sink)
    if not paths:
        return result
    stream_hooks = [stream_hook(s, model_dims(model).n_layers) for s in streams]
    passes: dict[tuple[frozenset, frozenset], tuple[Tensor, float]] = {}

    def zero_at_sink(act: Tensor, hook: Any) -> Tensor:
        return act.index_fill(1, torch.tensor([sink], device=act.device), 0.0)

    def measure(what: str, zeroed: Sequence[tuple[int, int]] = (), blocks: Sequence[int] = ()) -> tuple[Tensor, float]:
        """(the residual at the sink at each peak stream, the sink's attention) with those zeroed at the sink."""
        key = (frozenset(zeroed), frozenset(blocks))
        if key not in passes:
            by_layer: dict[int, list[int]] = {}
            for layer, n in sorted(key[0]):
                by_layer.setdefault(layer, []).append(n)
            hooks = edit_neurons(model, by_layer, positions=[sink]) if by_layer else []
            hooks += [(hook_name(b, MLP_OUT), zero_at_sink) for b in sorted(key[1])]
            run = options.replace(extra_hooks=(*options.extra_hooks, *hooks), desc=f"verify_attribution: {what}")
            reducers = [SinkMeanReducer(model, sink, stream_hooks),
                        AttentionReceivedReducer(model, min_query=MIN_QUERY)]
            resid, received = stream(model, batches, reducers, options=run)
            passes[key] = resid, float(torch.nanmean(received.received[:, :, sink]))
        return passes[key]

    before, attn_before = measure("baseline")
    for path in paths:
        sets = {}
        if writers is not None and path.dim in writers:
            j = neurons.dims.index(path.dim)
            given = [(int(a), int(b)) for a, b in writers[path.dim]]
            sets["direct"] = [(l, n, float(neurons.contribution[neurons.layers.index(l), n, j])
                               if l in neurons.layers else float("nan")) for l, n in given]
        else:
            for by in ("direct", "total") if neurons.total_effect is not None else ("direct",):
                top = neurons.top(path.dim, MAX_WRITERS, by=by)
                floor = neurons.settings.super_share * abs(path.peak_value)
                sets[by] = [w for w in top if abs(w[2]) >= floor] or top[:1]
        blocks = [s.block for s in path.writers] or [path.write_layer]
        sets["blocks"] = [(b, float(neurons.mlp_out_sink[b, path.dim])) for b in blocks]
        i = streams.index(path.peak_layer)
        v0 = float(before[i, path.dim])
        ablations = []
        for kind, rows in sets.items():
            what = f"dim {path.dim} {kind} zeroed"
            after, attn_after = (measure(what, blocks=[b for b, _ in rows]) if kind == "blocks"
                                 else measure(what, [(l, n) for l, n, _ in rows]))
            v1 = float(after[i, path.dim])
            ablations.append(Ablation(kind, rows, v1, 1.0 - v1 / v0 if abs(v0) > TINY else float("nan"), attn_after,
                                      1.0 - attn_after / attn_before if attn_before > TINY else float("nan")))
        best = max(ablations[:-1], key=lambda a: -math.inf if math.isnan(a.dim_removed) else a.dim_removed)
        blk = ablations[-1]
        result.checks.append(DimCheck(
            path.dim, path.peak_layer, v0, attn_before, ablations,
            writers_cause_dim=best.dim_removed >= result.causal_threshold,
            writers_cause_sink=best.attention_removed >= result.attention_threshold,
            dim_causes_sink=blk.dim_removed >= result.causal_threshold
            and blk.attention_removed >= result.attention_threshold,
        ))
    result.n_passes = len(passes)
    return result
