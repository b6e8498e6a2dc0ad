"""Super neurons: FFN neurons that fire hugely at the sink token and write the massive residual dimensions.

Definitions (all activations are ``blocks.{l}.mlp.hook_post``, i.e. what multiplies ``W_out``):

* ``sink_act[l, n]``: mean over sequences of the neuron's activation at ``sink_position``.
* ``other_rms[l, n]``: root-mean-square of its activation over every other valid (non-padding) position.
* ``position_ratio = |sink_act| / other_rms``: how far the sink activation lies outside the neuron's own
  distribution elsewhere.
* ``neuron_ratio = |sink_act| / median_n' |sink_act[l, n']|``: how far it lies above the layer's typical
  neuron at the sink.
* A neuron is a **super neuron** when both ratios reach their thresholds (default 10 each).
* ``contribution[l, n, :] = sink_act[l, n] × W_out[l, n, :]``: exactly the neuron's share of
  ``hook_mlp_out`` at the sink (``Σ_n act_n W_out[l, n] = hook_mlp_out − b_out``; see
  :func:`neuron_contributions`), restricted to the massive dimensions ``dims``.
* ``W_out`` row sparsity: Pearson kurtosis of ``W_out[l, n, :]`` over ``d_model`` (3 for a Gaussian row,
  ``≈ d_model`` for a one-hot row) and the share of its squared norm in its ``row_top_k`` largest entries.

Massive dimensions (unless given as ``dims``): dimensions ``d`` whose mean residual value at the sink,
``|resid[s, d]|``, exceeds ``dim_threshold`` × the median over dimensions of ``|resid[s, :]|`` at some residual
stream index ``s`` (the residual is averaged over sequences at the sink position). For each, a
:class:`MassiveDimPath` says which block writes it (largest step towards its peak value, ``attn_out + mlp_out``
at the sink) and which erases it (largest step back, if it undoes at least ``erase_fraction`` of the peak).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from sinklens.analysis._common import TINY as _TINY
from sinklens.analysis._common import (
    SettingsFields,
    check_sink_position,
    options_from_legacy,
    other_positions,
    resolve_streams,
    row_index,
    sink_position_arg,
    stream_hook,
)
from sinklens.errors import InvalidArgumentError
from sinklens.export import to_json
from sinklens.hooks import ATTN_OUT, MLP_OUT, MLP_POST, model_device, model_dims, resolve_layers, weight
from sinklens.inputs import Inputs, TokenBatch
from sinklens.options import RunOptions
from sinklens.streaming import BatchFold, Reducer, bound_hooks, per_layer_hooks, run
from sinklens.validate import as_int, finite_number, positive_int


def mlp_out_bias(model: Any, layer: int) -> Float[Tensor, " d_model"]:
    """``b_out[layer]``, or zeros for a bias-free MLP (TransformerBridge exposes no ``b_out`` then)."""
    try:
        b = model.b_out
    except AttributeError:
        b = None
    if b is None:
        return torch.zeros(model_dims(model).d_model, device=model_device(model))
    return b[layer].detach()


def neuron_contributions(model: Any, layer: int, post: Float[Tensor, "*batch neuron"]) -> Float[Tensor, "*batch neuron d_model"]:
    """Each neuron's write into the residual stream: ``post[..., n] × W_out[layer, n, :]``.

    Summed over neurons this is ``hook_mlp_out − b_out`` of that layer (for models whose MLP output is
    ``hook_post @ W_out + b_out``, which is every TransformerLens MLP).
    """
    W_out = weight(model, "W_out")[layer]
    return post[..., :, None] * W_out.to(post.dtype)


def row_sparsity(rows: Float[Tensor, "*rows d"], k: int = 1) -> tuple[Float[Tensor, "*rows"], Float[Tensor, "*rows"]]:
    """Channel sparsity of weight rows: (Pearson kurtosis over the last axis, share of squared norm in top ``k``).

    Examples:
        >>> kurt, share = row_sparsity(torch.tensor([[0.0, 0.0, 0.0, 4.0], [1.0, -1.0, 1.0, -1.0]]))
        >>> [round(v, 3) for v in kurt.tolist()], share.tolist()
        ([2.333, 1.0], [1.0, 0.25])
    """
    x = rows.float()
    centred = x - x.mean(-1, keepdim=True)
    c2 = centred * centred  # products, not pow: several times faster on CPU for large weights
    var = c2.mean(-1)
    kurt = (c2 * c2).mean(-1) / (var * var).clamp_min(_TINY)
    sq = x * x
    top = sq.amax(dim=-1) if k == 1 else sq.topk(k, dim=-1).values.sum(-1)
    share = top / sq.sum(-1).clamp_min(_TINY)
    return kurt, share


@dataclass(frozen=True)
class SuperNeuronSettings:
    """Settings of one super-neuron analysis, held by :class:`SuperNeuronReducer` and :class:`SuperNeurons`.

    Attributes:
        sink_position: the position whose neurons and residual path are analysed.
        dims: massive residual dimensions to attribute (None: detected at the sink, see ``dim_threshold``).
        position_threshold / neuron_threshold: super-neuron thresholds on ``position_ratio`` / ``neuron_ratio``.
        dim_threshold: a dimension is massive if ``|resid[s, d]|`` exceeds this × the median ``|resid[s, :]|``.
        max_dims: at most this many detected dimensions.
        erase_fraction: a block counts as erasing a dimension if it undoes at least this share of its peak.
        top_k: top neurons listed per dimension in :class:`MassiveDimPath`.
        row_top_k: entries counted in ``row_top_share``.
    """

    sink_position: int = 0
    dims: Sequence[int] | None = None
    position_threshold: float = 10.0
    neuron_threshold: float = 10.0
    dim_threshold: float = 100.0
    max_dims: int = 4
    erase_fraction: float = 0.5
    top_k: int = 10
    row_top_k: int = 1

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "sink_position", sink_position_arg(self.sink_position))
        if self.dims is not None:
            set_(self, "dims", tuple(as_int(d, what="dims") for d in self.dims))
        for name in ("position_threshold", "neuron_threshold", "dim_threshold"):
            set_(self, name, finite_number(getattr(self, name), what=name, low=0.0, low_open=True))
        set_(self, "max_dims", positive_int(self.max_dims, what="max_dims"))
        set_(self, "erase_fraction", finite_number(self.erase_fraction, what="erase_fraction", low=0.0, high=1.0, low_open=True))
        set_(self, "top_k", positive_int(self.top_k, what="top_k"))
        set_(self, "row_top_k", positive_int(self.row_top_k, what="row_top_k"))


@dataclass
class MassiveDimPath:
    """How one massive residual dimension at the sink is written and erased across blocks.

    Attributes:
        dim: the residual dimension.
        peak_layer / peak_value: residual-stream index (``l``: input of block ``l``; ``n_layers``: final output)
            and signed mean value at the sink where ``|value|`` peaks.
        write_layer: the block whose ``attn_out + mlp_out`` at the sink moves the dimension furthest towards its
            peak sign; ``write_attn`` / ``write_mlp``: those two outputs in that dimension; ``attn_share`` =
            ``|write_attn| / (|write_attn| + |write_mlp|)``.
        erase_layer: the later block taking it back the most (``erase_delta``, its signed step), or None when
            no block undoes at least ``erase_fraction`` of the peak.
        top_neurons: ``(layer, neuron, contribution)`` of the neurons writing most in the peak's direction.
    """

    dim: int
    peak_layer: int
    peak_value: float
    write_layer: int
    write_delta: float
    write_attn: float
    write_mlp: float
    attn_share: float
    erase_layer: int | None
    erase_delta: float | None
    top_neurons: list[tuple[int, int, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return to_json(self)


@dataclass
class SuperNeurons(SettingsFields):
    """Super neurons at the sink and the paths of the massive dimensions (see the module docstring).

    Attributes:
        layers: model layers of the neuron rows. ``dims``: the massive dimensions analysed.
        settings: the :class:`SuperNeuronSettings` of the run; its fields also read as attributes
            (``result.sink_position``, ``result.row_top_k``, ...).
        sink_act / other_rms / other_max_abs / position_ratio / neuron_ratio / is_super: per-neuron statistics.
        contribution: ``sink_act × W_out[l, n, dims]``.
        row_kurtosis / row_top_share: sparsity of each ``W_out`` row (``row_top_k`` largest entries).
        resid_sink: mean residual stream at the sink, per stream index ``0..n_layers``.
        attn_out_sink / mlp_out_sink: mean ``hook_attn_out`` / ``hook_mlp_out`` at the sink, per block.
        paths: one :class:`MassiveDimPath` per entry of ``dims``.
    """

    layers: list[int]
    settings: SuperNeuronSettings
    dims: list[int]
    sink_act: Float[Tensor, "layer neuron"]
    other_rms: Float[Tensor, "layer neuron"]
    other_max_abs: Float[Tensor, "layer neuron"]
    position_ratio: Float[Tensor, "layer neuron"]
    neuron_ratio: Float[Tensor, "layer neuron"]
    is_super: Bool[Tensor, "layer neuron"]
    contribution: Float[Tensor, "layer neuron n_dims"]
    row_kurtosis: Float[Tensor, "layer neuron"]
    row_top_share: Float[Tensor, "layer neuron"]
    resid_sink: Float[Tensor, "stream d_model"]
    attn_out_sink: Float[Tensor, "block d_model"]
    mlp_out_sink: Float[Tensor, "block d_model"]
    paths: list[MassiveDimPath]
    n_sequences: int

    def super_neurons(self) -> list[tuple[int, int]]:
        """``(layer, neuron)`` of every super neuron, largest ``|sink_act|`` first."""
        idx = self.is_super.nonzero()
        order = self.sink_act[idx[:, 0], idx[:, 1]].abs().argsort(descending=True)
        return [(self.layers[int(r)], int(n)) for r, n in idx[order].tolist()]

    def path(self, dim: int) -> MassiveDimPath:
        """The :class:`MassiveDimPath` of one analysed dimension."""
        for p in self.paths:
            if p.dim == dim:
                return p
        raise InvalidArgumentError(f"Dimension {dim} was not analysed; analysed dims: {self.dims}.")

    def top(self, dim: int, k: int = 10) -> list[tuple[int, int, float]]:
        """``(layer, neuron, contribution)`` of the ``k`` neurons writing most into ``dim`` in its peak's direction."""
        j = self.dims.index(self.path(dim).dim)
        sign = 1.0 if self.path(dim).peak_value >= 0 else -1.0
        flat = (sign * self.contribution[:, :, j]).flatten()
        vals, idx = flat.topk(min(k, flat.numel()))
        n = self.contribution.shape[1]
        return [(self.layers[int(i) // n], int(i) % n, float(sign * v)) for i, v in zip(idx, vals)]

    def neuron_row(self, layer: int, neuron: int) -> dict[str, Any]:
        """All statistics of one neuron as a dict."""
        r = row_index(self.layers, layer)
        row = {
            "layer": layer, "neuron": neuron, "sink_act": float(self.sink_act[r, neuron]),
            "other_rms": float(self.other_rms[r, neuron]), "other_max_abs": float(self.other_max_abs[r, neuron]),
            "position_ratio": float(self.position_ratio[r, neuron]), "neuron_ratio": float(self.neuron_ratio[r, neuron]),
            "is_super": bool(self.is_super[r, neuron]), "row_kurtosis": float(self.row_kurtosis[r, neuron]),
            "row_top_share": float(self.row_top_share[r, neuron]),
        }
        for j, d in enumerate(self.dims):
            row[f"contribution_{d}"] = float(self.contribution[r, neuron, j])
        return row

    def rows(self, k: int = 10) -> list[dict[str, Any]]:
        """DataFrame-ready rows: for each massive dim, its ``k`` top writing neurons (rank, contribution, stats),
        then every super neuron not already listed (``dim`` = None)."""
        out, seen = [], set()
        for d in self.dims:
            for rank, (layer, neuron, contrib) in enumerate(self.top(d, k)):
                out.append({"dim": d, "rank": rank, "contribution": contrib} | self.neuron_row(layer, neuron))
                seen.add((layer, neuron))
        for layer, neuron in self.super_neurons():
            if (layer, neuron) not in seen:
                out.append({"dim": None, "rank": None, "contribution": None} | self.neuron_row(layer, neuron))
        return out

    def to_dict(self, k: int = 10) -> dict[str, Any]:
        """JSON-ready summary: thresholds, dims and their paths, super neurons, top-neuron rows."""
        return to_json({
            "layers": self.layers, "settings": self.settings, "dims": self.dims, "n_sequences": self.n_sequences,
            "super_neurons": [list(x) for x in self.super_neurons()],
            "paths": [p.to_dict() for p in self.paths], "rows": self.rows(k),
        })

    def plot(self, dim: int | None = None, k: int = 10, path: str | Path | None = None) -> Any:
        """Bar chart of the top neurons' contributions to ``dim`` (default: the first massive dim)."""
        from sinklens.plotting.neurons import plot_contributions

        return plot_contributions(self, dim=dim, k=k, path=path)

    def plot_sparsity(self, path: str | Path | None = None) -> Any:
        """``W_out`` row kurtosis vs top-k mass share, super neurons highlighted."""
        from sinklens.plotting.neurons import plot_row_sparsity

        return plot_row_sparsity(self, path=path)

    def plot_path(self, dim: int | None = None, path: str | Path | None = None) -> Any:
        """The dimension's residual value at the sink per layer, with the attention and MLP steps."""
        from sinklens.plotting.neurons import plot_dim_path

        return plot_dim_path(self, dim=dim, path=path)


def massive_dims_from_resid(resid: Float[Tensor, "stream d_model"], threshold: float, max_dims: int) -> list[int]:
    """Dims whose ``|resid[s, d]|`` exceeds ``threshold`` × median ``|resid[s, :]|`` at some ``s``, peak first."""
    a = resid.abs()
    ratio = a / a.median(dim=-1, keepdim=True).values.clamp_min(_TINY)
    hit = (ratio > threshold).any(dim=0).nonzero().flatten()
    peak = a.amax(dim=0)[hit]
    return [int(d) for d in hit[peak.argsort(descending=True)][:max_dims]]


def dim_path(
    resid: Float[Tensor, "stream d_model"],
    attn: Float[Tensor, "block d_model"],
    mlp: Float[Tensor, "block d_model"],
    dim: int,
    *,
    erase_fraction: float = 0.5,
) -> MassiveDimPath:
    """Peak, write block and erase block of one dimension (see :class:`MassiveDimPath`; ``top_neurons``
    is left empty: it needs the neurons, see :meth:`SuperNeurons.top`)."""
    values = resid[:, dim]
    peak = int(values.abs().argmax())
    peak_value = float(values[peak])
    sign = 1.0 if peak_value >= 0 else -1.0
    delta = attn[:, dim] + mlp[:, dim]
    write = int((sign * delta).argmax())
    a, m = float(attn[write, dim]), float(mlp[write, dim])
    share = abs(a) / max(abs(a) + abs(m), _TINY)
    erase, erase_delta = None, None
    if write + 1 < delta.shape[0]:
        later = sign * delta[write + 1 :]
        j = int(later.argmin())
        if float(later[j]) < -erase_fraction * abs(peak_value):
            erase, erase_delta = write + 1 + j, float(delta[write + 1 + j])
    return MassiveDimPath(dim, peak, peak_value, write, float(delta[write]), a, m, share, erase, erase_delta)


class SuperNeuronReducer(Reducer[SuperNeurons]):
    """Streams ``mlp.hook_post`` (all positions) and the residual/attn/mlp outputs (sink only) into :class:`SuperNeurons`.

    Keeps per-neuron sums at the sink and at other positions (sum, sum of squares, max ``|act|``) and per-layer
    sums of the sink's residual stream, ``hook_attn_out`` and ``hook_mlp_out``; nothing else.
    Settings: ``settings=SuperNeuronSettings(...)`` or its fields as keyword arguments.
    """

    statistics = ("sink_sum", "other_sq", "other_max", "resid", "attn", "mlp", "n_sequences", "n_other")
    maxima = ("other_max",)

    def __init__(self, model: Any, *, layers: int | Sequence[int] | None = None,
                 settings: SuperNeuronSettings | None = None, **settings_kwargs: Any):
        d = model_dims(model)
        if settings is None:
            settings = SuperNeuronSettings(**settings_kwargs)
        elif settings_kwargs:
            raise TypeError(f"Pass settings= or its fields, not both (got {sorted(settings_kwargs)}).")
        if settings.row_top_k > d.d_model:
            raise InvalidArgumentError(f"row_top_k must be in [1, {d.d_model}] (d_model), got {settings.row_top_k}.")
        if settings.dims is not None:
            bad = [x for x in settings.dims if not 0 <= x < d.d_model]
            if bad:
                raise InvalidArgumentError(f"dims {bad} are out of range for d_model={d.d_model} (0..{d.d_model - 1}).")
        if d.d_mlp <= 0:
            raise InvalidArgumentError("This model has no MLP (cfg.d_mlp is 0): there are no neurons to analyse.")
        self.model = model
        self.settings = settings
        self.n_layers, self.d_model, self.d_mlp = d.n_layers, d.d_model, d.d_mlp
        self.layers = resolve_layers(layers, d.n_layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.sink = settings.sink_position
        self.device = model_device(model)
        self.reset()

    def reset(self) -> None:
        dev, f64, n = self.device, torch.float64, len(self.layers)
        self.sink_sum = torch.zeros(n, self.d_mlp, device=dev, dtype=f64)
        self.other_sq = torch.zeros(n, self.d_mlp, device=dev, dtype=f64)
        self.other_max = torch.zeros(n, self.d_mlp, device=dev, dtype=torch.float32)
        self.resid = torch.zeros(self.n_layers + 1, self.d_model, device=dev, dtype=f64)
        self.attn = torch.zeros(self.n_layers, self.d_model, device=dev, dtype=f64)
        self.mlp = torch.zeros(self.n_layers, self.d_model, device=dev, dtype=f64)
        self.n_sequences = 0
        self.n_other = 0

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        check_sink_position(batch, self.sink)
        other = other_positions(batch, self.sink)
        s = self.sink

        def fold_post(act: Tensor, layer: int) -> None:  # [batch, pos, d_mlp]
            i, x = self.row[layer], act.float()
            self.sink_sum[i] += x[:, s].sum(0).double()
            xo = x * other[..., None]  # per-batch reductions in float32, running sums in float64
            self.other_sq[i] += xo.square().sum(dim=(0, 1)).double()
            biggest = torch.maximum(xo.amax(dim=(0, 1)), -xo.amin(dim=(0, 1)))
            self.other_max[i] = torch.maximum(self.other_max[i], biggest)

        def at_sink(target: Tensor):
            def fold(act: Tensor, i: int) -> None:  # [batch, pos, d_model]
                target[i] += act[:, s].double().sum(0)

            return fold

        streams = resolve_streams(None, self.n_layers)
        blocks = range(self.n_layers)
        hooks = per_layer_hooks(MLP_POST, self.layers, fold_post)
        hooks += bound_hooks([stream_hook(i, self.n_layers) for i in streams], streams, at_sink(self.resid))
        hooks += per_layer_hooks(ATTN_OUT, blocks, at_sink(self.attn))
        hooks += per_layer_hooks(MLP_OUT, blocks, at_sink(self.mlp))
        return BatchFold(hooks)

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        self.n_sequences += batch.valid.shape[0]
        self.n_other += int(other_positions(batch, self.sink).sum())

    def result(self) -> SuperNeurons:
        if self.n_sequences == 0:
            raise InvalidArgumentError("No batches were streamed; nothing to summarise.")
        cfg = self.settings
        sink_act = (self.sink_sum / self.n_sequences).float()
        other_rms = (self.other_sq / max(self.n_other, 1)).sqrt().float()
        position_ratio = sink_act.abs() / other_rms.clamp_min(_TINY)
        neuron_ratio = sink_act.abs() / sink_act.abs().median(dim=-1, keepdim=True).values.clamp_min(_TINY)
        is_super = (position_ratio >= cfg.position_threshold) & (neuron_ratio >= cfg.neuron_threshold)
        resid, attn, mlp = (t.float() / self.n_sequences for t in (self.resid, self.attn, self.mlp))
        dims = list(cfg.dims) if cfg.dims is not None else massive_dims_from_resid(resid, cfg.dim_threshold, cfg.max_dims)
        W_out = weight(self.model, "W_out")[self.layers].float().to(sink_act.device)  # [layer, neuron, d_model]
        contribution = sink_act[:, :, None] * W_out[:, :, dims]
        kurt, share = row_sparsity(W_out, cfg.row_top_k)
        result = SuperNeurons(
            layers=list(self.layers), settings=cfg, dims=list(dims),
            sink_act=sink_act.cpu(), other_rms=other_rms.cpu(), other_max_abs=self.other_max.cpu(),
            position_ratio=position_ratio.cpu(), neuron_ratio=neuron_ratio.cpu(), is_super=is_super.cpu(),
            contribution=contribution.cpu(), row_kurtosis=kurt.cpu(), row_top_share=share.cpu(),
            resid_sink=resid.cpu(), attn_out_sink=attn.cpu(), mlp_out_sink=mlp.cpu(),
            paths=[], n_sequences=self.n_sequences,
        )
        for d in dims:
            path = dim_path(result.resid_sink, result.attn_out_sink, result.mlp_out_sink, d,
                            erase_fraction=cfg.erase_fraction)
            result.paths.append(path)
            path.top_neurons = result.top(d, cfg.top_k)
        return result


def find_super_neurons(
    model: Any,
    inputs: Inputs | None = None,
    *,
    layers: int | Sequence[int] | None = None,
    sink_position: int = SuperNeuronSettings.sink_position,
    dims: Sequence[int] | None = None,
    position_threshold: float = SuperNeuronSettings.position_threshold,
    neuron_threshold: float = SuperNeuronSettings.neuron_threshold,
    dim_threshold: float = SuperNeuronSettings.dim_threshold,
    max_dims: int = SuperNeuronSettings.max_dims,
    erase_fraction: float = SuperNeuronSettings.erase_fraction,
    top_k: int = SuperNeuronSettings.top_k,
    row_top_k: int = SuperNeuronSettings.row_top_k,
    options: RunOptions = RunOptions(),
    **deprecated: Any,
) -> SuperNeurons:
    """Find super neurons at ``sink_position`` and the blocks/neurons that write each massive dimension.

    Args:
        inputs: anything :func:`sinklens.inputs.as_batches` accepts (None = the built-in prompts).
        layers: model layers whose neurons are analysed (None = all). The residual path always uses all.
        dims: massive residual dimensions to attribute (None: detected at the sink with ``dim_threshold``,
            at most ``max_dims``; e.g. pass ``MassiveActivations.massive_dims()``).
        sink_position, position_threshold, neuron_threshold, dim_threshold, max_dims, erase_fraction, top_k,
            row_top_k: see :class:`SuperNeuronSettings`.
        options: batching, BOS, truncation, extra hooks and progress bar.

    Examples:
        >>> from sinklens.testing.planted import planted_model
        >>> model, spec = planted_model(n_layers=2, layer=0, neuron=7, dim=5)
        >>> found = find_super_neurons(model, "t3 t4 t5 t6", options=RunOptions(progress=False))
        >>> found.dims, found.top(5, 1)[0][:2], found.path(5).write_layer
        ([5], (0, 7), 0)
    """
    options = options_from_legacy(options, deprecated, "find_super_neurons")
    settings = SuperNeuronSettings(
        sink_position=sink_position, dims=None if dims is None else tuple(dims), position_threshold=position_threshold,
        neuron_threshold=neuron_threshold, dim_threshold=dim_threshold, max_dims=max_dims,
        erase_fraction=erase_fraction, top_k=top_k, row_top_k=row_top_k,
    )
    (result,) = run(model, inputs, SuperNeuronReducer(model, layers=layers, settings=settings), options=options)
    return result
