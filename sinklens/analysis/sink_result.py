"""What a sink analysis returns: its settings, :class:`SinkResult` and the per-token tables in it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from sinklens.analysis._common import TINY, SettingsFields, layer_head_position_rows
from sinklens.display import CompactRepr, StructuralEq
from sinklens.export import to_json
from sinklens.options import ATTENTION_METHODS, SINK_THRESHOLD, AttentionMethod
from sinklens.validate import choice, finite_number, index, positive_int

RateMethod = Literal["gu", "sinklens", "mean"]

#: What each sink-rate method means (written beside the numbers in JSON and summaries).
RATE_DEFINITIONS: dict[str, str] = {
    "gu": "Gu et al. (2024), as compute_attention_sink in github.com/sail-sg/Attention-Sink: per sequence, the "
          "mean attention a key gets from every query that can see it (its own query included) > sink_threshold; "
          "share of (sequence, layer, head)",
    "sinklens": "sinklens' variant of Gu et al.: the same, but queries before min_query are not counted "
                "(min_query=1 leaves out key 0's own query, whose weight is 1 by construction)",
}


def _check_threshold(value: Any) -> float:
    return finite_number(value, what="sink_threshold", low=0.0, high=1.0, low_open=True, high_open=True)


@dataclass(frozen=True)
class SinkSettings:
    """The settings of one sink analysis (:class:`SinkResult`).

    Attributes:
        sink_threshold: Gu et al.'s ``ε`` in (0, 1): head ``(l, h)`` is a sink head for key ``k`` in a sequence
            if its mean attention to ``k`` exceeds it.
        min_query: queries before it are not counted in ``received`` and sinklens' rate (1: a decoder's query 0
            gives key 0 weight 1 by construction; 0 for an encoder).
        min_query_count / min_query_share: a sink candidate (and a counted token occurrence) needs this many
            counted queries per sequence and this share of the best-seen position's.
        min_head_share / outlier_factor: the thresholds of :meth:`SinkResult.detect_sinks`.
        method: ``"pattern"`` reads ``hook_pattern``, ``"qk"`` queries and keys (same numbers, memory linear in
            the length); ``"auto"``: ``"qk"`` above :data:`~sinklens.analysis.qk_attention.QK_ABOVE` tokens.
    """

    sink_threshold: float = SINK_THRESHOLD
    min_query: int = 1
    min_query_count: int = 4
    min_head_share: float = 0.25
    outlier_factor: float = 5.0
    top_k: int = 32
    min_query_share: float = 0.1
    method: AttentionMethod = "auto"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "sink_threshold", _check_threshold(self.sink_threshold))
        for name, minimum in (("min_query", 0), ("min_query_count", 1), ("top_k", 0)):
            set_(self, name, positive_int(getattr(self, name), what=name, minimum=minimum))
        set_(self, "min_head_share", finite_number(self.min_head_share, what="min_head_share", low=0.0, high=1.0, low_open=True))
        set_(self, "outlier_factor", finite_number(self.outlier_factor, what="outlier_factor", low=1.0, low_open=True))
        set_(self, "min_query_share", finite_number(self.min_query_share, what="min_query_share", low=0.0, high=1.0))
        set_(self, "method", choice(self.method, ATTENTION_METHODS, what="method"))


@dataclass(repr=False, eq=False)
class TokenSinkStats(CompactRepr):
    """Received attention per token id seen (sorted ids, decoded ``tokens``), pooled over its ``count`` counted
    occurrences: mean and max of the layer-head-mean ``α_b[:, :, k]`` and mean share of (layer, head) with
    ``α_b > sink_threshold``."""

    token_ids: Int[Tensor, " token"]
    tokens: list[str | None]
    count: Float[Tensor, " token"]
    mean_received: Float[Tensor, " token"]
    max_received: Float[Tensor, " token"]
    mean_head_share: Float[Tensor, " token"]

    def rows(self) -> list[dict[str, Any]]:
        """One dict per token id, sorted by ``mean_received`` (highest first)."""
        return [{"token_id": int(self.token_ids[i]), "token": self.tokens[i], "count": int(self.count[i])}
                | {n: float(getattr(self, n)[i]) for n in ("mean_received", "max_received", "mean_head_share")}
                for i in torch.argsort(self.mean_received, descending=True).tolist()]


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
    """Where attention sinks are, how strong, and which tokens they sit on (``settings``' fields read as attributes).

    ``α_b[l, h, k]`` is the mean attention key ``k`` gets in sequence ``b`` from the real queries ``q >= min_query``
    that see it (:mod:`sinklens.visibility`); Gu et al.'s ``α^Gu_b`` from every one, its own included. The sink
    rate of ``k`` is the share of (sequence, layer, head) with ``α > sink_threshold`` (:data:`RATE_DEFINITIONS`).

    Attributes:
        received: mean attention key ``k`` receives from the counted queries, pooled over sequences (NaN where
            none); n_queries: the (sequence, query) pairs in it (``n_queries_by_layer``: per layer).
        seq_sink_frac / gu_seq_sink_frac: share of the sequences reaching ``k`` in which ``α_b`` / ``α^Gu_b``
            ``> sink_threshold``; n_sequences_at: those sequences.
        first_tokens / later_tokens: token statistics at position 0 / >= 1; top_occurrences: the highest single
            occurrences at positions >= 1, best first.
        unattended: ``[layer, head]`` mean over real queries of ``1 - Σ_k pattern[q, k]`` over visible real keys.
        virtual_sink: ``unattended`` when the model has learned sink logits (gpt-oss ``sinks``) or its rows fall
            short of 1 (by more than ``1e-5``, or twice the eps of a 16-bit dtype); None otherwise.
        position_token_ids: per key position, the token id there in every sequence (-1 where they differ).
        attention: the attention layout (:class:`~sinklens.visibility.Visibility`); attention_path: ``"pattern"``,
            ``"qk"`` or ``"pattern+qk"`` (``"auto"`` with batches on both sides).
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
    attention_path: str = "pattern"
    tokenizer: Any = field(default=None, repr=False, compare=False)

    def position_index(self, position: int) -> int:
        """Index of a measured key position (negatives count from the end)."""
        return index(position, self.received.shape[-1], what="position")

    def head_is_sink(self, sink_threshold: float | None = None, *,
                     method: RateMethod = "gu") -> Float[Tensor, "layer head key_pos"]:
        """Per (layer, head, key) sink rate: ``"gu"``/``"sinklens"``: (gu_)seq_sink_frac at the run's threshold;
        ``"mean"``: 1.0 where ``received > sink_threshold`` (any)."""
        method = choice(method, ("gu", "sinklens", "mean"), what="method")
        if method == "mean":
            threshold = self.sink_threshold if sink_threshold is None else _check_threshold(sink_threshold)
            return (torch.nan_to_num(self.received, nan=0.0) > threshold).float()
        if sink_threshold is not None and not math.isclose(_check_threshold(sink_threshold), self.sink_threshold):
            raise ValueError(f"Per-sequence sink indicators were recorded at sink_threshold={self.sink_threshold}, "
                             f"not {sink_threshold}; pass method='mean' or re-run find_sinks(..., sink_threshold=...).")
        return self.gu_seq_sink_frac if method == "gu" and self.gu_seq_sink_frac is not None else self.seq_sink_frac

    def sink_rate_by_layer(self, sink_threshold: float | None = None, position: int = 0, *,
                           method: RateMethod = "gu") -> Float[Tensor, " layer"]:
        """Share of the layer's heads that are sink heads for ``position`` (see :meth:`head_is_sink`)."""
        return self.head_is_sink(sink_threshold, method=method)[:, :, self.position_index(position)].mean(dim=1)

    def sink_rate(self, sink_threshold: float | None = None, position: int = 0, *, method: RateMethod = "gu") -> float:
        """Share of (sequence, layer, head) whose mean attention to ``position`` exceeds ``sink_threshold``
        (None: the run's). ``"gu"``: Gu et al.'s number as their code computes it (:data:`RATE_DEFINITIONS`)."""
        return float(self.sink_rate_by_layer(sink_threshold, position, method=method).mean())

    def sink_rate_by_position(self, sink_threshold: float | None = None, *,
                              method: RateMethod = "gu") -> Float[Tensor, " key_pos"]:
        """The overall sink rate of every key position."""
        return self.head_is_sink(sink_threshold, method=method).mean(dim=(0, 1))

    @property
    def candidates(self) -> list[int]:
        """Positions seen by at least ``min_query_count`` counted queries per sequence, on average, and by at least
        ``min_query_share`` times as many as the best-seen position."""
        per_seq = self.n_queries / self.n_sequences_at.clamp(min=1)
        floor = max(float(self.min_query_count), self.min_query_share * float(per_seq.max())) if per_seq.numel() else 0.0
        return [int(k) for k in torch.nonzero(per_seq >= floor).flatten()]

    def mean_received(self) -> Float[Tensor, " key_pos"]:
        """``received`` averaged over layers and heads: the position profile used for outliers."""
        return torch.nan_to_num(self.received, nan=0.0).mean(dim=(0, 1))

    def outlier_ratio(self) -> Float[Tensor, " key_pos"]:
        """:meth:`mean_received` of each position over its median over the :attr:`candidates` (NaN elsewhere)."""
        profile, cands = self.mean_received(), self.candidates
        out = torch.full_like(profile, float("nan"))
        if cands:
            out[cands] = profile[cands] / profile[cands].median().clamp(min=TINY)
        return out

    def detect_sinks(self, *, min_head_share: float | None = None, outlier_factor: float | None = None,
                     method: RateMethod = "sinklens") -> list[int]:
        """:attr:`candidates` whose :meth:`sink_rate_by_position` >= ``min_head_share`` or :meth:`outlier_ratio` >=
        ``outlier_factor`` (None: the run's); uniform attention over ``T`` keys gives position 0 a ratio of ~2."""
        given = {"min_head_share": min_head_share, "outlier_factor": outlier_factor}
        s = replace(self.settings, **{k: v for k, v in given.items() if v is not None})  # checked as settings are
        rates, ratio = self.sink_rate_by_position(method=method), torch.nan_to_num(self.outlier_ratio(), nan=0.0)
        return [k for k in self.candidates if float(rates[k]) >= s.min_head_share or float(ratio[k]) >= s.outlier_factor]

    sink_positions = property(detect_sinks, doc=":meth:`detect_sinks` with the analysis' thresholds.")

    def top_sinks(self, k: int = 10) -> list[dict[str, Any]]:
        """The ``k`` token ids at positions >= 1 (:attr:`later_tokens`) with the highest mean received attention."""
        return self.later_tokens.rows()[:positive_int(k, what="k")]

    def _reported_positions(self) -> list[int]:
        return sorted({0, *self.sink_positions})

    def token_at(self, position: int) -> str | None:
        """The token at ``position`` if the same in every sequence (``"id N"`` without a tokenizer), else None."""
        ids, k = self.position_token_ids, self.position_index(position)
        if ids is None or k >= ids.shape[0] or int(ids[k]) < 0:
            return None
        return self.tokenizer.decode([int(ids[k])]) if self.tokenizer is not None else f"id {int(ids[k])}"

    def describe_start(self) -> str:
        """What position 0 is, for summaries: the special tokens the tokenizer added, or the first token."""
        first = self.token_at(0) if self.received.shape[-1] else None
        if self.special_tokens:
            return f"position 0 is {first!r} (special tokens added: {' … '.join(self.special_tokens)})"
        if first is not None:
            return f"position 0 is {first!r} in every sequence (no special token added)"
        return "position 0 is the first token of each text (no special token added)"

    def summary_rows(self) -> list[dict[str, Any]]:
        """One row per layer and reported position (0, the sinks): token, both sink rates, mean/max ``received``."""
        rates, own = self.head_is_sink(method="gu"), self.head_is_sink(method="sinklens")
        received = torch.nan_to_num(self.received, nan=0.0)
        return [
            {"layer": layer, "position": pos, "token": self.token_at(pos),
             "sink_rate": float(rates[i, :, pos].mean()), "sinklens_sink_rate": float(own[i, :, pos].mean()),
             "mean_received": float(received[i, :, pos].mean()), "max_received": float(received[i, :, pos].max()),
             "sink_threshold": self.sink_threshold}
            for pos in self._reported_positions() for i, layer in enumerate(self.layers)
        ]

    def rows(self) -> list[dict[str, Any]]:
        """Long format, one row per (layer, head, key position): ``received`` and ``sink_frac``."""
        return layer_head_position_rows(self.layers, *self.received.shape[1:], {
            "received": ("layer head pos", self.received), "sink_frac": ("layer head pos", self.seq_sink_frac),
            "n_queries": ("pos", self.n_queries)})

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary: settings, sink positions, rates, received attention, sink tokens."""
        def rates(method: RateMethod) -> dict[str, Any]:
            return {str(pos): {"overall": self.sink_rate(position=pos, method=method),
                               "by_layer": self.sink_rate_by_layer(position=pos, method=method).tolist()}
                    for pos in self._reported_positions()}

        gu = rates("gu")
        return to_json({
            "layers": list(self.layers), "settings": self.settings, "n_sequences": self.n_sequences,
            "prepend_bos": self.prepend_bos, "special_tokens": list(self.special_tokens),
            "position_0": self.describe_start(),
            "position_tokens": {str(pos): self.token_at(pos) for pos in self._reported_positions()},
            "attention": self.attention, "attention_path": self.attention_path, "sink_positions": self.sink_positions,
            "sink_rate": gu, "gu_sink_rate": gu, "sinklens_sink_rate": rates("sinklens"),
            "sink_rate_definitions": {"sink_rate": RATE_DEFINITIONS["gu"], "gu_sink_rate": RATE_DEFINITIONS["gu"],
                                      "sinklens_sink_rate": RATE_DEFINITIONS["sinklens"]},
            "virtual_sink": self.virtual_sink,
            "virtual_sink_definition": "per head, mean over real queries of 1 - sum_k pattern[q, k] (attention mass "
                                       "given to no key: a learned sink logit); null when rows sum to 1",
            "received": self.received, "n_queries": self.n_queries, "first_tokens": self.first_tokens.rows(),
            "top_sinks": self.top_sinks(20), "top_occurrences": self.top_occurrences,
        }, digits=None)
