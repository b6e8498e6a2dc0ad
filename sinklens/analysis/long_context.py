"""Sinks as a function of context length: per length ``L``, one sequence of ``L`` tokens (BOS if the model prepends
one, then standard-library sources) through the sink reducer (``method="qk"``) and a residual reducer."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from sinklens.analysis._common import other_positions, resolve_streams, stream_hook
from sinklens.analysis.disparity import MassiveSettings, sequence_median_abs
from sinklens.analysis.sink_result import SinkSettings
from sinklens.analysis.sinks import SinkReducer
from sinklens.errors import InvalidArgumentError
from sinklens.export import to_json
from sinklens.hooks import model_device, model_dims
from sinklens.inputs import TokenBatch, bos_token_id, resolved_bos
from sinklens.options import SINK_THRESHOLD, RunOptions
from sinklens.prompts import stdlib_source_tokens
from sinklens.streaming import BatchFold, Reducer, bound_hooks, run
from sinklens.validate import finite_number, positive_int


class MassiveShareReducer(Reducer[Tensor]):
    """Per residual stream and dimension, the share of real tokens at positions >= 1 whose ``|x|`` is massive by
    Sun et al.'s rule (``> abs_threshold`` and ``> rel_threshold`` times the sequence's median ``|x|``)."""

    statistics = ("hits", "n_later")

    def __init__(self, model: Any, *, abs_threshold: float | None = 100.0, rel_threshold: float | None = 1000.0):
        checked = MassiveSettings(abs_threshold=abs_threshold, rel_threshold=rel_threshold)
        dims = model_dims(model)
        self.abs_threshold, self.rel_threshold = checked.abs_threshold, checked.rel_threshold
        self.hooks = [stream_hook(s, dims.n_layers) for s in resolve_streams(None, dims.n_layers)]
        self.d_model, self.device = dims.d_model, model_device(model)
        self.reset()

    def reset(self) -> None:
        self.hits = torch.zeros(len(self.hooks), self.d_model, device=self.device, dtype=torch.float64)
        self.n_later = 0.0

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        lengths, later = batch.host_lengths(), other_positions(batch, 0)

        def fold(act: Tensor, i: int) -> None:  # act: [batch, pos, d_model]
            x = act.float()
            massive = later[..., None].expand_as(x)
            if self.abs_threshold is not None:
                massive = massive & (x.abs() > self.abs_threshold)
            if self.rel_threshold is not None:
                massive = massive & (x.abs() > (self.rel_threshold * sequence_median_abs(x, lengths))[:, None, None])
            self.hits[i] += massive.sum(dim=(0, 1)).double()

        return BatchFold(bound_hooks(self.hooks, range(len(self.hooks)), fold), state=later)

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        self.n_later += float(fold.state.sum())

    def result(self) -> Tensor:
        return (self.hits / max(self.n_later, 1.0)).float().cpu()


@dataclass
class ContextPoint:
    """The numbers at one length (``length`` tokens, BOS included).

    Attributes:
        sink_attention: attention position 0 receives, mean over layers, heads and the queries ``q >= 1``;
            sink_rate: Gu et al.'s sink rate of position 0.
        secondary_sinks: the ``top`` candidate positions > 0 by sinklens sink rate (>= ``min_head_share``);
            n_secondary: how many passed.
        residual_sinks: residual ``stream``, ``dim`` massive on a ``share`` > ``most_tokens`` of positions >= 1.
    """

    length: int
    sink_attention: float
    sink_rate: float
    secondary_sinks: list[dict[str, Any]]
    n_secondary: int
    residual_sinks: list[dict[str, Any]]
    seconds: float


@dataclass
class ContextSweepResult:
    """What :func:`context_sweep` found, one :class:`ContextPoint` per length, and the rules it used."""

    points: list[ContextPoint]
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def lengths(self) -> list[int]:
        return [p.length for p in self.points]

    def to_dict(self) -> dict[str, Any]:
        """Strict-JSON-ready data (:func:`sinklens.export.to_json`)."""
        return to_json({"settings": self.settings, "points": [asdict(p) for p in self.points]})


def context_sweep(model: Any, lengths: Sequence[int], *, sink_threshold: float = SINK_THRESHOLD,
                  min_head_share: float = 0.05, most_tokens: float = 0.5, abs_threshold: float | None = 100.0,
                  rel_threshold: float | None = 1000.0, top: int = 10, options: RunOptions = RunOptions()) -> ContextSweepResult:
    """Sink attention, sink rate, secondary and residual sinks at each of ``lengths`` (2 to ``cfg.n_ctx``).

    Examples:
        >>> from sinklens.testing import tiny_model
        >>> sweep = context_sweep(tiny_model(), [16, 64], options=RunOptions(progress=False))
        >>> sweep.lengths, 0.0 <= sweep.points[0].sink_rate <= 1.0
        ([16, 64], True)
    """
    n_ctx = model_dims(model).n_ctx
    if isinstance(lengths, (int, str)) or not len(lengths):
        raise InvalidArgumentError(f"lengths must be a non-empty list of token counts, got {lengths!r}.")
    lengths = [positive_int(n, what="length") for n in lengths]
    if bad := [n for n in lengths if not 2 <= n <= n_ctx]:
        raise InvalidArgumentError(f"length {bad[0]} is outside 2..{n_ctx}, the model's context (cfg.n_ctx).")
    for name, value in (("min_head_share", min_head_share), ("most_tokens", most_tokens)):
        finite_number(value, what=name, low=0.0, high=1.0, low_open=True)
    head = [bos_token_id(model)] if resolved_bos(model, options.prepend_bos) else []
    text = stdlib_source_tokens(model.tokenizer, max(lengths) - len(head))
    settings = SinkSettings(method="qk", sink_threshold=sink_threshold)
    points = []
    for n in lengths:
        tokens = torch.tensor([head + text[: n - len(head)]])
        reducers = SinkReducer(model, settings=settings), MassiveShareReducer(
            model, abs_threshold=abs_threshold, rel_threshold=rel_threshold)
        start = time.perf_counter()
        sinks, share = run(model, tokens, *reducers, options=options)
        seconds = time.perf_counter() - start
        rates = sinks.sink_rate_by_position(method="sinklens")
        received = sinks.mean_received()
        secondary = sorted((k for k in sinks.candidates if k and float(rates[k]) >= min_head_share),
                           key=lambda k: -float(rates[k]))
        residual = [{"stream": s, "dim": d, "share": float(share[s, d])}
                    for s, d in (share > most_tokens).nonzero().tolist()]
        points.append(ContextPoint(
            length=n, sink_attention=float(received[0]), sink_rate=sinks.sink_rate(position=0),
            secondary_sinks=[{"position": k, "token": sinks.token_at(k), "head_share": float(rates[k]),
                              "received": float(received[k])} for k in secondary[:top]],
            n_secondary=len(secondary), residual_sinks=residual, seconds=seconds))
    return ContextSweepResult(points, {
        "text": "stdlib sources", "bos": bool(head), "sink_threshold": sink_threshold,
        "min_head_share": min_head_share, "min_query_count": settings.min_query_count, "most_tokens": most_tokens,
        "abs_threshold": abs_threshold, "rel_threshold": rel_threshold})
