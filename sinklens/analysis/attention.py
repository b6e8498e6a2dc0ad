"""Attention mass received by each key position: the basic measurement behind every sink metric."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.display import CompactRepr
from sinklens.errors import InvalidArgumentError
from sinklens.hooks import PATTERN, model_device, model_dims, resolve_layers
from sinklens.inputs import TokenBatch
from sinklens.streaming import BatchFold, Reducer, per_layer_hooks
from sinklens.validate import positive_int
from sinklens.visibility import Visibility, attention_visibility

#: Per analysed layer (a model layer number), the ``[batch, query, key]`` 0/1 weights of the counted queries.
QueryWeights = dict[int, Float[Tensor, "batch query key"]]


@dataclass(repr=False, eq=False)
class AttentionReceived(CompactRepr):
    """Mean attention each key position receives, per layer × head: ``received[l, h, k]`` = mean of
    ``pattern[l, h, q, k]`` over the real queries ``q >= min_query`` that see ``k`` in layer ``l``
    (:mod:`sinklens.visibility`), pooled over sequences; NaN where none. ``n_queries_by_layer``: the (sequence,
    query) pairs averaged per layer and key; ``n_queries``: its max."""

    received: Float[Tensor, "layer head key_pos"]
    n_queries: Float[Tensor, " key_pos"]
    layers: list[int]
    min_query: int
    n_queries_by_layer: Float[Tensor, "layer key_pos"] | None = None

    def at(self, position: int) -> Float[Tensor, "layer head"]:
        """Attention received by one key position, per layer × head."""
        return self.received[:, :, position]


class AttentionReceivedReducer(Reducer[AttentionReceived]):
    """Streams ``hook_pattern`` into :class:`AttentionReceived`: float64 sums of ``Σ_q pattern[b, h, q, k]`` over
    the counted queries and their counts per layer and key. Other reducers hold one and call its methods."""

    statistics = ("sums", "counts")

    def __init__(self, model: Any, *, layers: int | Sequence[int] | None = None, min_query: int = 0):
        dims = model_dims(model)
        self.min_query = positive_int(min_query, what="min_query", minimum=0)
        if self.min_query >= dims.n_ctx:
            raise InvalidArgumentError(f"min_query must be in [0, {dims.n_ctx - 1}] (the model's positions), got {min_query}.")
        self.layers = resolve_layers(layers, dims.n_layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.max_pos, self.n_heads, self.device = dims.n_ctx, dims.n_heads, model_device(model)
        self.visibility: Visibility = attention_visibility(model)
        self.reset()

    def reset(self) -> None:
        f64 = dict(device=self.device, dtype=torch.float64)
        self.sums = torch.zeros(len(self.layers), self.n_heads, self.max_pos, **f64)
        self.counts = torch.zeros(len(self.layers), self.max_pos, **f64)

    def visible_weights(self, batch: TokenBatch, *, min_query: int = 0) -> QueryWeights:
        """Per analysed layer, ``[batch, query, key]``: 1.0 where the real query ``q >= min_query`` can see the
        real key ``k`` (:meth:`~sinklens.visibility.Visibility.batch_mask`), else 0; shared between equal windows."""
        late = torch.arange(batch.tokens.shape[1], device=batch.valid.device) >= min_query
        first = {self.visibility.window(layer): layer for layer in reversed(self.layers)}  # first layer per window
        masks = {w: (self.visibility.batch_mask(layer, batch.valid) & late[None, :, None]).float()
                 for w, layer in first.items()}
        return {layer: masks[self.visibility.window(layer)] for layer in self.layers}

    def query_weights(self, batch: TokenBatch) -> QueryWeights:
        """The counted queries (``min_query`` applied), per analysed layer (see :meth:`visible_weights`)."""
        return self.visible_weights(batch, min_query=self.min_query)

    def fold_pattern(self, pattern: Float[Tensor, "batch head query key"], layer: int,
                     weights: QueryWeights) -> Float[Tensor, "batch head key"]:
        """Add one layer's pattern to the sums; return ``Σ_q pattern[b, h, q, k]`` over the counted queries."""
        per_seq = (pattern.float() * weights[layer][:, None]).sum(dim=2)  # faster than einsum on CPU
        self.add(layer, per_seq)
        return per_seq

    def add(self, layer: int, per_seq: Float[Tensor, "batch head key"]) -> None:
        """Add one layer's per-sequence column sums over the counted queries (however computed) to the sums."""
        self.sums[self.row[layer], :, : per_seq.shape[2]] += per_seq.sum(dim=0).double()

    def count_queries(self, counts: dict[int, Float[Tensor, "batch key"]]) -> None:
        """Add the batch's counted queries per layer, sequence and key (once per batch, after the forward)."""
        for layer in self.layers:
            counted = counts[layer].sum(dim=0)
            self.counts[self.row[layer], : counted.shape[0]] += counted.double()

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        weights = self.query_weights(batch)

        def fold(pattern: Tensor, layer: int) -> None:  # a hook that returns a tensor would replace the pattern
            self.fold_pattern(pattern, layer, weights)

        return BatchFold(per_layer_hooks(PATTERN, self.layers, fold), state=weights)

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        self.count_queries({layer: w.sum(dim=1) for layer, w in fold.state.items()})

    def result(self) -> AttentionReceived:
        seen = (self.counts > 0).any(dim=0)
        n = int(seen.nonzero().max()) + 1 if seen.any() else 0
        counts = self.counts[:, :n]
        received = (self.sums[:, :, :n] / counts[:, None]).float()
        return AttentionReceived(received.cpu(), counts.max(dim=0).values.float().cpu(), self.layers, self.min_query,
                                 counts.float().cpu())
