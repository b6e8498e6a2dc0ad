"""Dimension disparity in the residual stream: massive activations, per-position norms and energy.

As Sun et al. 2024, ``x[l, p, d]`` is *massive* when ``|x| > abs_threshold`` (100) and ``|x| > rel_threshold ×
median |x|`` (1000; median over the sequence's valid positions and dims at that layer). Stream ``s < n_layers`` is
``blocks.{s}.hook_resid_pre``, ``s = n_layers`` the final resid_post."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from sinklens.analysis._common import (
    SettingsFields, check_sink_position, resolve_streams, row_index, run_analyzer, settings_from,
    sink_position_arg, stream_hook,
)
from sinklens.display import CompactRepr
from sinklens.errors import InvalidArgumentError
from sinklens.export import to_json
from sinklens.hooks import model_device, model_dims
from sinklens.inputs import Inputs, TokenBatch
from sinklens.options import RunOptions
from sinklens.streaming import BatchFold, Reducer, bound_hooks, grow, merge_statistics
from sinklens.validate import finite_number, positive_int


@dataclass(frozen=True)
class MassiveSettings:
    """Settings of one massive-activation analysis: ``abs_threshold`` / ``rel_threshold`` (None: no such criterion;
    one is needed), the ``sink_position`` compared with all others, ``top_k`` squared entries in the ``topk_energy``
    share, at most ``max_rows`` massive locations in ``events``."""

    abs_threshold: float | None = 100.0
    rel_threshold: float | None = 1000.0
    sink_position: int = 0
    top_k: int = 1
    max_rows: int = 1000

    def __post_init__(self) -> None:
        if self.abs_threshold is None and self.rel_threshold is None:
            raise InvalidArgumentError("At least one of abs_threshold and rel_threshold must be given (both are None).")
        for name in ("abs_threshold", "rel_threshold"):
            if getattr(self, name) is not None:
                finite_number(getattr(self, name), what=name, low=0.0, low_open=True)
        object.__setattr__(self, "sink_position", sink_position_arg(self.sink_position))
        object.__setattr__(self, "top_k", positive_int(self.top_k, what="top_k"))
        object.__setattr__(self, "max_rows", positive_int(self.max_rows, what="max_rows", minimum=0))


def sequence_median_abs(x: Float[Tensor, "batch pos d"], lengths: Sequence[int]) -> Float[Tensor, " batch"]:
    """Median of ``|x|`` over each sequence's first ``lengths[b]`` positions and all dims (the lower middle value
    for an even count; NaN for an empty sequence)."""
    a = x.abs()
    if any(n != a.shape[1] for n in lengths):  # padding -> NaN, which nanmedian leaves out
        pad = torch.arange(a.shape[1], device=a.device) >= torch.tensor(lengths, device=a.device)[:, None]
        a = a.masked_fill(pad[..., None], float("nan"))
    return a.flatten(1).nanmedian(dim=1).values


def norm_ratio_to_others(norms: Float[Tensor, "batch pos"], valid: Tensor) -> Float[Tensor, "batch pos"]:
    """``norms[b, p] / median_{q != p, q valid} norms[b, q]`` (lower median), NaN at invalid ``p``
    or with no other position. With the ``L`` valid norms sorted as ``s``, removing ``p`` of rank
    ``r`` leaves the median ``s[m]``, ``m = (L - 2) // 2``, if ``m < r``, else ``s[m + 1]``."""
    n = norms.shape[1]
    sorted_vals, order = norms.masked_fill(~valid, float("inf")).sort(dim=1)
    rank = order.argsort(dim=1)  # the inverse permutation
    count = valid.sum(dim=1, keepdim=True)
    m = ((count - 2) // 2).clamp_min(0)
    idx = torch.where(m < rank, m, m + 1).clamp_max(n - 1)
    ratio = norms / sorted_vals.gather(1, idx)
    return ratio.masked_fill(~valid | (count < 2), float("nan"))


@dataclass(repr=False, eq=False)
class MassiveActivations(SettingsFields, CompactRepr):
    """Massive activations and dimension disparity per residual-stream index (module docstring); ``settings``'
    fields also read as attributes. "Other": every valid position but ``sink_position``.

    Attributes:
        median_abs: mean over sequences of the per-sequence median ``|x|``.
        max_abs_sink / value_sink / max_abs_other: max over sequences of ``|x[sink, d]|``, its signed value, and the
            max over the other positions; ``max_abs_by_pos``: max over sequences and dims.
        norm_mean / norm_ratio: mean over sequences of ``||x[p]||`` / of its ratio to the median norm of the other
            valid positions.
        topk_energy: mean share of ``||x[p]||²`` in its ``top_k`` largest squared entries.
        count_sink / count_other: sink / other tokens at which dimension ``d`` is massive.
        events: ``(stream, position, dim)`` massive in some sequence, largest ``|event_value|`` first, at most
            ``max_rows`` of ``n_events``; ``event_ratio``: the value over its sequence's median ``|x|``.
    """

    streams: list[int]
    hooks: list[str]
    settings: MassiveSettings
    median_abs: Float[Tensor, " layer"]
    max_abs_sink: Float[Tensor, "layer dim"]
    value_sink: Float[Tensor, "layer dim"]
    max_abs_other: Float[Tensor, "layer dim"]
    max_abs_by_pos: Float[Tensor, "layer pos"]
    norm_mean: Float[Tensor, "layer pos"]
    norm_ratio: Float[Tensor, "layer pos"]
    topk_energy: Float[Tensor, "layer pos"]
    count_sink: Int[Tensor, "layer dim"]
    count_other: Int[Tensor, "layer dim"]
    n_sink_tokens: int
    n_other_tokens: int
    events: Int[Tensor, "event 3"]
    event_value: Float[Tensor, " event"]
    event_ratio: Float[Tensor, " event"]
    n_events: int
    n_sequences: int
    prepend_bos: bool = True
    n_layers: int = 0

    def _row(self, stream: int) -> int:
        return row_index(self.streams, stream, what="Residual stream index")

    def massive_dims(self, where: Literal["sink", "other"] = "sink") -> list[int]:
        """Dimensions massive at least once at the sink (or elsewhere), largest ``|x|`` first."""
        counts, size = (self.count_sink, self.max_abs_sink) if where == "sink" else (
            self.count_other, self.max_abs_other)
        dims = (counts.sum(0) > 0).nonzero().flatten()
        return [int(d) for d in dims[size.amax(0)[dims].argsort(descending=True)]]

    def first_stream(self, dim: int) -> int | None:
        """First residual-stream index at which ``dim`` is massive at the sink, or None."""
        hit = (self.count_sink[:, dim] > 0).nonzero().flatten()
        return self.streams[int(hit[0])] if hit.numel() else None

    def top_dims(self, stream: int, k: int = 5, where: Literal["sink", "other"] = "sink") -> list[tuple[int, float]]:
        """The ``k`` dimensions with the largest max ``|x|`` at one residual-stream index, with that max."""
        k = positive_int(k, what="k")
        size = (self.max_abs_sink if where == "sink" else self.max_abs_other)[self._row(stream)]
        vals, idx = size.topk(min(k, size.numel()))
        return [(int(i), float(v)) for i, v in zip(idx, vals)]

    def rows(self) -> list[dict[str, Any]]:
        """One DataFrame-ready row per massive location."""
        events = zip(self.events.tolist(), self.event_value.tolist(), self.event_ratio.tolist())
        return [{"stream": s, "hook": self.hooks[self._row(s)], "position": pos, "dim": dim,
                 "value": v, "abs": abs(v), "ratio": ratio} for (s, pos, dim), v, ratio in events]

    def to_dict(self) -> dict[str, Any]:
        return to_json({
            "streams": self.streams, "hooks": self.hooks, "settings": self.settings,
            "n_sequences": self.n_sequences, "prepend_bos": self.prepend_bos,
            "median_abs": self.median_abs, "massive_dims_sink": self.massive_dims("sink"),
            "massive_dims_other": self.massive_dims("other"),
            "top_dims_sink": {str(s): self.top_dims(s, 5, "sink") for s in self.streams},
            "top_dims_other": {str(s): self.top_dims(s, 5, "other") for s in self.streams},
            "max_abs_by_pos": self.max_abs_by_pos, "norm_mean": self.norm_mean, "norm_ratio": self.norm_ratio,
            "topk_energy": self.topk_energy, "n_sink_tokens": self.n_sink_tokens,
            "n_other_tokens": self.n_other_tokens, "n_events": self.n_events, "events": self.rows(),
        })

def _top_of_batch(
    x: Float[Tensor, "batch pos d"], a: Float[Tensor, "batch pos d"], median: Float[Tensor, " batch"],
) -> tuple[Float[Tensor, "pos d"], Float[Tensor, "pos d"], Float[Tensor, "pos d"]]:
    """Per ``(pos, d)``: the largest ``a = |x|`` (-1 at padding) over the batch, its ratio to its
    sequence's median and its signed value, ties broken as :func:`_beats` does."""
    best = a.amax(dim=0)
    tied = a == best[None]
    med = median[:, None, None]
    low = torch.where(tied, med, torch.full_like(med, float("inf"))).amin(dim=0)
    tied &= med == low[None]
    value = torch.where(tied, x, torch.full_like(x[:1], float("-inf"))).amax(dim=0)
    return best, best / low, value


def _beats(abs_a: Tensor, ratio_a: Tensor, value_a: Tensor, abs_b: Tensor, ratio_b: Tensor, value_b: Tensor) -> Tensor:
    """Where record ``a`` replaces ``b``: a larger ``|x|``, then a larger ratio, then a larger
    signed value (a total order, so the record kept does not depend on batching or merging)."""
    same_abs = abs_a == abs_b
    return (abs_a > abs_b) | (same_abs & (ratio_a > ratio_b)) | (same_abs & (ratio_a == ratio_b) & (value_a > value_b))


class MassiveActivationsReducer(Reducer[MassiveActivations]):
    """Streams residual-stream hooks into :class:`MassiveActivations`: per stream, ``[pos, dim]`` running maxima
    and a "was massive" map, per-dim counts and ``[pos]`` sums (grown with the longest batch)."""

    statistics = ("max_abs", "value_at_max", "ratio_at_max", "exceeded", "norm_sum", "norm_ratio_sum", "norm_ratio_count",
                  "energy_sum", "pos_count", "count_sink", "count_other", "median_sum", "n_sequences", "n_sink_tokens",
                  "n_other_tokens", "prepend_bos")
    maxima = ("exceeded",)
    argmax = ("max_abs", "ratio_at_max", "value_at_max")  # one record per location, kept by _beats

    def __init__(self, model: Any, *, streams: int | Sequence[int] | None = None,
                 settings: MassiveSettings | None = None, **settings_kwargs: Any):
        dims = model_dims(model)
        settings = settings_from(MassiveSettings, settings, settings_kwargs, "MassiveActivationsReducer")
        if settings.top_k > dims.d_model:
            raise InvalidArgumentError(f"top_k must be in [1, {dims.d_model}] (d_model), got {settings.top_k}.")
        self.settings, self.n_layers, self.d_model = settings, dims.n_layers, dims.d_model
        self.streams = resolve_streams(streams, dims.n_layers)
        self.hooks = [stream_hook(s, dims.n_layers) for s in self.streams]
        self.sink, self.device = settings.sink_position, model_device(model)
        self.reset()

    def reset(self) -> None:
        n, d, device = len(self.streams), self.d_model, self.device
        f64 = partial(torch.zeros, device=device, dtype=torch.float64)
        f32 = dict(device=device, dtype=torch.float32)
        self.max_abs = torch.full((n, 0, d), -1.0, **f32)
        self.value_at_max, self.ratio_at_max = torch.zeros(n, 0, d, **f32), torch.zeros(n, 0, d, **f32)
        self.exceeded = torch.zeros((n, 0, d), device=device, dtype=torch.bool)
        self.norm_sum, self.norm_ratio_sum, self.norm_ratio_count, self.energy_sum = (f64(n, 0) for _ in range(4))
        self.pos_count, self.median_sum = f64(0), f64(n)
        self.count_sink, self.count_other = (torch.zeros((n, d), device=device, dtype=torch.long) for _ in range(2))
        self.n_sequences = self.n_sink_tokens = self.n_other_tokens = 0
        self.prepend_bos = True

    def _grow(self, width: int) -> None:
        for name in (*self.argmax, "exceeded", "norm_sum", "norm_ratio_sum", "norm_ratio_count", "energy_sum"):
            setattr(self, name, grow(getattr(self, name), 1, width, -1.0 if name == "max_abs" else 0))
        self.pos_count = grow(self.pos_count, 0, width)

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        check_sink_position(batch, self.sink)
        valid, width, lengths, all_valid = batch.valid, batch.tokens.shape[1], batch.host_lengths(), not batch.padded
        self._grow(width)
        abs_threshold, rel_threshold, top_k = self.settings.abs_threshold, self.settings.rel_threshold, self.settings.top_k
        tiny = torch.finfo(torch.float32).tiny

        def fold(act: Tensor, i: int) -> None:  # act: [batch, pos, d_model]; i: row of the stream
            x = act.float()
            a = x.abs()
            med = sequence_median_abs(x, lengths)
            med_c = med.clamp_min(tiny)
            # Thresholds are compared without materialising the full ratio tensor a / median.
            massive = torch.ones_like(a, dtype=torch.bool) if abs_threshold is None else a > abs_threshold
            if rel_threshold is not None:
                massive &= a > (rel_threshold * med_c)[:, None, None]
            massive &= valid[..., None]
            self.median_sum[i] += med.double().sum()
            at_sink = (massive[:, self.sink] & valid[:, self.sink, None]).sum(0)
            self.count_sink[i] += at_sink
            self.count_other[i] += massive.sum(dim=(0, 1)) - at_sink
            self.exceeded[i, :width] |= massive.any(dim=0)
            new = _top_of_batch(x, a if all_valid else a.masked_fill(~valid[..., None], -1.0), med_c)
            old = [getattr(self, name)[i, :width] for name in self.argmax]  # views, updated in place
            better = _beats(*new, *old)
            for kept, t in zip(old, new):
                kept.copy_(torch.where(better, t, kept))
            sq = x * x
            energy = sq.sum(-1)
            norms = energy.sqrt()
            self.norm_sum[i, :width] += (norms * valid).double().sum(0)
            nr = norm_ratio_to_others(norms, valid)
            self.norm_ratio_sum[i, :width] += nr.double().nansum(0)  # inf stays inf
            self.norm_ratio_count[i, :width] += (~nr.isnan()).double().sum(0)
            top = sq.amax(dim=-1) if top_k == 1 else sq.topk(top_k, dim=-1).values.sum(-1)
            self.energy_sum[i, :width] += (top / energy.clamp_min(tiny) * valid).double().sum(0)

        return BatchFold(bound_hooks(self.hooks, range(len(self.hooks)), fold))

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        valid = batch.valid
        self.pos_count[: valid.shape[1]] += valid.double().sum(0)
        self.n_sequences += valid.shape[0]
        at_sink = int(valid[:, self.sink].sum())
        self.n_sink_tokens += at_sink
        self.n_other_tokens += int(valid.sum()) - at_sink
        self.prepend_bos = batch.prepend_bos

    def merge(self, other: MassiveActivationsReducer) -> None:
        """Sums add, "was massive" ORs, and per location the record that :func:`_beats` the other is kept."""
        width = max(self.max_abs.shape[1], other.max_abs.shape[1])
        self._grow(width)
        other._grow(width)
        mine = [getattr(self, name) for name in self.argmax]
        theirs = [getattr(other, name).to(self.max_abs.device) for name in self.argmax]
        better = _beats(*theirs, *mine)
        for name, a, b in zip(self.argmax, theirs, mine):
            setattr(self, name, torch.where(better, a, b))
        merge_statistics(self, other, [name for name in self.statistics if name not in self.argmax])

    def result(self) -> MassiveActivations:
        if self.n_sequences == 0:
            raise InvalidArgumentError("No batches were streamed; nothing to summarise.")
        n_pos = int((self.pos_count > 0).nonzero().max()) + 1
        s = self.sink
        others = self.max_abs.clone()
        others[:, s] = -1.0
        max_other = others.amax(dim=1).clamp_min(0.0)
        where = self.exceeded.nonzero()  # [event, 3] (row, pos, dim), in the order of the masks below
        values, ratios = self.value_at_max[self.exceeded], self.ratio_at_max[self.exceeded]
        order = values.abs().argsort(descending=True)[: self.settings.max_rows]
        events = where[order].clone()
        events[:, 0] = torch.tensor(self.streams, device=events.device)[events[:, 0]]
        counts = self.pos_count[:n_pos]
        return MassiveActivations(
            streams=list(self.streams), hooks=list(self.hooks), settings=self.settings,
            median_abs=(self.median_sum / self.n_sequences).float().cpu(),
            max_abs_sink=self.max_abs[:, s].clamp_min(0.0).cpu(),
            value_sink=self.value_at_max[:, s].cpu(),
            max_abs_other=max_other.cpu(),
            max_abs_by_pos=self.max_abs[:, :n_pos].amax(dim=-1).clamp_min(0.0).cpu(),
            norm_mean=(self.norm_sum[:, :n_pos] / counts).float().cpu(),
            norm_ratio=(self.norm_ratio_sum[:, :n_pos] / self.norm_ratio_count[:, :n_pos]).float().cpu(),
            topk_energy=(self.energy_sum[:, :n_pos] / counts).float().cpu(),
            count_sink=self.count_sink.cpu(), count_other=self.count_other.cpu(),
            n_sink_tokens=self.n_sink_tokens, n_other_tokens=self.n_other_tokens,
            events=events.cpu(), event_value=values[order].cpu(), event_ratio=ratios[order].cpu(),
            n_events=int(where.shape[0]), n_sequences=self.n_sequences, prepend_bos=self.prepend_bos,
            n_layers=self.n_layers,
        )


def find_massive_activations(model: Any, inputs: Inputs | None = None, *,
                             streams: int | Sequence[int] | None = None,
                             settings: MassiveSettings | None = None,
                             options: RunOptions = RunOptions(),
                             **settings_kwargs: Any) -> MassiveActivations:
    """Find massive activations at residual-stream indices ``streams`` (None: all); ``settings`` /
    ``**settings_kwargs``: a :class:`MassiveSettings` / fields replacing its own.

    Examples:
        >>> from sinklens.testing.planted import planted_model
        >>> model, spec = planted_model(n_layers=2, dim=5)
        >>> found = find_massive_activations(model, "t3 t4 t5 t6", options=RunOptions(progress=False))
        >>> found.massive_dims("sink"), found.first_stream(5), found.massive_dims("other")
        ([5], 1, [])
    """
    return run_analyzer(model, inputs, MassiveActivationsReducer, where="find_massive_activations", options=options,
                        kwargs=settings_kwargs, settings_cls=MassiveSettings, settings=settings, streams=streams)
