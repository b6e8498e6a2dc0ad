"""Attention mass received by each key position: the basic measurement behind every sink metric."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.hooks import PATTERN, hook_name, layer_of, model_device, model_dims, resolve_layers
from sinklens.inputs import TokenBatch
from sinklens.streaming import HookFn, Reducer


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


class AttentionReceivedReducer(Reducer):
    """Streams ``hook_pattern`` into :class:`AttentionReceived` without keeping any pattern.

    For each batch and layer it adds ``Σ_q pattern[b, h, q, k]`` over valid queries
    ``q >= max(k, min_query)`` into a ``[layer, head, key_pos]`` sum, and counts those queries per
    key, so the result is exact whatever the batch split (tested against a full cache).
    """

    def __init__(self, model: Any, *, layers=None, min_query: int = 0, max_pos: int | None = None):
        dims = model_dims(model)
        if not 0 <= int(min_query) < dims.n_ctx:
            raise ValueError(f"min_query must be in [0, {dims.n_ctx - 1}] (the model's positions), got {min_query}.")
        self.layers = resolve_layers(layers, dims.n_layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.min_query = min_query
        self.max_pos = max_pos or dims.n_ctx
        device = model_device(model)
        self.sums = torch.zeros(len(self.layers), dims.n_heads, self.max_pos, device=device, dtype=torch.float64)
        self.counts = torch.zeros(self.max_pos, device=device, dtype=torch.float64)
        self._pos = 0

    def _query_weights(self, batch: TokenBatch) -> Float[Tensor, "batch query key"]:
        """1 where query q is valid, q >= min_query and q >= k; 0 elsewhere."""
        n = batch.tokens.shape[1]
        q = torch.arange(n, device=batch.tokens.device)
        causal = (q[:, None] >= q[None, :]) & (q[:, None] >= self.min_query)
        return (batch.valid[:, :, None] & causal[None]).to(torch.float32)

    def fwd_hooks(self, batch: TokenBatch) -> list[tuple[str, HookFn]]:
        weights = self._query_weights(batch)
        self._pos = batch.tokens.shape[1]

        def fold(pattern: Tensor, hook: Any) -> None:  # pattern: [batch, head, query, key]
            per_seq = (pattern.float() * weights[:, None]).sum(dim=2)  # [batch, head, key]; faster than einsum on CPU
            row = self.row[layer_of(hook.name)]
            self.sums[row, :, : per_seq.shape[2]] += per_seq.sum(dim=0).double()
            self.fold_per_sequence(row, per_seq)

        self._weights = weights
        return [(hook_name(layer, PATTERN), fold) for layer in self.layers]

    def fold_per_sequence(self, row: int, per_seq: Float[Tensor, "batch head key"]) -> None:
        """Extension point for subclasses: ``per_seq[b, h, k]`` is ``Σ_q pattern[b, h, q, k]`` over the
        counted queries of sequence ``b`` (layer ``self.layers[row]``). The base class ignores it."""

    def end_batch(self, batch: TokenBatch) -> None:
        counted = self._weights.sum(dim=(0, 1))
        self.counts[: counted.shape[0]] += counted.double()

    def result(self) -> AttentionReceived:
        n = int((self.counts > 0).nonzero().max()) + 1 if (self.counts > 0).any() else 0
        counts = self.counts[:n]
        received = (self.sums[:, :, :n] / counts).float()
        return AttentionReceived(received.cpu(), counts.float().cpu(), self.layers, self.min_query)
