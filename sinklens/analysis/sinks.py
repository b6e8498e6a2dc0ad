"""Attention sinks: which key positions (and which tokens) soak up attention, per layer × head.

Everything here is computed from ``blocks.{l}.attn.hook_pattern`` in one streaming pass
(:class:`SinkReducer`, built on :class:`~sinklens.analysis.attention.AttentionReceivedReducer`):

* **received attention** ``received[l, h, k]``: mean of ``pattern[l, h, q, k]`` over every valid
  (sequence, query) pair that can see key ``k`` (``q >= k``) with ``q >= min_query``, pooled over
  sequences. ``min_query`` defaults to 1: the query at position 0 sees only key 0 and gives it
  weight 1 by construction, which says nothing about sinks.
* **per-sequence importance** (Gu et al., "When Attention Sink Emerges in Language Models", 2024):
  ``α_b[l, h, k]`` = the same mean for one sequence ``b`` only. Gu et al. call head (l, h) a sink
  head for key ``k`` in sequence ``b`` if ``α_b[l, h, k] > ε`` (``ε = 0.3``, our ``sink_threshold``); the *sink rate* is the
  share of (layer, head) pairs that are, averaged over sequences. (Gu et al. also count the query at
  the key itself for ``k = 0``; ``min_query=0`` reproduces that exactly.)
* **sink positions**, anywhere in the sequence (see :meth:`SinkResult.detect_sinks`), and **sink
  tokens**: per token id, the layer-head-mean received attention over every occurrence, kept in
  vocabulary-sized running sums (exact and bounded), plus the top-k single occurrences.

Measured on SmolLM2-135M-Instruct (64 stdlib docstrings, 64 tokens, BOS ``<|im_start|>``):
``sink_positions == [0]``; Gu et al. sink rate at position 0 (``sink_threshold`` 0.3) is 0.65 overall, 0 in layers
0-2 and 10-11, 0.4-0.6 in layers 3-9 and 0.7-1.0 in layers 12-29; mean attention received by
position 0 is 0.3-0.75 in those layers. No later token comes close (best: " the", mean 0.06).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from sinklens.analysis._common import SettingsFields, no_unknown_kwargs, options_from_legacy, position_index, renamed
from sinklens.analysis.attention import AttentionReceivedReducer
from sinklens.export import to_json
from sinklens.hooks import PATTERN, model_dims
from sinklens.inputs import Inputs, TokenBatch
from sinklens.options import RunOptions
from sinklens.streaming import BatchFold, Reducer, merge_statistics, per_layer_hooks, run
from sinklens.validate import choice, finite_number, positive_int

RateMethod = Literal["gu", "mean"]


def _check_threshold(value: Any) -> float:
    return finite_number(value, what="sink_threshold", low=0.0, high=1.0, low_open=True, high_open=True)


@dataclass(frozen=True)
class SinkSettings:
    """The settings of one sink analysis, held by both :class:`SinkReducer` and :class:`SinkResult`.

    Attributes:
        sink_threshold: Gu et al.'s ``ε``: head ``(l, h)`` is a sink head for key ``k`` in sequence
            ``b`` if its mean attention ``α_b[l, h, k]`` exceeds it (in (0, 1); default 0.3).
        min_query: queries before this *position* are not counted (default 1: the query at 0 sees
            only key 0 and gives it weight 1 by construction). Gu et al. use 0.
        min_query_count: a position is a sink candidate (and a token occurrence is counted) only if
            it had at least this *number* of counted later queries (per sequence, on average for
            positions); the last positions of a sequence are seen by very few queries.
        min_head_share: detection threshold on the share of sink heads (see :meth:`SinkResult.detect_sinks`).
        outlier_factor: detection threshold on the outlier ratio (see :meth:`SinkResult.detect_sinks`).
        top_k: how many single occurrences at positions >= 1 to keep (0: none).
    """

    sink_threshold: float = 0.3
    min_query: int = 1
    min_query_count: int = 4
    min_head_share: float = 0.25
    outlier_factor: float = 5.0
    top_k: int = 32

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "sink_threshold", _check_threshold(self.sink_threshold))
        set_(self, "min_query", positive_int(self.min_query, what="min_query", minimum=0))
        set_(self, "min_query_count", positive_int(self.min_query_count, what="min_query_count"))
        set_(self, "min_head_share", finite_number(self.min_head_share, what="min_head_share", low=0.0, high=1.0, low_open=True))
        set_(self, "outlier_factor", finite_number(self.outlier_factor, what="outlier_factor", low=1.0, low_open=True))
        set_(self, "top_k", positive_int(self.top_k, what="top_k", minimum=0))

    @classmethod
    def from_kwargs(cls, where: str, kwargs: dict[str, Any], **given: Any) -> SinkSettings:
        """Build from keyword arguments, accepting the deprecated names ``eps`` and ``min_queries``."""
        given["sink_threshold"] = renamed(kwargs, "eps", "sink_threshold", given["sink_threshold"], cls.sink_threshold)
        given["min_query_count"] = renamed(kwargs, "min_queries", "min_query_count", given["min_query_count"], cls.min_query_count)
        no_unknown_kwargs(kwargs, where)
        return cls(**given)


@dataclass
class TokenSinkStats:
    """Received attention per token id, pooled over all its occurrences (one group of positions).

    Attributes:
        token_ids: the ids seen (only those with at least one counted occurrence), sorted by id.
        tokens: decoded strings (``None`` when the model has no tokenizer).
        count: occurrences counted (a (sequence, position) pair counts if the position had at least
            ``min_query_count`` counted later queries in that sequence).
        mean_received: mean over occurrences of the layer-head-mean ``α_b[:, :, k]``.
        max_received: the largest single occurrence of the same number.
        mean_head_share: mean over occurrences of the share of (layer, head) with ``α_b > sink_threshold``.
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
class SinkResult(SettingsFields):
    """Where attention sinks are, how strong, and which tokens they sit on.

    Attributes:
        received: ``received[l, h, k]``, mean attention key ``k`` receives from valid queries
            ``q >= max(k, min_query)``, pooled over sequences (NaN where no query counted).
        n_queries: (sequence, query) pairs averaged into ``received[:, :, k]``.
        seq_sink_frac: Gu et al.'s per-sequence indicator averaged over sequences: share of the
            sequences containing ``k`` in which ``α_b[l, h, k] > sink_threshold``.
        n_sequences_at: sequences with at least one counted query for key ``k``.
        layers: the model layer of each row.
        settings: the :class:`SinkSettings` the analysis ran with (also readable as attributes:
            ``result.sink_threshold``, ``result.min_query``, ...).
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
    settings: SinkSettings
    n_sequences: int
    prepend_bos: bool
    first_tokens: TokenSinkStats
    later_tokens: TokenSinkStats
    top_occurrences: list[SinkOccurrence] = field(default_factory=list)

    _renamed: ClassVar[dict[str, str]] = {"eps": "sink_threshold", "min_queries": "min_query_count"}

    # ---- rates -------------------------------------------------------------------------------
    def position_index(self, position: int) -> int:
        """Index of a measured key position (negatives count from the end); a named error if out of range."""
        return position_index(position, self.received.shape[-1])

    def head_is_sink(
        self, sink_threshold: float | None = None, *, method: RateMethod = "gu"
    ) -> Float[Tensor, "layer head key_pos"]:
        """Per (layer, head, key) sink indicator, as a rate in [0, 1].

        ``method="gu"``: share of sequences in which ``α_b > sink_threshold`` (Gu et al.; only at
        the threshold the analysis ran with). ``method="mean"``: 1.0 where the pooled
        ``received > sink_threshold``, else 0.0 (any threshold).
        """
        method = choice(method, ("gu", "mean"), what="method")
        if method == "mean":
            threshold = self.sink_threshold if sink_threshold is None else _check_threshold(sink_threshold)
            return (torch.nan_to_num(self.received, nan=0.0) > threshold).float()
        if sink_threshold is not None and not math.isclose(_check_threshold(sink_threshold), self.sink_threshold):
            raise ValueError(
                f"Per-sequence (Gu et al.) sink indicators were recorded at sink_threshold={self.sink_threshold}, "
                f"not {sink_threshold}; pass method='mean' (threshold the pooled mean) or re-run "
                f"find_sinks(..., sink_threshold={sink_threshold})."
            )
        return self.seq_sink_frac

    def sink_rate_by_layer(
        self, sink_threshold: float | None = None, position: int = 0, *, method: RateMethod = "gu"
    ) -> Float[Tensor, " layer"]:
        """Share of the layer's heads that are sink heads for ``position`` (see :meth:`head_is_sink`)."""
        return self.head_is_sink(sink_threshold, method=method)[:, :, self.position_index(position)].mean(dim=1)

    def sink_rate(self, sink_threshold: float | None = None, position: int = 0, *, method: RateMethod = "gu") -> float:
        """Gu et al.'s thresholded sink rate for ``position``: share of all (layer, head) pairs with
        mean attention to it above ``sink_threshold`` (None: the run's, default 0.3)."""
        return float(self.sink_rate_by_layer(sink_threshold, position, method=method).mean())

    def sink_rate_by_position(
        self, sink_threshold: float | None = None, *, method: RateMethod = "gu"
    ) -> Float[Tensor, " key_pos"]:
        """The overall sink rate of every key position."""
        return self.head_is_sink(sink_threshold, method=method).mean(dim=(0, 1))

    # ---- detection ---------------------------------------------------------------------------
    @property
    def candidates(self) -> list[int]:
        """Positions seen by at least ``min_query_count`` counted queries per sequence, on average."""
        per_seq = self.n_queries / self.n_sequences_at.clamp(min=1)
        return [int(k) for k in torch.nonzero(per_seq >= self.min_query_count).flatten()]

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

        * its sink rate (share of (layer, head) pairs whose attention to it exceeds ``sink_threshold``,
          :meth:`sink_rate_by_position`) is at least ``min_head_share``, or
        * its layer-head-mean received attention is at least ``outlier_factor`` times the median of
          that number over all candidate positions (:meth:`outlier_ratio`).

        Defaults are the values the analysis ran with (0.25 and 5.0 unless changed). Under uniform
        attention over ``T`` keys position 0 gets ≈ ``ln(T)/T`` against ≈ ``1.4/T`` for a middle
        position, a ratio of about 2, so the outlier rule does not fire without a real sink.
        """
        share = self.min_head_share if min_head_share is None else finite_number(
            min_head_share, what="min_head_share", low=0.0, high=1.0, low_open=True)
        factor = self.outlier_factor if outlier_factor is None else finite_number(
            outlier_factor, what="outlier_factor", low=1.0, low_open=True)
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
        k = positive_int(k, what="k")
        rows = [r for r in self.later_tokens.rows() if r["count"] >= min_count]
        return rows[:k]

    # ---- export ------------------------------------------------------------------------------
    def _reported_positions(self) -> list[int]:
        return sorted({0, *self.sink_positions})

    def summary_rows(self) -> list[dict[str, Any]]:
        """One row per (layer, reported position) for position 0 and every detected sink:
        ``layer``, ``position``, ``sink_rate`` (Gu et al., at ``sink_threshold``), ``mean_received`` and
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
                        "sink_threshold": self.sink_threshold,
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
        return to_json({
            "layers": list(self.layers),
            "settings": self.settings,
            "n_sequences": self.n_sequences,
            "prepend_bos": self.prepend_bos,
            "sink_positions": self.sink_positions,
            "sink_rate": rates,
            "received": self.received,
            "n_queries": self.n_queries,
            "first_tokens": self.first_tokens.rows(),
            "top_sinks": self.top_sinks(20),
            "top_occurrences": self.top_occurrences,
        }, digits=None)

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


@dataclass
class _SinkBatch:
    """Per-batch state of :class:`SinkReducer` (lives in the batch's :class:`~sinklens.streaming.BatchFold`)."""

    weights: Float[Tensor, "batch query key"]  # counted queries, see AttentionReceivedReducer.query_weights
    q_count: Float[Tensor, "batch key"]  # counted queries per sequence and key
    recv: Float[Tensor, "batch key"]  # layer-head-mean α_b, summed over the layers folded so far
    share: Float[Tensor, "batch key"]  # share of (layer, head) with α_b > sink_threshold, likewise


class SinkReducer(Reducer[SinkResult]):
    """Streams ``hook_pattern`` into a :class:`SinkResult`.

    It holds an :class:`~sinklens.analysis.attention.AttentionReceivedReducer` for the pooled
    received-attention sums and keeps, beside it, in float64 on the model's device: per (layer,
    head, key) the number of sequences with ``α_b > sink_threshold``; per token id
    (vocabulary-sized, separately for position 0 and positions >= 1) the count, sum and maximum of
    the layer-head-mean ``α_b`` and the sum of the sink-head share; and the ``top_k`` largest single
    occurrences at positions >= 1, merged after every batch.

    Settings are given either as ``settings=SinkSettings(...)`` or as its fields, keyword arguments (the
    deprecated ``eps=`` and ``min_queries=`` are accepted for ``sink_threshold=`` and ``min_query_count=``).
    """

    statistics = ("attention", "seq_hits", "seq_counts", "tok_first", "tok_later", "top_vals", "top_share", "top_meta",
                  "prepend_bos", "n_seq")

    def __init__(
        self,
        model: Any,
        *,
        layers: int | Sequence[int] | None = None,
        settings: SinkSettings | None = None,
        max_pos: int | None = None,
        **settings_kwargs: Any,
    ):
        if settings is None:
            given = {f: settings_kwargs.pop(f) for f in SinkSettings.__dataclass_fields__ if f in settings_kwargs}
            defaults = {f: getattr(SinkSettings, f) for f in SinkSettings.__dataclass_fields__}
            settings = SinkSettings.from_kwargs("SinkReducer", settings_kwargs, **(defaults | given))
        else:
            no_unknown_kwargs(settings_kwargs, "SinkReducer")
        self.settings = settings
        self.attention = AttentionReceivedReducer(model, layers=layers, min_query=settings.min_query, max_pos=max_pos)
        self.layers = self.attention.layers
        self.n_heads = model_dims(model).n_heads
        self.d_vocab = model_dims(model).d_vocab
        self.tokenizer = getattr(model, "tokenizer", None)
        self.reset()

    def reset(self) -> None:
        self.attention.reset()
        f64 = dict(device=self.attention.device, dtype=torch.float64)
        max_pos = self.attention.max_pos
        self.seq_hits = torch.zeros(len(self.layers), self.n_heads, max_pos, **f64)
        self.seq_counts = torch.zeros(max_pos, **f64)
        # Per token id: [count, sum received, sum head share, max received], for position 0 / >= 1.
        self.tok_first = torch.zeros(4, self.d_vocab, **f64)
        self.tok_later = torch.zeros(4, self.d_vocab, **f64)
        self.top_vals = torch.zeros(0, **f64)
        self.top_share = torch.zeros(0, **f64)
        self.top_meta = torch.zeros(0, 3, device=self.attention.device, dtype=torch.long)  # sequence, position, token
        self.prepend_bos = True
        self.n_seq = 0

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        weights = self.attention.query_weights(batch)
        b, n = batch.tokens.shape
        f64 = dict(device=self.attention.device, dtype=torch.float64)
        state = _SinkBatch(weights, weights.sum(dim=1), torch.zeros(b, n, **f64), torch.zeros(b, n, **f64))
        n_layers = len(self.layers)

        def fold(pattern: Tensor, layer: int) -> None:  # pattern: [batch, head, query, key]
            per_seq = self.attention.fold_pattern(pattern, layer, weights)  # Σ_q over counted queries
            counts = state.q_count[:, None, :]
            alpha = (per_seq / counts.clamp(min=1)).double()  # α_b[h, k]
            hit = (alpha > self.settings.sink_threshold) & (counts > 0)
            self.seq_hits[self.attention.row[layer], :, : alpha.shape[2]] += hit.sum(dim=0).double()
            state.recv += alpha.mean(dim=1) / n_layers
            state.share += hit.double().mean(dim=1) / n_layers

        return BatchFold(per_layer_hooks(PATTERN, self.layers, fold), state=state)

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        state: _SinkBatch = fold.state
        self.attention.count_queries(state.weights)
        self.prepend_bos = batch.prepend_bos
        q_count = state.q_count
        n = q_count.shape[1]
        self.seq_counts[:n] += (q_count > 0).sum(dim=0).double()
        counted = (q_count >= self.settings.min_query_count) & batch.valid
        tokens = batch.tokens.to(counted.device)
        position = torch.arange(n, device=counted.device)
        for table, where in ((self.tok_first, counted & (position == 0)), (self.tok_later, counted & (position > 0))):
            ids = tokens[where]
            recv = state.recv[where]
            table[0].index_add_(0, ids, torch.ones_like(recv))
            table[1].index_add_(0, ids, recv)
            table[2].index_add_(0, ids, state.share[where])
            table[3].scatter_reduce_(0, ids, recv, reduce="amax")
        if self.settings.top_k:
            where = counted & (position > 0)
            seq_idx, pos_idx = torch.nonzero(where, as_tuple=True)
            meta = torch.stack([seq_idx + self.n_seq, pos_idx, tokens[seq_idx, pos_idx]], dim=1)
            vals = torch.cat([self.top_vals, state.recv[where]])
            shares = torch.cat([self.top_share, state.share[where]])
            meta = torch.cat([self.top_meta, meta])
            keep = torch.topk(vals, min(self.settings.top_k, vals.numel())).indices
            self.top_vals, self.top_share, self.top_meta = vals[keep], shares[keep], meta[keep]
        self.n_seq += batch.tokens.shape[0]

    def merge(self, other: SinkReducer) -> None:
        """Sums and counts add; the per-token maxima (row 3 of the token tables) take the larger; the
        ``top_k`` occurrences are re-selected from both, ``other``'s sequence indices shifted past this
        reducer's sequences (``other`` saw the sequences after them)."""
        dev = self.top_vals.device
        maxima = [torch.maximum(mine[3], theirs[3].to(mine.device))
                  for mine, theirs in ((self.tok_first, other.tok_first), (self.tok_later, other.tok_later))]
        meta = other.top_meta.to(dev).clone()
        meta[:, 0] += self.n_seq
        vals = torch.cat([self.top_vals, other.top_vals.to(dev)])
        shares = torch.cat([self.top_share, other.top_share.to(dev)])
        meta = torch.cat([self.top_meta, meta])
        keep = torch.topk(vals, min(self.settings.top_k, vals.numel())).indices
        merge_statistics(self, other, [name for name in self.statistics if not name.startswith("top_")])
        self.tok_first[3], self.tok_later[3] = maxima
        self.top_vals, self.top_share, self.top_meta = vals[keep], shares[keep], meta[keep]

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
        base = self.attention.result()
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
            settings=self.settings,
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
    sink_threshold: float = SinkSettings.sink_threshold,
    min_query: int = SinkSettings.min_query,
    min_query_count: int = SinkSettings.min_query_count,
    min_head_share: float = SinkSettings.min_head_share,
    outlier_factor: float = SinkSettings.outlier_factor,
    top_k: int = SinkSettings.top_k,
    options: RunOptions = RunOptions(),
    **deprecated: Any,
) -> SinkResult:
    """Find attention sinks: received attention per layer × head × key, sink rates, sink tokens.

    Args:
        inputs: prompts, token ids or :class:`~sinklens.inputs.TokenBatch` es (default: the built-in
            prompt set), see :func:`~sinklens.inputs.as_batches`.
        layers: which layers (default all; negatives count from the end).
        sink_threshold, min_query, min_query_count, min_head_share, outlier_factor, top_k: the
            analysis settings, see :class:`SinkSettings` (``eps=`` and ``min_queries=`` are
            deprecated names of ``sink_threshold=`` and ``min_query_count=``).
        options: batching, BOS, truncation, extra hooks (e.g. an intervention) and progress bar.

    Examples:
        >>> from sinklens.testing import tiny_model
        >>> result = find_sinks(tiny_model(), "t5 t6 t7 t8 t9", options=RunOptions(progress=False))
        >>> result.received.shape  # layer, head, key position (BOS + 5 words)
        torch.Size([2, 4, 6])
        >>> 0.0 <= result.sink_rate(position=0) <= 1.0
        True
    """
    options = options_from_legacy(options, deprecated, "find_sinks", last=False)
    settings = SinkSettings.from_kwargs(
        "find_sinks", deprecated, sink_threshold=sink_threshold, min_query=min_query,
        min_query_count=min_query_count, min_head_share=min_head_share, outlier_factor=outlier_factor, top_k=top_k,
    )
    (result,) = run(model, inputs, SinkReducer(model, layers=layers, settings=settings), options=options)
    return result
