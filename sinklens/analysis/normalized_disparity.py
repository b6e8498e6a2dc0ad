"""Dimension disparity after normalisation: does the sink's massive dimension survive the norm?

In ``blocks.{l}.ln1.hook_normalized`` (what layer ``l``'s queries, keys and values read), the ratio
of each dimension's ``|x_d|`` to the mean ``|x_j|`` of the token's other dimensions, at the sink
versus at other tokens. ``hook_normalized`` is the normalised vector *before* the norm's learned
gain (and bias), on every TransformerLens version.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.analysis._common import TINY as _TINY
from sinklens.analysis._common import check_sink_position, once_per_forward, options_from_legacy, other_positions, row_index, sink_position_arg
from sinklens.errors import InvalidArgumentError
from sinklens.export import to_json
from sinklens.hooks import LN1_NORMALIZED, model_device, model_dims, resolve_layers
from sinklens.inputs import Inputs, TokenBatch
from sinklens.options import RunOptions
from sinklens.streaming import BatchFold, Reducer, per_layer_hooks, run


@dataclass
class NormalizedDisparity:
    """Dimension disparity in ``ln1.hook_normalized`` (see the module docstring).

    For a token's normalised vector ``x``, ``r_d = |x_d| / mean_{j != d} |x_j|``.

    Attributes:
        ratio_sink: mean over sequences of ``r_d`` at ``sink_position``.
        ratio_other: mean of ``r_d`` over all other valid tokens; ``ratio_other_max``: its maximum.
    """

    layers: list[int]
    sink_position: int
    site: str
    ratio_sink: Float[Tensor, "layer dim"]
    ratio_other: Float[Tensor, "layer dim"]
    ratio_other_max: Float[Tensor, "layer dim"]
    n_sequences: int

    def top_dim(self, layer: int) -> int:
        """The dimension with the largest sink ratio at ``layer``."""
        return int(self.ratio_sink[self._row(layer)].argmax())

    def _row(self, layer: int) -> int:
        return row_index(self.layers, layer)

    def rows(self, dims: list[int] | None = None) -> list[dict[str, Any]]:
        """Per layer (× dim; default the layer's top sink dim): ratio at the sink, at other tokens, and their quotient."""
        out = []
        for i, layer in enumerate(self.layers):
            for d in dims if dims is not None else [self.top_dim(layer)]:
                sink, other = float(self.ratio_sink[i, d]), float(self.ratio_other[i, d])
                out.append({"layer": layer, "dim": d, "ratio_sink": sink, "ratio_other": other,
                            "ratio_other_max": float(self.ratio_other_max[i, d]),
                            "contrast": sink / other if other > 0 else float("inf")})
        return out

    def to_dict(self, dims: list[int] | None = None) -> dict[str, Any]:
        return to_json({"layers": self.layers, "sink_position": self.sink_position, "site": self.site,
                        "n_sequences": self.n_sequences, "rows": self.rows(dims)})


class NormalizedDisparityReducer(Reducer[NormalizedDisparity]):
    """Streams ``blocks.{l}.ln1.hook_normalized`` into :class:`NormalizedDisparity` (``[layer, dim]`` sums only)."""

    statistics = ("sink_sum", "other_sum", "other_max", "n_sequences", "n_other")
    maxima = ("other_max",)

    def __init__(self, model: Any, *, sink_position: int = 0, layers: int | Sequence[int] | None = None, site: str = LN1_NORMALIZED):
        d = model_dims(model)
        self.layers = resolve_layers(layers, d.n_layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.sink, self.site, self.d_model = sink_position_arg(sink_position), site, d.d_model
        self.device = model_device(model)
        self.reset()

    def reset(self) -> None:
        n, dev = len(self.layers), self.device
        self.sink_sum = torch.zeros(n, self.d_model, device=dev, dtype=torch.float64)
        self.other_sum = torch.zeros(n, self.d_model, device=dev, dtype=torch.float64)
        self.other_max = torch.zeros(n, self.d_model, device=dev, dtype=torch.float32)
        self.n_sequences = 0
        self.n_other = 0

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        check_sink_position(batch, self.sink)
        other = other_positions(batch, self.sink)

        def fold(act: Tensor, layer: int) -> None:  # [batch, pos, d_model]
            i = self.row[layer]
            a = act.float().abs()
            rest = (a.sum(-1, keepdim=True) - a) / (a.shape[-1] - 1)
            r = a / rest.clamp_min(_TINY)
            self.sink_sum[i] += r[:, self.sink].double().sum(0)
            ro = r * other[..., None]
            self.other_sum[i] += ro.double().sum(dim=(0, 1))
            self.other_max[i] = torch.maximum(self.other_max[i], ro.amax(dim=(0, 1)))

        # TL 3.x runs ln1.hook_normalized once per q/k/v input: fold the first call only.
        return BatchFold(per_layer_hooks(self.site, self.layers, once_per_forward(fold)))

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        self.n_sequences += batch.valid.shape[0]
        self.n_other += int(other_positions(batch, self.sink).sum())

    def result(self) -> NormalizedDisparity:
        if self.n_sequences == 0:
            raise InvalidArgumentError("No batches were streamed; nothing to summarise.")
        other = self.other_sum / self.n_other if self.n_other else torch.full_like(self.other_sum, float("nan"))
        return NormalizedDisparity(
            list(self.layers), self.sink, self.site, (self.sink_sum / self.n_sequences).float().cpu(),
            other.float().cpu(), self.other_max.cpu(), self.n_sequences,
        )


def normalized_disparity(
    model: Any,
    inputs: Inputs | None = None,
    *,
    sink_position: int = 0,
    layers: int | Sequence[int] | None = None,
    options: RunOptions = RunOptions(),
    **deprecated: Any,
) -> NormalizedDisparity:
    """Dimension disparity after each layer's first normalisation, at the sink vs other tokens.

    Examples:
        >>> from sinklens.testing.planted import planted_model
        >>> model, spec = planted_model(n_layers=2, layer=0, dim=5)
        >>> nd = normalized_disparity(model, "t3 t4 t5 t6")
        >>> nd.top_dim(1), bool(nd.ratio_sink[1, 5] > 100), float(nd.ratio_other[1, 5])
        (5, True, 0.0)
    """
    options = options_from_legacy(options, deprecated, "normalized_disparity")
    reducer = NormalizedDisparityReducer(model, sink_position=sink_position, layers=layers)
    return run(model, inputs, reducer, options=options)[0]
