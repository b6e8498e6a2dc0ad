"""Super neurons from weights alone: which FFN neurons *could* write a massive dimension (:class:`WeightNeurons`).
Weights are read as stored (on Gemma 2/3 before the post-MLP norm)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.analysis._common import TINY as _TINY
from sinklens.analysis._common import check_sink_position, once_per_forward, row_index, run_analyzer, sink_position_arg
from sinklens.analysis.neuron_result import check_fits_model
from sinklens.analysis.neurons import mlp_weight_statistics
from sinklens.display import CompactRepr
from sinklens.errors import InvalidArgumentError, UnsupportedArchitectureError
from sinklens.export import to_json
from sinklens.hooks import layer_weight, model_device, model_dims, resolve_layers
from sinklens.inputs import Inputs, TokenBatch
from sinklens.options import RunOptions
from sinklens.residual_units import input_norm_path, moe_reason, no_mlp_reason
from sinklens.streaming import BatchFold, Reducer, bound_hooks
from sinklens.validate import as_int, positive_int


def _median_ratio(x: Float[Tensor, "layer neuron"]) -> Float[Tensor, "layer neuron"]:
    return x / x.median(dim=-1, keepdim=True).values.clamp_min(_TINY)


@dataclass(repr=False, eq=False)
class SinkInput(CompactRepr):
    """Mean over sequences of the MLP input norm's ``hook_normalized`` at the sink (``site``: ``"ln2.hook_normalized"``,
    or ``"ln1.hook_normalized"`` on a post-LN model)."""

    layers: list[int]
    sink_position: int
    site: str
    x: Float[Tensor, "layer d_model"]


class SinkMeanReducer(Reducer[Tensor]):
    """``[hook, d_model]``: mean over sequences of ``act[:, sink]`` at each hook of ``names``, once per forward."""

    statistics = ("sums", "n")

    def __init__(self, model: Any, sink: int, names: Sequence[str]):
        self.sink, self.names = sink_position_arg(sink), list(names)
        self.d_model, self.device = model_dims(model).d_model, model_device(model)
        self.reset()

    def reset(self) -> None:
        self.sums = torch.zeros(len(self.names), self.d_model, device=self.device, dtype=torch.float64)
        self.n = 0

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        check_sink_position(batch, self.sink)

        def fold(act: Tensor, row: int) -> None:  # [batch, pos, d_model]
            self.sums[row] += act[:, self.sink].double().sum(0)

        return BatchFold(bound_hooks(self.names, range(len(self.names)), once_per_forward(fold)))

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        self.n += batch.valid.shape[0]

    def result(self) -> Tensor:
        if self.n == 0:
            raise InvalidArgumentError("No batches were streamed; nothing to summarise.")
        return (self.sums / self.n).float().cpu()


class SinkInputReducer(SinkMeanReducer):
    """Per-layer mean of the MLP input norm's ``hook_normalized`` at ``sink_position`` (:class:`SinkInput`)."""

    def __init__(self, model: Any, *, sink_position: int = 0, layers: int | Sequence[int] | None = None):
        self.layers = resolve_layers(layers, model_dims(model).n_layers)
        paths = [input_norm_path(model, layer, "mlp") for layer in self.layers]
        self.site = paths[0].rsplit(".", 1)[-1] + ".hook_normalized" if paths else "ln2.hook_normalized"
        super().__init__(model, sink_position, [f"{path}.hook_normalized" for path in paths])

    def result(self) -> SinkInput:  # type: ignore[override]
        return SinkInput(list(self.layers), self.sink, self.site, super().result())


def sink_inputs(model: Any, inputs: Inputs | None = None, *, sink_position: int = 0,
                layers: int | Sequence[int] | None = None,
                options: RunOptions = RunOptions()) -> SinkInput:
    """Mean normalised MLP input at ``sink_position`` per layer (:class:`SinkInput`)."""
    return run_analyzer(model, inputs, SinkInputReducer, where="sink_inputs", options=options,
                        sink_position=sink_position, layers=layers)


@dataclass(repr=False, eq=False)
class WeightNeurons(CompactRepr):
    """Weight-only super-neuron statistics per layer × neuron.

    Attributes:
        in_norm / gate_norm / out_norm: L2 norms of ``W_in[l, :, n]``, ``W_gate[l, :, n]`` (None if
            not gated), ``W_out[l, n, :]``; ``*_ratio``: over the layer's median neuron.
        out_kurtosis / out_top_share: :func:`~sinklens.analysis.neurons.row_sparsity` of the rows.
        score: ``in_norm_ratio × gate_norm_ratio × out_norm_ratio`` (the ranking of :meth:`top`).
        align_in / align_gate: cosine of the :class:`SinkInput` with those columns.
        out_dim_weight: ``W_out[l, n, d]`` for each ``d`` of ``dims``.
    """

    layers: list[int]
    in_norm: Float[Tensor, "layer neuron"]
    gate_norm: Float[Tensor, "layer neuron"] | None
    out_norm: Float[Tensor, "layer neuron"]
    in_norm_ratio: Float[Tensor, "layer neuron"]
    gate_norm_ratio: Float[Tensor, "layer neuron"] | None
    out_norm_ratio: Float[Tensor, "layer neuron"]
    out_kurtosis: Float[Tensor, "layer neuron"]
    out_top_share: Float[Tensor, "layer neuron"]
    row_top_k: int
    score: Float[Tensor, "layer neuron"]
    align_in: Float[Tensor, "layer neuron"] | None
    align_gate: Float[Tensor, "layer neuron"] | None
    dims: list[int]
    out_dim_weight: Float[Tensor, "layer neuron n_dims"]
    sink_position: int | None = None

    def top(self, k: int = 10) -> list[tuple[int, int, float]]:
        """``(layer, neuron, score)`` of the ``k`` highest-scoring neurons."""
        vals, idx = self.score.flatten().topk(min(k, self.score.numel()))
        n = self.score.shape[1]
        return [(self.layers[int(i) // n], int(i) % n, float(v)) for i, v in zip(idx, vals)]

    def neuron_row(self, layer: int, neuron: int) -> dict[str, Any]:
        """All statistics of one neuron as a dict."""
        r = row_index(self.layers, layer)
        names = ("in_norm", "gate_norm", "out_norm", "in_norm_ratio", "gate_norm_ratio", "out_norm_ratio",
                 "out_kurtosis", "out_top_share", "score", "align_in", "align_gate")
        values = {name: None if (t := getattr(self, name)) is None else float(t[r, neuron]) for name in names}
        return ({"layer": layer, "neuron": neuron} | values
                | {f"out_weight_{d}": float(self.out_dim_weight[r, neuron, j]) for j, d in enumerate(self.dims)})

    def rows(self, k: int = 20) -> list[dict[str, Any]]:
        """DataFrame-ready rows of the ``k`` top-scoring neurons, with their rank."""
        return [{"rank": i} | self.neuron_row(l, n) for i, (l, n, _) in enumerate(self.top(k))]

    def to_dict(self, k: int = 20) -> dict[str, Any]:
        return to_json({"layers": self.layers, "dims": self.dims, "row_top_k": self.row_top_k,
                        "sink_position": self.sink_position, "rows": self.rows(k)})


def super_neurons_from_weights(model: Any, *, layers: int | Sequence[int] | None = None, dims: list[int] | None = None,
                               sink_input: SinkInput | None = None, row_top_k: int = 1) -> WeightNeurons:
    """Rank FFN neurons as super-neuron candidates from their weights alone (no forward pass). ``dims``: dims
    whose ``W_out`` entries to report; ``sink_input`` adds the read-vector alignments.

    Examples:
        >>> from sinklens.testing.planted import planted_model
        >>> model, spec = planted_model(n_layers=2, layer=0, neuron=7, dim=5)
        >>> super_neurons_from_weights(model).top(1)[0][:2]
        (0, 7)
    """
    if (reason := no_mlp_reason(model) or moe_reason(model)) is not None:
        raise UnsupportedArchitectureError(f"super_neurons_from_weights cannot rank neurons on this model: {reason}.")
    d = model_dims(model)
    layer_list = resolve_layers(layers, d.n_layers)
    dims = [as_int(x, what="dims") for x in (dims or [])]
    check_fits_model(d.d_model, positive_int(row_top_k, what="row_top_k"), dims)
    stats = {k: None if t is None else t.cpu() for k, t in mlp_weight_statistics(model, layer_list, row_top_k).items()}
    in_norm, gate_norm = stats["in_norm"], stats["gate_norm"]
    in_ratio, out_ratio = _median_ratio(in_norm), _median_ratio(stats["out_norm"])
    gate_ratio = None if gate_norm is None else _median_ratio(gate_norm)
    score = in_ratio * out_ratio * (gate_ratio if gate_ratio is not None else 1.0)
    out_dim_weight = torch.stack([layer_weight(model, "W_out", l)[:, dims].float().cpu() for l in layer_list])
    align_in = align_gate = None
    if sink_input is not None:
        if missing := [l for l in layer_list if l not in sink_input.layers]:
            raise InvalidArgumentError(f"sink_input has no layers {missing}; it covers {sink_input.layers}.")
        x = sink_input.x[[sink_input.layers.index(l) for l in layer_list]].float()

        def cosine(name: str, norms: Tensor) -> Tensor:  # [layer, neuron]: cos(x[l], w[l][:, n])
            dots = torch.stack([x[i] @ layer_weight(model, name, l).float().to(x.device)
                                for i, l in enumerate(layer_list)])
            return dots / (x.norm(dim=-1, keepdim=True) * norms.to(x.device)).clamp_min(_TINY)

        align_in = cosine("W_in", in_norm)
        align_gate = None if gate_norm is None else cosine("W_gate", gate_norm)
    return WeightNeurons(  # stats: in_norm, gate_norm, out_norm, out_kurtosis, out_top_share
        layers=layer_list, **stats, in_norm_ratio=in_ratio, gate_norm_ratio=gate_ratio, out_norm_ratio=out_ratio,
        row_top_k=row_top_k, score=score, align_in=align_in, align_gate=align_gate, dims=dims,
        out_dim_weight=out_dim_weight, sink_position=None if sink_input is None else sink_input.sink_position,
    )
