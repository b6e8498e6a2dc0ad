"""Attention mass received by each key position: the basic measurement behind every sink metric."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.hooks import PATTERN, model_device, model_dims, resolve_layers
from sinklens.inputs import TokenBatch
from sinklens.streaming import BatchFold, Reducer, per_layer_hooks
from sinklens.validate import positive_int


@dataclass
class AttentionReceived:
    """Mean attention each key position receives, per layer × head.

    Attributes:
        received: ``received[l, h, k]`` = mean over valid queries ``q >= min_query`` that can see
            key ``k`` (``q >= k``) of ``pattern[l, h, q, k]``, pooled over all sequences (each valid
            (sequence, query) pair weighs the same). NaN where no such query exists.
        n_queries: number of (sequence, query) pairs averaged into ``received[:, :, k]``.
        layers: the model layer of each row.
        min_query: queries before this position were left out (a query at t sees only t+1 keys, so
            early queries put large mass on early keys for trivial reasons).
    """

    received: Float[Tensor, "layer head key_pos"]
    n_queries: Float[Tensor, " key_pos"]
    layers: list[int]
    min_query: int

    def at(self, position: int) -> Float[Tensor, "layer head"]:
        """Attention received by one key position, per layer × head."""
        return self.received[:, :, position]


class AttentionReceivedReducer(Reducer[AttentionReceived]):
    """Streams ``hook_pattern`` into :class:`AttentionReceived` without keeping any pattern.

    For each batch and layer it adds ``Σ_q pattern[b, h, q, k]`` over valid queries
    ``q >= max(k, min_query)`` into a ``[layer, head, key_pos]`` sum, and counts those queries per
    key, so the result is exact whatever the batch split (tested against a full cache).

    Other reducers reuse it by holding one (see :class:`~sinklens.analysis.sinks.SinkReducer`):
    :meth:`query_weights`, :meth:`fold_pattern` and :meth:`count_queries` are the three steps of a
    batch, and :meth:`fold_pattern` returns the per-sequence sums for the holder to use.
    """

    statistics = ("sums", "counts")

    def __init__(self, model: Any, *, layers: int | Sequence[int] | None = None, min_query: int = 0,
                 max_pos: int | None = None):
        dims = model_dims(model)
        self.min_query = positive_int(min_query, what="min_query", minimum=0)
        if self.min_query >= dims.n_ctx:
            from sinklens.errors import InvalidArgumentError

            raise InvalidArgumentError(f"min_query must be in [0, {dims.n_ctx - 1}] (the model's positions), got {min_query}.")
        self.layers = resolve_layers(layers, dims.n_layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.max_pos = dims.n_ctx if max_pos is None else positive_int(max_pos, what="max_pos")
        self.n_heads = dims.n_heads
        self.device = model_device(model)
        self.reset()

    def reset(self) -> None:
        f64 = dict(device=self.device, dtype=torch.float64)
        self.sums = torch.zeros(len(self.layers), self.n_heads, self.max_pos, **f64)
        self.counts = torch.zeros(self.max_pos, **f64)

    def query_weights(self, batch: TokenBatch) -> Float[Tensor, "batch query key"]:
        """1 where query q is valid, q >= min_query and q >= k; 0 elsewhere."""
        n = batch.tokens.shape[1]
        q = torch.arange(n, device=batch.tokens.device)
        causal = (q[:, None] >= q[None, :]) & (q[:, None] >= self.min_query)
        return (batch.valid[:, :, None] & causal[None]).to(torch.float32)

    def fold_pattern(
        self, pattern: Float[Tensor, "batch head query key"], layer: int, weights: Float[Tensor, "batch query key"]
    ) -> Float[Tensor, "batch head key"]:
        """Add one layer's pattern to the sums; return ``Σ_q pattern[b, h, q, k]`` over the counted queries."""
        per_seq = (pattern.float() * weights[:, None]).sum(dim=2)  # faster than einsum on CPU
        self.sums[self.row[layer], :, : per_seq.shape[2]] += per_seq.sum(dim=0).double()
        return per_seq

    def count_queries(self, weights: Float[Tensor, "batch query key"]) -> None:
        """Count the batch's (sequence, query) pairs per key (once per batch, after the forward)."""
        counted = weights.sum(dim=(0, 1))
        self.counts[: counted.shape[0]] += counted.double()

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        weights = self.query_weights(batch)

        def fold(pattern: Tensor, layer: int) -> None:  # pattern: [batch, head, query, key]
            self.fold_pattern(pattern, layer, weights)

        return BatchFold(per_layer_hooks(PATTERN, self.layers, fold), state=weights)

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        self.count_queries(fold.state)

    def result(self) -> AttentionReceived:
        n = int((self.counts > 0).nonzero().max()) + 1 if (self.counts > 0).any() else 0
        counts = self.counts[:n]
        received = (self.sums[:, :, :n] / counts).float()
        return AttentionReceived(received.cpu(), counts.float().cpu(), self.layers, self.min_query)
