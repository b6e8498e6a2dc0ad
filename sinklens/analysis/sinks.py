"""Attention sinks: which key positions (and which tokens) soak up attention, per layer × head.

Everything here is computed from ``blocks.{l}.attn.hook_pattern`` in one streaming pass
(:class:`SinkReducer`, built on :class:`~sinklens.analysis.attention.AttentionReceivedReducer`):

* **received attention** ``received[l, h, k]``: mean of ``pattern[l, h, q, k]`` over every valid
  (sequence, query) pair that can see key ``k`` (``q >= k``) with ``q >= min_query``, pooled over
  sequences. ``min_query`` defaults to 1: the query at position 0 sees only key 0 and gives it
  weight 1 by construction, which says nothing about sinks.
* **per-sequence importance** (Gu et al., "When Attention Sink Emerges in Language Models", 2024):
  ``α_b[l, h, k]`` = the same mean for one sequence ``b`` only. Gu et al. call head (l, h) a sink
  head for key ``k`` in sequence ``b`` if ``α_b[l, h, k] > ε`` (``ε = 0.3``); the *sink rate* is the
  share of (layer, head) pairs that are, averaged over sequences. (Gu et al. also count the query at
  the key itself for ``k = 0``; ``min_query=0`` reproduces that exactly.)
* **sink positions**, anywhere in the sequence (see :meth:`SinkResult.detect_sinks`), and **sink
  tokens**: per token id, the layer-head-mean received attention over every occurrence, kept in
  vocabulary-sized running sums (exact and bounded), plus the top-k single occurrences.

Measured on SmolLM2-135M-Instruct (64 stdlib docstrings, 64 tokens, BOS ``<|im_start|>``):
``sink_positions == [0]``; Gu et al. sink rate at position 0 (ε = 0.3) is 0.65 overall, 0 in layers
0-2 and 10-11, 0.4-0.6 in layers 3-9 and 0.7-1.0 in layers 12-29; mean attention received by
position 0 is 0.3-0.75 in those layers. No later token comes close (best: " the", mean 0.06).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from sinklens.analysis._common import run_reducer
from sinklens.analysis.attention import AttentionReceivedReducer
from sinklens.hooks import model_dims
from sinklens.inputs import Inputs, TokenBatch
from sinklens.streaming import HookFn

RateMethod = Literal["gu", "mean"]


def _check_eps(eps: float, name: str = "eps") -> float:
    eps = float(eps)
    if not 0.0 < eps < 1.0:
        raise ValueError(f"{name} must be in the open interval (0, 1), got {eps}.")
    return eps


def _nan_to_none(values: list) -> list:
    """Nested lists of floats with NaN replaced by None, so ``json.dumps`` writes valid JSON."""
    return [_nan_to_none(v) if isinstance(v, list) else (None if isinstance(v, float) and math.isnan(v) else v) for v in values]


@dataclass
class TokenSinkStats:
    """Received attention per token id, pooled over all its occurrences (one group of positions).

    Attributes:
        token_ids: the ids seen (only those with at least one counted occurrence), sorted by id.
        tokens: decoded strings (``None`` when the model has no tokenizer).
        count: occurrences counted (a (sequence, position) pair counts if the position had at least
            ``min_queries`` counted later queries in that sequence).
        mean_received: mean over occurrences of the layer-head-mean ``α_b[:, :, k]``.
        max_received: the largest single occurrence of the same number.
        mean_head_share: mean over occurrences of the share of (layer, head) with ``α_b > ε``.
    """

    token_ids: Int[Tensor, " token"]
    tokens: list[str | None]
    count: Float[Tensor, " token"]
    mean_received: Float[Tensor, " token"]
    max_received: Float[Tensor, " token"]
    mean_head_share: Float[Tensor, " token"]

    def rows(self) -> list[dict[str, Any]]:
        """One dict per token id, sorted by ``mean_received`` (highest first)."""
        order = torch.argsort(self.mean_received, descending=True).tolist()
        return [
            {
                "token_id": int(self.token_ids[i]),
                "token": self.tokens[i],
                "count": int(self.count[i]),
                "mean_received": float(self.mean_received[i]),
                "max_received": float(self.max_received[i]),
                "mean_head_share": float(self.mean_head_share[i]),
            }
            for i in order
        ]


@dataclass
class SinkOccurrence:
    """One (sequence, position) whose layer-head-mean received attention is among the largest seen."""

    sequence: int
    position: int
    token_id: int
    token: str | None
    received: float
    head_share: float


@dataclass
class SinkResult:
    """Where attention sinks are, how strong, and which tokens they sit on.

    Attributes:
        received: ``received[l, h, k]``, mean attention key ``k`` receives from valid queries
            ``q >= max(k, min_query)``, pooled over sequences (NaN where no query counted).
        n_queries: (sequence, query) pairs averaged into ``received[:, :, k]``.
        seq_sink_frac: Gu et al.'s per-sequence indicator averaged over sequences: share of the
            sequences containing ``k`` in which ``α_b[l, h, k] > eps``.
        n_sequences_at: sequences with at least one counted query for key ``k``.
        layers: the model layer of each row.
        eps: the threshold ``ε`` the per-sequence indicators were recorded with.
        min_query: queries before this position were not counted.
        min_queries: a position is a sink candidate (and a token occurrence is counted) only if it
            had at least this many counted later queries (per sequence, on average for positions);
            the last positions of a sequence are seen by very few queries and are otherwise noisy.
        min_head_share: detection threshold on the share of sink heads (see :meth:`detect_sinks`).
        outlier_factor: detection threshold on the outlier ratio (see :meth:`detect_sinks`).
        n_sequences: sequences streamed.
        prepend_bos: whether position 0 was a prepended BOS token.
        first_tokens: token statistics at position 0.
        later_tokens: token statistics at positions >= 1 (position-independent sink tokens such
            as ``"\\n"`` or ``"."`` show up here).
        top_occurrences: the highest single occurrences at positions >= 1, best first.
    """

    received: Float[Tensor, "layer head key_pos"]
    n_queries: Float[Tensor, " key_pos"]
    seq_sink_frac: Float[Tensor, "layer head key_pos"]
    n_sequences_at: Float[Tensor, " key_pos"]
    layers: list[int]
    eps: float
    min_query: int
    min_queries: int
    min_head_share: float
    outlier_factor: float
    n_sequences: int
    prepend_bos: bool
    first_tokens: TokenSinkStats
    later_tokens: TokenSinkStats
    top_occurrences: list[SinkOccurrence] = field(default_factory=list)

    # ---- rates -------------------------------------------------------------------------------
    def _check_position(self, position: int) -> int:
        n = self.received.shape[-1]
        idx = position + n if position < 0 else position
        if not 0 <= idx < n:
            raise ValueError(f"position {position} is out of range: positions 0..{n - 1} were measured.")
        return idx

    def head_is_sink(self, eps: float | None = None, *, method: RateMethod = "gu") -> Float[Tensor, "layer head key_pos"]:
        """Per (layer, head, key) sink indicator, as a rate in [0, 1].

        ``method="gu"``: share of sequences in which ``α_b > eps`` (Gu et al.; only at the ``eps``
        the analysis ran with). ``method="mean"``: 1.0 where the pooled ``received > eps``, else 0.0
        (any ``eps``).
        """
        if method == "mean":
            eps = self.eps if eps is None else _check_eps(eps)
            return (torch.nan_to_num(self.received, nan=0.0) > eps).float()
        if method != "gu":
            raise ValueError(f"method must be 'gu' or 'mean', got {method!r}.")
        if eps is not None and not math.isclose(_check_eps(eps), self.eps):
            raise ValueError(
                f"Per-sequence (Gu et al.) sink indicators were recorded at eps={self.eps}, not {eps}; "
                f"pass method='mean' (threshold the pooled mean) or re-run find_sinks(..., eps={eps})."
            )
        return self.seq_sink_frac

    def sink_rate_by_layer(
        self, eps: float | None = None, position: int = 0, *, method: RateMethod = "gu"
    ) -> Float[Tensor, " layer"]:
        """Share of the layer's heads that are sink heads for ``position`` (see :meth:`head_is_sink`)."""
        return self.head_is_sink(eps, method=method)[:, :, self._check_position(position)].mean(dim=1)

    def sink_rate(self, eps: float | None = None, position: int = 0, *, method: RateMethod = "gu") -> float:
        """Gu et al.'s thresholded sink rate for ``position``: share of all (layer, head) pairs with
        mean attention to it above ``eps`` (``eps=None``: the run's ``eps``, default 0.3)."""
        return float(self.sink_rate_by_layer(eps, position, method=method).mean())

    def sink_rate_by_position(self, eps: float | None = None, *, method: RateMethod = "gu") -> Float[Tensor, " key_pos"]:
        """The overall sink rate of every key position."""
        return self.head_is_sink(eps, method=method).mean(dim=(0, 1))

    # ---- detection ---------------------------------------------------------------------------
    @property
    def candidates(self) -> list[int]:
        """Positions seen by at least ``min_queries`` counted queries per sequence, on average."""
        per_seq = self.n_queries / self.n_sequences_at.clamp(min=1)
        return [int(k) for k in torch.nonzero(per_seq >= self.min_queries).flatten()]

    def mean_received(self) -> Float[Tensor, " key_pos"]:
        """``received`` averaged over layers and heads: the position profile used for outliers."""
        return torch.nan_to_num(self.received, nan=0.0).mean(dim=(0, 1))

    def outlier_ratio(self) -> Float[Tensor, " key_pos"]:
        """Layer-head-mean received attention of each position divided by its median over the
        candidate positions (NaN for positions that are not candidates)."""
        profile = self.mean_received()
        out = torch.full_like(profile, float("nan"))
        cands = self.candidates
        if cands:
            median = profile[cands].median().clamp(min=1e-12)
            out[cands] = profile[cands] / median
        return out

    def detect_sinks(
        self,
        *,
        min_head_share: float | None = None,
        outlier_factor: float | None = None,
        method: RateMethod = "gu",
    ) -> list[int]:
        """Sink positions anywhere in the sequence.

        A candidate position ``k`` (see :attr:`candidates`) is a sink if either

        * its sink rate (share of (layer, head) pairs whose attention to it exceeds ``eps``,
          :meth:`sink_rate_by_position`) is at least ``min_head_share``, or
        * its layer-head-mean received attention is at least ``outlier_factor`` times the median of
          that number over all candidate positions (:meth:`outlier_ratio`).

        Defaults are the values the analysis ran with (0.25 and 5.0 unless changed). Under uniform
        attention over ``T`` keys position 0 gets ≈ ``ln(T)/T`` against ≈ ``1.4/T`` for a middle
        position, a ratio of about 2, so the outlier rule does not fire without a real sink.
        """
        share = self.min_head_share if min_head_share is None else float(min_head_share)
        factor = self.outlier_factor if outlier_factor is None else float(outlier_factor)
        if not 0.0 < share <= 1.0:
            raise ValueError(f"min_head_share must be in (0, 1], got {share}.")
        if factor <= 1.0:
            raise ValueError(f"outlier_factor must be > 1, got {factor}.")
        rates = self.sink_rate_by_position(method=method)
        ratio = torch.nan_to_num(self.outlier_ratio(), nan=0.0)
        return [k for k in self.candidates if float(rates[k]) >= share or float(ratio[k]) >= factor]

    @property
    def sink_positions(self) -> list[int]:
        """:meth:`detect_sinks` with the analysis' thresholds."""
        return self.detect_sinks()

    def top_sinks(self, k: int = 10, *, min_count: int = 1) -> list[dict[str, Any]]:
        """The ``k`` token ids at positions >= 1 with the highest mean received attention.

        Each row: ``token_id``, ``token``, ``count``, ``mean_received`` (mean over occurrences of the
        layer-head-mean attention the token received), ``max_received``, ``mean_head_share``.
        Tokens with fewer than ``min_count`` occurrences are left out. Position 0 is summarised in
        :attr:`first_tokens` (with a BOS it would otherwise top every list).
        """
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}.")
        rows = [r for r in self.later_tokens.rows() if r["count"] >= min_count]
        return rows[:k]

    # ---- export ------------------------------------------------------------------------------
    def _reported_positions(self) -> list[int]:
        return sorted({0, *self.sink_positions})

    def summary_rows(self) -> list[dict[str, Any]]:
        """One row per (layer, reported position) for position 0 and every detected sink:
        ``layer``, ``position``, ``sink_rate`` (Gu et al., at ``eps``), ``mean_received`` and
        ``max_received`` (over heads)."""
        rows = []
        rates = self.head_is_sink()
        received = torch.nan_to_num(self.received, nan=0.0)
        for pos in self._reported_positions():
            for i, layer in enumerate(self.layers):
                rows.append(
                    {
                        "layer": layer,
                        "position": pos,
                        "sink_rate": float(rates[i, :, pos].mean()),
                        "mean_received": float(received[i, :, pos].mean()),
                        "max_received": float(received[i, :, pos].max()),
                        "eps": self.eps,
                    }
                )
        return rows

    def rows(self) -> list[dict[str, Any]]:
        """Long format, one row per (layer, head, key position): ``received`` and ``sink_frac``."""
        received = self.received.tolist()
        frac = self.seq_sink_frac.tolist()
        n_q = self.n_queries.tolist()
        return [
            {
                "layer": layer,
                "head": h,
                "position": k,
                "received": received[i][h][k],
                "sink_frac": frac[i][h][k],
                "n_queries": n_q[k],
            }
            for i, layer in enumerate(self.layers)
            for h in range(self.received.shape[1])
            for k in range(self.received.shape[2])
        ]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary: settings, sink positions, rates, received attention, sink tokens."""
        rates = {
            str(pos): {
                "overall": self.sink_rate(position=pos),
                "by_layer": self.sink_rate_by_layer(position=pos).tolist(),
            }
            for pos in self._reported_positions()
        }
        return {
            "layers": list(self.layers),
            "eps": self.eps,
            "min_query": self.min_query,
            "min_queries": self.min_queries,
            "min_head_share": self.min_head_share,
            "outlier_factor": self.outlier_factor,
            "n_sequences": self.n_sequences,
            "prepend_bos": self.prepend_bos,
            "sink_positions": self.sink_positions,
            "sink_rate": rates,
            "received": _nan_to_none(self.received.tolist()),
            "n_queries": self.n_queries.tolist(),
            "first_tokens": self.first_tokens.rows(),
            "top_sinks": self.top_sinks(20),
            "top_occurrences": [vars(o).copy() for o in self.top_occurrences],
        }

    # ---- plots -------------------------------------------------------------------------------
    def plot(self, path: str | Path | None = None, *, position: int | None = None) -> Any:
        """Layer × head heatmap of attention to the main sink (see :func:`sinklens.plotting.sinks.plot_sink_heatmap`)."""
        from sinklens.plotting.sinks import plot_sink_heatmap

        return plot_sink_heatmap(self, position=position, path=path)

    def plot_sink_rate(self, path: str | Path | None = None, *, position: int | None = None) -> Any:
        """Per-head and per-layer sink rate (see :func:`sinklens.plotting.sinks.plot_sink_rate`)."""
        from sinklens.plotting.sinks import plot_sink_rate

        return plot_sink_rate(self, position=position, path=path)

    def plot_received(self, path: str | Path | None = None, *, layers: Sequence[int] | None = None) -> Any:
        """Received attention vs key position (see :func:`sinklens.plotting.sinks.plot_received_by_position`)."""
        from sinklens.plotting.sinks import plot_received_by_position

        return plot_received_by_position(self, layers=layers, path=path)


class SinkReducer(AttentionReceivedReducer):
    """Streams ``hook_pattern`` into a :class:`SinkResult`.

    On top of the pooled received-attention sums of :class:`AttentionReceivedReducer` it keeps, in
    float64 on the model's device: per (layer, head, key) the number of sequences with
    ``α_b > eps``; per token id (vocabulary-sized, separately for position 0 and positions >= 1)
    the count, sum and maximum of the layer-head-mean ``α_b`` and the sum of the sink-head share;
    and the ``top_k`` largest single occurrences at positions >= 1, merged after every batch.
    """

    def __init__(
        self,
        model: Any,
        *,
        layers: int | Sequence[int] | None = None,
        eps: float = 0.3,
        min_query: int = 1,
        min_queries: int = 4,
        min_head_share: float = 0.25,
        outlier_factor: float = 5.0,
        top_k: int = 32,
        max_pos: int | None = None,
    ):
        super().__init__(model, layers=layers, min_query=min_query, max_pos=max_pos)
        self.eps = _check_eps(eps)
        if min_queries < 1:
            raise ValueError(f"min_queries must be >= 1, got {min_queries}.")
        if not 0.0 < float(min_head_share) <= 1.0:
            raise ValueError(f"min_head_share must be in (0, 1], got {min_head_share}.")
        if float(outlier_factor) <= 1.0:
            raise ValueError(f"outlier_factor must be > 1, got {outlier_factor}.")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}.")
        dims = model_dims(model)
        self.min_queries = int(min_queries)
        self.min_head_share = float(min_head_share)
        self.outlier_factor = float(outlier_factor)
        self.top_k = int(top_k)
        self.tokenizer = getattr(model, "tokenizer", None)
        device = self.sums.device
        f64 = dict(device=device, dtype=torch.float64)
        self.seq_hits = torch.zeros(len(self.layers), dims.n_heads, self.max_pos, **f64)
        self.seq_counts = torch.zeros(self.max_pos, **f64)
        # Per token id: [count, sum received, sum head share, max received], for position 0 / >= 1.
        self.tok_first = torch.zeros(4, dims.d_vocab, **f64)
        self.tok_later = torch.zeros(4, dims.d_vocab, **f64)
        self.top_vals = torch.zeros(0, **f64)
        self.top_share = torch.zeros(0, **f64)
        self.top_meta = torch.zeros(0, 3, device=device, dtype=torch.long)  # sequence, position, token
        self.prepend_bos = True
        self.n_seq = 0

    def fwd_hooks(self, batch: TokenBatch) -> list[tuple[str, HookFn]]:
        hooks = super().fwd_hooks(batch)
        self._q_count = self._weights.sum(dim=1)  # [batch, key]: counted queries per sequence
        b, n = batch.tokens.shape
        self._recv = torch.zeros(b, n, device=self.sums.device, dtype=torch.float64)
        self._share = torch.zeros(b, n, device=self.sums.device, dtype=torch.float64)
        return hooks

    def fold_per_sequence(self, row: int, per_seq: Float[Tensor, "batch head key"]) -> None:
        counts = self._q_count[:, None, :]
        alpha = (per_seq / counts.clamp(min=1)).double()  # α_b[h, k]
        hit = (alpha > self.eps) & (counts > 0)
        self.seq_hits[row, :, : alpha.shape[2]] += hit.sum(dim=0).double()
        self._recv += alpha.mean(dim=1) / len(self.layers)
        self._share += hit.double().mean(dim=1) / len(self.layers)

    def end_batch(self, batch: TokenBatch) -> None:
        super().end_batch(batch)
        self.prepend_bos = batch.prepend_bos
        q_count = self._q_count
        n = q_count.shape[1]
        self.seq_counts[:n] += (q_count > 0).sum(dim=0).double()
        counted = (q_count >= self.min_queries) & batch.valid
        tokens = batch.tokens.to(counted.device)
        position = torch.arange(n, device=counted.device)
        for table, where in ((self.tok_first, counted & (position == 0)), (self.tok_later, counted & (position > 0))):
            ids = tokens[where]
            recv = self._recv[where]
            table[0].index_add_(0, ids, torch.ones_like(recv))
            table[1].index_add_(0, ids, recv)
            table[2].index_add_(0, ids, self._share[where])
            table[3].scatter_reduce_(0, ids, recv, reduce="amax")
        if self.top_k:
            where = counted & (position > 0)
            seq_idx, pos_idx = torch.nonzero(where, as_tuple=True)
            meta = torch.stack([seq_idx + self.n_seq, pos_idx, tokens[seq_idx, pos_idx]], dim=1)
            vals = torch.cat([self.top_vals, self._recv[where]])
            shares = torch.cat([self.top_share, self._share[where]])
            meta = torch.cat([self.top_meta, meta])
            keep = torch.topk(vals, min(self.top_k, vals.numel())).indices
            self.top_vals, self.top_share, self.top_meta = vals[keep], shares[keep], meta[keep]
        self.n_seq += batch.tokens.shape[0]

    def _decode(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([int(token_id)])

    def _token_stats(self, table: Tensor) -> TokenSinkStats:
        table = table.cpu()
        ids = torch.nonzero(table[0] > 0).flatten()
        count = table[0, ids]
        return TokenSinkStats(
            token_ids=ids,
            tokens=[self._decode(i) for i in ids.tolist()],
            count=count.float(),
            mean_received=(table[1, ids] / count).float(),
            max_received=table[3, ids].float(),
            mean_head_share=(table[2, ids] / count).float(),
        )

    def result(self) -> SinkResult:
        base = super().result()
        n = base.received.shape[-1]
        seq_counts = self.seq_counts[:n]
        frac = (self.seq_hits[:, :, :n] / seq_counts.clamp(min=1)).float().cpu()
        occurrences = [
            SinkOccurrence(seq, pos, tok, self._decode(tok), val, share)
            for val, share, (seq, pos, tok) in zip(
                self.top_vals.tolist(), self.top_share.tolist(), self.top_meta.tolist()
            )
        ]
        return SinkResult(
            received=base.received,
            n_queries=base.n_queries,
            seq_sink_frac=frac,
            n_sequences_at=seq_counts.float().cpu(),
            layers=base.layers,
            eps=self.eps,
            min_query=self.min_query,
            min_queries=self.min_queries,
            min_head_share=self.min_head_share,
            outlier_factor=self.outlier_factor,
            n_sequences=self.n_seq,
            prepend_bos=self.prepend_bos,
            first_tokens=self._token_stats(self.tok_first),
            later_tokens=self._token_stats(self.tok_later),
            top_occurrences=occurrences,
        )


def find_sinks(
    model: Any,
    inputs: Inputs | None = None,
    *,
    layers: int | Sequence[int] | None = None,
    eps: float = 0.3,
    min_query: int = 1,
    min_queries: int = 4,
    min_head_share: float = 0.25,
    outlier_factor: float = 5.0,
    top_k: int = 32,
    batch_size: int = 8,
    prepend_bos: bool = True,
    max_length: int | None = None,
    extra_hooks: Sequence[tuple[str, HookFn]] = (),
    progress: bool = True,
) -> SinkResult:
    """Find attention sinks: received attention per layer × head × key, sink rates, sink tokens.

    Args:
        inputs: prompts, token ids or :class:`~sinklens.inputs.TokenBatch` es (default: the built-in
            prompt set), see :func:`~sinklens.inputs.as_batches`.
        eps: Gu et al.'s threshold ``ε`` on a head's mean attention to a key (in (0, 1)).
        min_query: queries before this position are not counted (default 1: query 0 attends only to
            itself). Gu et al. use 0.
        min_queries, min_head_share, outlier_factor: sink-detection settings, see
            :meth:`SinkResult.detect_sinks`.
        top_k: how many single sink occurrences at positions >= 1 to keep.
        extra_hooks: hooks to run on every forward (e.g. an intervention).

    Examples:
        >>> from sinklens.testing import tiny_model
        >>> result = find_sinks(tiny_model(), "t5 t6 t7 t8 t9", progress=False)
        >>> result.received.shape  # layer, head, key position (BOS + 5 words)
        torch.Size([2, 4, 6])
        >>> 0.0 <= result.sink_rate(position=0) <= 1.0
        True
    """
    reducer = SinkReducer(
        model, layers=layers, eps=eps, min_query=min_query, min_queries=min_queries,
        min_head_share=min_head_share, outlier_factor=outlier_factor, top_k=top_k,
    )
    return run_reducer(model, inputs, reducer, batch_size=batch_size, prepend_bos=prepend_bos,
                       max_length=max_length, extra_hooks=extra_hooks, progress=progress, desc="sinks")
