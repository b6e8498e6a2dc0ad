"""Attention sinks: which key positions (and which tokens) soak up attention, per layer × head.

Everything here is computed from ``blocks.{l}.attn.hook_pattern`` in one streaming pass
(:class:`SinkReducer`, built on :class:`~sinklens.analysis.attention.AttentionReceivedReducer`):

"Can see" is the model's own attention layout in each layer (:mod:`sinklens.visibility`): ``q >= k`` in a
causal layer, ``k <= q < k + w`` in a sliding-window layer of ``w`` tokens, every query in an encoder;
padded queries and keys never count.

* **received attention** ``received[l, h, k]``: mean of ``pattern[l, h, q, k]`` over every real
  (sequence, query) pair that can see key ``k`` with ``q >= min_query``, pooled over
  sequences. ``min_query`` defaults to 1: the query at position 0 of a decoder sees only key 0 and gives it
  weight 1 by construction, which says nothing about sinks.
* **Gu et al.'s sink rate** ("When Attention Sink Emerges in Language Models", ICLR 2025; computed as
  ``compute_attention_sink`` in their code, github.com/sail-sg/Attention-Sink ``eval_sink_open_source.py``):
  the importance score ``α^Gu_b[l, h, k] = (1 / |Q_k|) Σ_{q ∈ Q_k} pattern_b[l, h, q, k]`` over *every* query
  ``Q_k`` that can see ``k`` in sequence ``b``, the key's own query included (their code divides the column
  sum by ``T - k``); head ``(l, h)`` is a sink head for ``k`` in ``b`` if ``α^Gu_b > ε`` (``ε = 0.3``, our
  ``sink_threshold``); the sink rate of ``k`` is the share of (sequence, layer, head) triples that are
  (``method="gu"``, the default of :meth:`SinkResult.sink_rate`).
* **sinklens' variant** (``method="sinklens"``): the same rule on ``α_b``, the mean over the queries that
  can see ``k`` *from* ``min_query`` on. With the default ``min_query=1`` this leaves out, at key 0 of a
  decoder, the key's own query (weight 1 by construction), so it is a little lower than Gu's; elsewhere
  the two agree. Sink positions are detected with it.
* **virtual sink** (learned sink logits, gpt-oss "sinks"): per head, the mean over real queries of
  ``1 - Σ_k pattern[l, h, q, k]`` (``k`` over the real keys ``q`` can see), the attention mass that goes to
  no key. ``None`` for models whose rows sum to 1 (within ``1e-5``) and that have no ``sinks`` parameter.
* **sink positions**, anywhere in the sequence (see :meth:`SinkResult.detect_sinks`), and **sink
  tokens**: per token id, the layer-head-mean received attention over every occurrence, kept in
  vocabulary-sized running sums (exact and bounded), plus the top-k single occurrences.

Measured on SmolLM2-135M-Instruct (64 stdlib docstrings, 64 tokens, BOS): ``sink_positions == [0]``, Gu et
al.'s sink rate 0.644 at position 0 (sinklens' variant 0.631), 0 in layers 0-2 and 10-11.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from sinklens.analysis._common import SettingsFields, layer_head_position_rows, position_index, run_analyzer, settings_from
from sinklens.analysis.attention import AttentionReceivedReducer
from sinklens.display import CompactRepr, StructuralEq
from sinklens.export import to_json
from sinklens.hooks import PATTERN, model_dims, model_dtype
from sinklens.inputs import Inputs, TokenBatch
from sinklens.options import SINK_THRESHOLD, RunOptions
from sinklens.streaming import BatchFold, Reducer, grow, merge_statistics, per_layer_hooks
from sinklens.validate import choice, finite_number, positive_int

#: ``"gu"``: Gu et al.'s code (key's own query included); ``"sinklens"``: queries from ``min_query`` on;
#: ``"mean"``: the pooled ``received`` thresholded (no per-sequence indicator).
RateMethod = Literal["gu", "sinklens", "mean"]

#: Where each sink-rate definition comes from (written beside the numbers in JSON and summaries).
RATE_DEFINITIONS: dict[str, str] = {
    "gu": "Gu et al. (2024), as compute_attention_sink in github.com/sail-sg/Attention-Sink: per sequence, the "
          "mean attention a key gets from every query that can see it (its own query included) > sink_threshold; "
          "share of (sequence, layer, head)",
    "sinklens": "sinklens' variant of Gu et al.: the same, but queries before min_query are not counted "
                "(min_query=1 leaves out key 0's own query, whose weight is 1 by construction)",
    "mean": "share of (layer, head) whose pooled mean received attention > sink_threshold",
}

#: Rows of a float32 softmax pattern sum to 1 within this; a larger mean shortfall means a virtual sink. A model in
#: a lower precision gets twice its dtype's eps (bfloat16: 0.016), as its pattern entries are rounded to it.
ROW_SUM_TOLERANCE = 1e-5


def has_sink_logits(model: Any) -> bool:
    """True if the model has learned per-head sink logits: a parameter named ``sinks`` (gpt-oss, in the
    Hugging Face model behind a bridge or in the model itself) or a sinklens ``sink_logit`` attention variant
    (:class:`~sinklens.sinklm.model.SinkLM` with ``cfg.variant == "sink_logit"``)."""
    if getattr(getattr(model, "cfg", None), "variant", None) == "sink_logit":
        return True
    for root in (getattr(model, "original_model", None), model):
        if root is not None and hasattr(root, "named_parameters"):
            if any(name.rsplit(".", 1)[-1] == "sinks" for name, _ in root.named_parameters()):
                return True
    return False


def _check_threshold(value: Any) -> float:
    return finite_number(value, what="sink_threshold", low=0.0, high=1.0, low_open=True, high_open=True)


@dataclass(frozen=True)
class SinkSettings:
    """The settings of one sink analysis, held by both :class:`SinkReducer` and :class:`SinkResult`.

    Attributes:
        sink_threshold: Gu et al.'s ``ε``: head ``(l, h)`` is a sink head for key ``k`` in sequence
            ``b`` if its mean attention ``α_b[l, h, k]`` exceeds it (in (0, 1); default 0.3).
        min_query: queries before this *position* are not counted in ``received`` and sinklens' sink rate
            (default 1: in a decoder the query at 0 sees only key 0 and gives it weight 1 by construction;
            in an encoder query 0 sees every key, so ``min_query=0`` is the natural choice there). Gu et
            al.'s rate (``method="gu"``) always counts every query that can see the key.
        min_query_count: a position is a sink candidate (and a token occurrence is counted) only if
            it had at least this *number* of counted later queries (per sequence, on average for
            positions); the last positions of a sequence are seen by very few queries.
        min_head_share: detection threshold on the share of sink heads (see :meth:`SinkResult.detect_sinks`).
        outlier_factor: detection threshold on the outlier ratio (see :meth:`SinkResult.detect_sinks`).
        top_k: how many single occurrences at positions >= 1 to keep (0: none).
    """

    sink_threshold: float = SINK_THRESHOLD
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



@dataclass(repr=False, eq=False)
class TokenSinkStats(CompactRepr):
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


@dataclass(eq=False)
class SinkOccurrence(StructuralEq):
    """One (sequence, position) whose layer-head-mean received attention is among the largest seen."""

    sequence: int
    position: int
    token_id: int
    token: str | None
    received: float
    head_share: float


@dataclass(repr=False, eq=False)
class SinkResult(SettingsFields, CompactRepr):
    """Where attention sinks are, how strong, and which tokens they sit on.

    Attributes:
        received: ``received[l, h, k]``, mean attention key ``k`` receives from valid queries
            ``q >= max(k, min_query)``, pooled over sequences (NaN where no query counted).
        n_queries: (sequence, query) pairs averaged into ``received[:, :, k]``.
        seq_sink_frac: sinklens' per-sequence indicator averaged over sequences: share of the
            sequences with a counted query for ``k`` in which ``α_b[l, h, k] > sink_threshold``, ``α_b`` the
            mean over the queries ``q >= min_query`` that can see ``k`` (``method="sinklens"``).
        n_sequences_at: sequences with at least one counted query for key ``k`` (largest over layers).
        layers: the model layer of each row.
        settings: the :class:`SinkSettings` the analysis ran with (also readable as attributes:
            ``result.sink_threshold``, ``result.min_query``, ...).
        n_sequences: sequences streamed.
        prepend_bos: whether special tokens were added (a decoder's BOS at position 0, an encoder's
            ``[CLS] … [SEP]``); :attr:`special_tokens` and :meth:`describe_start` say which.
        first_tokens: token statistics at position 0.
        later_tokens: token statistics at positions >= 1 (position-independent sink tokens such
            as ``"\\n"`` or ``"."`` show up here).
        top_occurrences: the highest single occurrences at positions >= 1, best first.
        gu_seq_sink_frac: Gu et al.'s indicator averaged over sequences: share of the sequences
            containing ``k`` in which ``α^Gu_b[l, h, k] > sink_threshold``, ``α^Gu_b`` the mean over every
            query that can see ``k`` (its own included), as in Gu et al.'s code (``method="gu"``).
        unattended: ``[layer, head]`` mean over real queries of ``1 - Σ_k pattern[l, h, q, k]``, the sum over the
            real keys the query can see (0 for softmax; attention leaking to padding would show here too).
        virtual_sink: ``unattended`` when the model has learned sink logits (a ``sinks`` parameter) or its
            pattern rows do not sum to 1 (mean shortfall above ``1e-5``; in bfloat16 or float16, above twice the
            dtype's eps): the mass each head gives its
            virtual sink; ``None`` otherwise.
        position_token_ids: per key position, the token id found there in every sequence, ``-1`` where
            sequences differ.
        special_tokens: the special tokens the tokenizer added around each prompt (e.g. ``("[CLS]", "[SEP]")``
            or ``("<|im_start|>",)``; empty when none was added), see :class:`~sinklens.inputs.TokenBatch`.
        attention: the attention layout the queries were chosen by (:meth:`~sinklens.visibility.Visibility.to_dict`).
        n_queries_by_layer: (sequence, query) pairs averaged into ``received[l, :, k]``, per analysed layer
            (differs from :attr:`n_queries` only in sliding-window layers).
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
    gu_seq_sink_frac: Float[Tensor, "layer head key_pos"] | None = None
    unattended: Float[Tensor, "layer head"] | None = None
    virtual_sink: Float[Tensor, "layer head"] | None = None
    position_token_ids: Int[Tensor, " key_pos"] | None = None
    special_tokens: tuple[str, ...] = ()
    attention: dict[str, Any] | None = None
    n_queries_by_layer: Float[Tensor, "layer key_pos"] | None = None
    tokenizer: Any = field(default=None, repr=False, compare=False)

    # ---- rates -------------------------------------------------------------------------------
    def position_index(self, position: int) -> int:
        """Index of a measured key position (negatives count from the end); a named error if out of range."""
        return position_index(position, self.received.shape[-1])

    def head_is_sink(
        self, sink_threshold: float | None = None, *, method: RateMethod = "gu"
    ) -> Float[Tensor, "layer head key_pos"]:
        """Per (layer, head, key) sink indicator, as a rate in [0, 1].

        ``method="gu"``: share of sequences in which Gu et al.'s ``α^Gu_b > sink_threshold`` (every query
        that can see the key, its own included; :attr:`gu_seq_sink_frac`). ``method="sinklens"``: the same
        with queries before ``min_query`` left out (:attr:`seq_sink_frac`). Both only at the threshold the
        analysis ran with. ``method="mean"``: 1.0 where the pooled ``received > sink_threshold``, else 0.0
        (any threshold).
        """
        method = choice(method, ("gu", "sinklens", "mean"), what="method")
        if method == "mean":
            threshold = self.sink_threshold if sink_threshold is None else _check_threshold(sink_threshold)
            return (torch.nan_to_num(self.received, nan=0.0) > threshold).float()
        if sink_threshold is not None and not math.isclose(_check_threshold(sink_threshold), self.sink_threshold):
            raise ValueError(
                f"Per-sequence (Gu et al.) sink indicators were recorded at sink_threshold={self.sink_threshold}, "
                f"not {sink_threshold}; pass method='mean' (threshold the pooled mean) or re-run "
                f"find_sinks(..., sink_threshold={sink_threshold})."
            )
        if method == "gu" and self.gu_seq_sink_frac is not None:
            return self.gu_seq_sink_frac
        return self.seq_sink_frac

    def sink_rate_by_layer(
        self, sink_threshold: float | None = None, position: int = 0, *, method: RateMethod = "gu"
    ) -> Float[Tensor, " layer"]:
        """Share of the layer's heads that are sink heads for ``position`` (see :meth:`head_is_sink`)."""
        return self.head_is_sink(sink_threshold, method=method)[:, :, self.position_index(position)].mean(dim=1)

    def sink_rate(self, sink_threshold: float | None = None, position: int = 0, *, method: RateMethod = "gu") -> float:
        """The thresholded sink rate of ``position``: share of (sequence, layer, head) triples whose mean
        attention to it exceeds ``sink_threshold`` (None: the run's, default 0.3).

        ``method="gu"`` (default) is Gu et al.'s number exactly as their code computes it (the mean over
        every query that can see the key, its own included); ``method="sinklens"`` leaves out queries
        before ``min_query`` (see :data:`RATE_DEFINITIONS`)."""
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
        method: RateMethod = "sinklens",
    ) -> list[int]:
        """Sink positions anywhere in the sequence.

        A candidate position ``k`` (see :attr:`candidates`) is a sink if either

        * its sink rate (share of (layer, head) pairs whose attention to it exceeds ``sink_threshold``,
          :meth:`sink_rate_by_position`, by default sinklens' variant, which does not count the
          trivial self-attention of query 0) is at least ``min_head_share``, or
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

    def token_at(self, position: int) -> str | None:
        """The token at ``position`` if it is the same in every sequence (decoded; ``"id N"`` without a
        tokenizer), else None."""
        ids = self.position_token_ids
        k = self.position_index(position)
        if ids is None or k >= ids.shape[0] or int(ids[k]) < 0:
            return None
        idx = int(ids[k])
        return self.tokenizer.decode([idx]) if self.tokenizer is not None else f"id {idx}"

    def describe_start(self) -> str:
        """What position 0 is, for summaries: the special tokens the tokenizer added, or the first token."""
        first = self.token_at(0) if self.received.shape[-1] else None
        if self.special_tokens:
            shown = " … ".join(self.special_tokens) if len(self.special_tokens) > 1 else self.special_tokens[0]
            return f"position 0 is {first!r} (special tokens added: {shown})"
        if first is not None:
            return f"position 0 is {first!r} in every sequence (no special token added)"
        return "position 0 is the first token of each text (no special token added)"

    def summary_rows(self) -> list[dict[str, Any]]:
        """One row per (layer, reported position) for position 0 and every detected sink:
        ``layer``, ``position``, ``token`` (:meth:`token_at`), ``sink_rate`` (Gu et al., at ``sink_threshold``),
        ``sinklens_sink_rate`` (sinklens' variant), ``mean_received`` and ``max_received`` (over heads)."""
        rows = []
        rates = self.head_is_sink(method="gu")
        own = self.head_is_sink(method="sinklens")
        received = torch.nan_to_num(self.received, nan=0.0)
        for pos in self._reported_positions():
            for i, layer in enumerate(self.layers):
                rows.append(
                    {
                        "layer": layer,
                        "position": pos,
                        "token": self.token_at(pos),
                        "sink_rate": float(rates[i, :, pos].mean()),
                        "sinklens_sink_rate": float(own[i, :, pos].mean()),
                        "mean_received": float(received[i, :, pos].mean()),
                        "max_received": float(received[i, :, pos].max()),
                        "sink_threshold": self.sink_threshold,
                    }
                )
        return rows

    def rows(self) -> list[dict[str, Any]]:
        """Long format, one row per (layer, head, key position): ``received`` and ``sink_frac``."""
        return layer_head_position_rows(self.layers, *self.received.shape[1:], {
            "received": ("layer head pos", self.received),
            "sink_frac": ("layer head pos", self.seq_sink_frac),
            "n_queries": ("pos", self.n_queries),
        })

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary: settings, sink positions, rates, received attention, sink tokens."""
        def rates(method: RateMethod) -> dict[str, Any]:
            return {
                str(pos): {
                    "overall": self.sink_rate(position=pos, method=method),
                    "by_layer": self.sink_rate_by_layer(position=pos, method=method).tolist(),
                }
                for pos in self._reported_positions()
            }

        gu = rates("gu")
        return to_json({
            "layers": list(self.layers),
            "settings": self.settings,
            "n_sequences": self.n_sequences,
            "prepend_bos": self.prepend_bos,
            "special_tokens": list(self.special_tokens),
            "position_0": self.describe_start(),
            "position_tokens": {str(pos): self.token_at(pos) for pos in self._reported_positions()},
            "attention": self.attention,
            "sink_positions": self.sink_positions,
            "sink_rate": gu,
            "gu_sink_rate": gu,
            "sinklens_sink_rate": rates("sinklens"),
            "sink_rate_definitions": {"sink_rate": RATE_DEFINITIONS["gu"], "gu_sink_rate": RATE_DEFINITIONS["gu"],
                                      "sinklens_sink_rate": RATE_DEFINITIONS["sinklens"]},
            "virtual_sink": self.virtual_sink,
            "virtual_sink_definition": "per head, mean over real queries of 1 - sum_k pattern[q, k] (attention mass "
                                       "given to no key: a learned sink logit); null when rows sum to 1",
            "received": self.received,
            "n_queries": self.n_queries,
            "first_tokens": self.first_tokens.rows(),
            "top_sinks": self.top_sinks(20),
            "top_occurrences": self.top_occurrences,
        }, digits=None)

def _top(values: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` largest ``values``, largest first; of equal values the earlier comes first."""
    return torch.sort(values, descending=True, stable=True).indices[:k]


def _merge_position_tokens(mine: Tensor, theirs: Tensor) -> Tensor:
    """Combine two per-position token records (-2 unseen, -1 varies, else the one token id seen there)."""
    n = max(mine.numel(), theirs.numel())
    mine, theirs = grow(mine, 0, n, fill=-2), grow(theirs, 0, n, fill=-2)
    agree = torch.where(mine == theirs, mine, torch.full_like(mine, -1))
    return torch.where(mine == -2, theirs, torch.where(theirs == -2, mine, agree))


@dataclass
class _SinkBatch:
    """Per-batch state of :class:`SinkReducer` (lives in the batch's :class:`~sinklens.streaming.BatchFold`)."""

    weights: dict[int, Tensor]  # per layer [batch, query, key]: counted queries (AttentionReceivedReducer.query_weights)
    q_count: dict[int, Tensor]  # per layer [batch, key]: counted queries per sequence and key
    gu_weights: dict[int, Tensor]  # per layer [batch, query, key]: every query that can see the key (Gu et al.)
    gu_count: dict[int, Tensor]  # per layer [batch, key]: their number
    recv: Float[Tensor, "batch key"]  # layer-head-mean α_b, summed over the layers folded so far
    share: Float[Tensor, "batch key"]  # share of (layer, head) with α_b > sink_threshold, likewise


class SinkReducer(Reducer[SinkResult]):
    """Streams ``hook_pattern`` into a :class:`SinkResult`.

    It holds an :class:`~sinklens.analysis.attention.AttentionReceivedReducer` for the pooled
    received-attention sums (and its per-layer visibility) and keeps, beside it, in float64 on the
    model's device: per (layer, head, key) the number of sequences with ``α_b > sink_threshold`` (sinklens'
    variant) and with ``α^Gu_b > sink_threshold`` (Gu et al.); per (layer, head) the summed row shortfall
    ``1 - Σ_k pattern`` over real queries (virtual sink); per token id (vocabulary-sized, separately for
    position 0 and positions >= 1) the count, sum and maximum of the layer-head-mean ``α_b`` and the sum
    of the sink-head share; per position the token id if it is the same in every sequence; and the
    ``top_k`` largest single occurrences at positions >= 1, merged after every batch.

    Gu's ``α^Gu_b`` costs no second pass over the pattern: it is ``α_b``'s column sum plus the rows of
    the queries before ``min_query`` (one row by default), divided by the number of queries that see the key.

    Settings are given either as ``settings=SinkSettings(...)`` or as its fields, keyword arguments.
    """

    statistics = ("attention", "seq_hits", "seq_counts", "gu_hits", "gu_counts", "shortfall", "n_real_queries",
                  "pos_ids", "tok_first", "tok_later", "top_vals", "top_share", "top_meta", "prepend_bos", "special_tokens",
                  "n_seq")

    def __init__(
        self,
        model: Any,
        *,
        layers: int | Sequence[int] | None = None,
        settings: SinkSettings | None = None,
        max_pos: int | None = None,
        **settings_kwargs: Any,
    ):
        self.settings = settings = settings_from(SinkSettings, settings, settings_kwargs, "SinkReducer")
        self.attention = AttentionReceivedReducer(model, layers=layers, min_query=settings.min_query, max_pos=max_pos)
        self.layers = self.attention.layers
        self.n_heads = model_dims(model).n_heads
        self.d_vocab = model_dims(model).d_vocab
        self.tokenizer = getattr(model, "tokenizer", None)
        self.sink_logits = has_sink_logits(model)
        self.row_sum_tolerance = max(ROW_SUM_TOLERANCE, 2 * torch.finfo(model_dtype(model)).eps)
        self.reset()

    def reset(self) -> None:
        self.attention.reset()
        f64 = dict(device=self.attention.device, dtype=torch.float64)
        max_pos, n_layers = self.attention.max_pos, len(self.layers)
        self.seq_hits = torch.zeros(n_layers, self.n_heads, max_pos, **f64)
        self.seq_counts = torch.zeros(n_layers, max_pos, **f64)
        self.gu_hits = torch.zeros(n_layers, self.n_heads, max_pos, **f64)
        self.gu_counts = torch.zeros(n_layers, max_pos, **f64)
        self.shortfall = torch.zeros(n_layers, self.n_heads, **f64)
        self.n_real_queries = 0.0
        self.pos_ids = torch.full((max_pos,), -2, device=self.attention.device, dtype=torch.long)  # -2 unseen, -1 varies
        # Per token id: [count, sum received, sum head share, max received], for position 0 / >= 1.
        self.tok_first = torch.zeros(4, self.d_vocab, **f64)
        self.tok_later = torch.zeros(4, self.d_vocab, **f64)
        self.top_vals = torch.zeros(0, **f64)
        self.top_share = torch.zeros(0, **f64)
        self.top_meta = torch.zeros(0, 3, device=self.attention.device, dtype=torch.long)  # sequence, position, token
        self.prepend_bos = True
        self.special_tokens: tuple[str, ...] = ()
        self.n_seq = 0

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        weights = self.attention.query_weights(batch)
        mq = self.settings.min_query
        gu_weights = self.attention.visible_weights(batch) if mq else weights
        b, n = batch.tokens.shape
        f64 = dict(device=self.attention.device, dtype=torch.float64)
        state = _SinkBatch(
            weights, {layer: w.sum(dim=1) for layer, w in weights.items()},
            gu_weights, {layer: w.sum(dim=1) for layer, w in gu_weights.items()},
            torch.zeros(b, n, **f64), torch.zeros(b, n, **f64),
        )
        n_layers = len(self.layers)
        threshold = self.settings.sink_threshold
        n_real = batch.valid.sum().double()  # real queries in the batch

        def fold(pattern: Tensor, layer: int) -> None:  # pattern: [batch, head, query, key]
            row = self.attention.row[layer]
            per_seq = self.attention.fold_pattern(pattern, layer, weights)  # Σ_q over counted queries
            counts = state.q_count[layer][:, None, :]
            alpha = (per_seq / counts.clamp(min=1)).double()  # α_b[h, k]
            hit = (alpha > threshold) & (counts > 0)
            self.seq_hits[row, :, : alpha.shape[2]] += hit.sum(dim=0).double()
            state.recv += alpha.mean(dim=1) / n_layers
            state.share += hit.double().mean(dim=1) / n_layers
            # Gu et al.: every query that can see k, its own included (add the rows before min_query back).
            gu_sum = per_seq
            if mq:
                early = gu_weights[layer][:, None, :mq]
                gu_sum = per_seq + (pattern[:, :, :mq].float() * early).sum(dim=2)
            gu_n = state.gu_count[layer][:, None, :]
            gu_alpha = (gu_sum / gu_n.clamp(min=1)).double()
            self.gu_hits[row, :, : gu_alpha.shape[2]] += ((gu_alpha > threshold) & (gu_n > 0)).sum(dim=0).double()
            # Virtual sink: the mass of the real queries' rows that goes to no key they can see
            # (Σ_k of Gu's column sums is Σ over real queries of their rows over visible keys).
            self.shortfall[row] += n_real - gu_sum.double().sum(dim=(0, 2))

        return BatchFold(per_layer_hooks(PATTERN, self.layers, fold), state=state)

    def _record_position_tokens(self, batch: TokenBatch) -> None:
        tokens, valid = batch.tokens.to(self.pos_ids.device), batch.valid.to(self.pos_ids.device)
        n = tokens.shape[1]
        present = valid.any(dim=0)
        first = tokens.gather(0, valid.float().argmax(dim=0, keepdim=True))[0]  # first real row per column
        same = ((tokens == first[None]) | ~valid).all(dim=0)
        here = torch.where(same, first, torch.full_like(first, -1))
        seen = self.pos_ids[:n]
        merged = torch.where(seen == -2, here, torch.where((seen == here) & (here >= 0), seen, torch.full_like(seen, -1)))
        self.pos_ids[:n] = torch.where(present, merged, seen)

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        state: _SinkBatch = fold.state
        self.attention.count_queries(state.weights)
        self.prepend_bos = batch.prepend_bos
        self.special_tokens = tuple(getattr(batch, "special_tokens", ()) or ())
        for layer in self.layers:
            row = self.attention.row[layer]
            n = state.q_count[layer].shape[1]
            self.seq_counts[row, :n] += (state.q_count[layer] > 0).sum(dim=0).double()
            self.gu_counts[row, :n] += (state.gu_count[layer] > 0).sum(dim=0).double()
        self.n_real_queries += float(sum(batch.host_lengths()))
        self._record_position_tokens(batch)
        q_count = torch.stack(list(state.q_count.values())).amax(dim=0)  # most counted queries over layers
        n_batch, n = q_count.shape
        counted = (q_count >= self.settings.min_query_count) & batch.valid
        tokens = batch.tokens.to(counted.device)
        position = torch.arange(n, device=counted.device)
        # Every position is folded, those not counted with weight 0 (amax: the lowest value), so no step
        # depends on how many were counted and nothing waits for the device.
        for table, where in ((self.tok_first, counted & (position == 0)), (self.tok_later, counted & (position > 0))):
            ids = torch.where(where, tokens, 0).flatten()
            table[0].index_add_(0, ids, where.flatten().to(table.dtype))
            table[1].index_add_(0, ids, torch.where(where, state.recv, 0.0).flatten())
            table[2].index_add_(0, ids, torch.where(where, state.share, 0.0).flatten())
            table[3].scatter_reduce_(0, ids, torch.where(where, state.recv, -math.inf).flatten(), reduce="amax")
        if self.settings.top_k:
            where = counted & (position > 0)
            seq_idx = torch.arange(n_batch, device=counted.device)[:, None].expand(n_batch, n) + self.n_seq
            meta = torch.stack([seq_idx, position.expand(n_batch, n), tokens], dim=-1).flatten(0, 1)
            vals = torch.cat([self.top_vals, torch.where(where, state.recv, -math.inf).flatten()])  # -inf: not counted
            shares = torch.cat([self.top_share, state.share.flatten()])
            meta = torch.cat([self.top_meta, meta])
            keep = _top(vals, self.settings.top_k)
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
        keep = _top(vals, self.settings.top_k)
        pos_ids = _merge_position_tokens(self.pos_ids, other.pos_ids.to(self.pos_ids.device))
        merge_statistics(self, other, [name for name in self.statistics
                                       if not name.startswith("top_") and name not in ("pos_ids", "special_tokens")])
        self.pos_ids = pos_ids
        self.special_tokens = other.special_tokens or self.special_tokens  # the later batches' record, like prepend_bos
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
        seq_counts = self.seq_counts[:, :n]
        frac = (self.seq_hits[:, :, :n] / seq_counts[:, None].clamp(min=1)).float().cpu()
        gu_frac = (self.gu_hits[:, :, :n] / self.gu_counts[:, None, :n].clamp(min=1)).float().cpu()
        unattended = (self.shortfall / max(self.n_real_queries, 1.0)).float().cpu()
        virtual = unattended if self.sink_logits or bool(unattended.abs().max() > self.row_sum_tolerance) else None
        real = self.top_vals > -math.inf  # the top list holds -inf for positions not counted while it fills
        occurrences = [
            SinkOccurrence(seq, pos, tok, self._decode(tok), val, share)
            for val, share, (seq, pos, tok) in zip(
                self.top_vals[real].tolist(), self.top_share[real].tolist(), self.top_meta[real].tolist()
            )
        ]
        return SinkResult(
            received=base.received,
            n_queries=base.n_queries,
            seq_sink_frac=frac,
            n_sequences_at=seq_counts.amax(dim=0).float().cpu() if n else seq_counts.sum(dim=0).float().cpu(),
            layers=base.layers,
            settings=self.settings,
            n_sequences=self.n_seq,
            prepend_bos=self.prepend_bos,
            first_tokens=self._token_stats(self.tok_first),
            later_tokens=self._token_stats(self.tok_later),
            top_occurrences=occurrences,
            gu_seq_sink_frac=gu_frac,
            unattended=unattended,
            virtual_sink=virtual,
            position_token_ids=self.pos_ids[:n].clamp(min=-1).cpu(),
            special_tokens=self.special_tokens,
            attention=self.attention.visibility.to_dict(),
            n_queries_by_layer=base.n_queries_by_layer,
            tokenizer=self.tokenizer,
        )


def find_sinks(
    model: Any,
    inputs: Inputs | None = None,
    *,
    layers: int | Sequence[int] | None = None,
    settings: SinkSettings | None = None,
    options: RunOptions = RunOptions(),
    **settings_kwargs: Any,
) -> SinkResult:
    """Find attention sinks: received attention per layer × head × key, sink rates, sink tokens.

    Args:
        inputs: anything :func:`sinklens.inputs.as_batches` accepts (None: the built-in prompts).
        layers: which layers (default all; negatives count from the end).
        settings: the analysis settings (default ``SinkSettings()``).
        **settings_kwargs: any field of :class:`SinkSettings` as a keyword (``sink_threshold=``,
            ``min_query=``, ...), replacing that of ``settings``.
        options: batching, BOS, truncation, extra hooks (e.g. an intervention) and progress bar.

    Examples:
        >>> from sinklens.testing import tiny_model
        >>> result = find_sinks(tiny_model(), "t5 t6 t7 t8 t9", options=RunOptions(progress=False))
        >>> result.received.shape  # layer, head, key position (BOS + 5 words)
        torch.Size([2, 4, 6])
        >>> 0.0 <= result.sink_rate(position=0) <= 1.0
        True
    """
    return run_analyzer(model, inputs, SinkReducer, where="find_sinks", options=options, kwargs=settings_kwargs,
                        settings_cls=SinkSettings, settings=settings, layers=layers)
