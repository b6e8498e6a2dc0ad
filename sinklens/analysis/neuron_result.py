"""What a super-neuron analysis (:mod:`sinklens.analysis.neurons`) returns: settings, paths, :class:`SuperNeurons`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from sinklens.analysis._common import SettingsFields, row_index, sink_position_arg
from sinklens.display import CompactRepr, StructuralEq
from sinklens.errors import InvalidArgumentError
from sinklens.export import to_json
from sinklens.validate import as_int, choice, finite_number, positive_int


@dataclass(frozen=True)
class SuperNeuronSettings:
    """Settings of one super-neuron analysis. ``dims`` (None: the ``max_dims`` largest massive at ``dim_threshold``);
    ``path_share`` / ``super_share``: the share of a dim's ``|peak|`` a block's step / a neuron's contribution must
    reach to be listed / to be super."""

    sink_position: int = 0
    dims: Sequence[int] | None = None
    position_threshold: float = 10.0
    neuron_threshold: float = 10.0
    dim_threshold: float = 100.0
    max_dims: int = 4
    erase_fraction: float = 0.5
    top_k: int = 10
    row_top_k: int = 1
    path_share: float = 0.05
    super_share: float = 0.05

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "sink_position", sink_position_arg(self.sink_position))
        if self.dims is not None:
            set_(self, "dims", tuple(as_int(d, what="dims") for d in self.dims))
        for name in ("position_threshold", "neuron_threshold", "dim_threshold"):
            set_(self, name, finite_number(getattr(self, name), what=name, low=0.0, low_open=True))
        for name in ("max_dims", "top_k", "row_top_k"):
            set_(self, name, positive_int(getattr(self, name), what=name))
        for name in ("erase_fraction", "path_share", "super_share"):
            set_(self, name, finite_number(getattr(self, name), what=name, low=0.0, high=1.0, low_open=True))


def check_fits_model(d_model: int, row_top_k: int, dims: Sequence[int]) -> None:
    """Raise when ``row_top_k`` or a dimension of ``dims`` does not fit a residual stream of ``d_model``."""
    if not 1 <= row_top_k <= d_model:
        raise InvalidArgumentError(f"row_top_k must be in [1, {d_model}] (d_model), got {row_top_k}.")
    if bad := [x for x in dims if not 0 <= x < d_model]:
        raise InvalidArgumentError(f"dims {bad} are out of range for d_model={d_model} (0..{d_model - 1}).")


@dataclass(eq=False)
class BlockStep(StructuralEq):
    """One block's step in a massive dim at the sink, mean over sequences, residual units: ``delta = attn + mlp``
    (``hook_attn_out`` + ``hook_mlp_out``); ``attn_share = |attn| / (|attn| + |mlp|)``; ``share``: ``delta / |peak|``
    signed towards the peak (< 0: erases); ``top_neurons`` ``(layer, neuron, contribution)`` / ``top_heads``
    ``(head, contribution)``: the block's largest in the step's direction."""

    block: int
    delta: float
    attn: float
    mlp: float
    attn_share: float
    share: float
    top_neurons: list[tuple[int, int, float]] = field(default_factory=list)
    top_heads: list[tuple[int, float]] = field(default_factory=list)


@dataclass(repr=False, eq=False)
class MassiveDimPath(CompactRepr):
    """How one massive residual dim at the sink is written and erased across blocks. ``peak_layer`` /
    ``peak_value``: the stream (``l``: input of block ``l``) and signed mean value where ``|value|`` peaks;
    ``write_layer``: the block stepping furthest towards the peak's sign; ``erase_layer``: the later block taking
    back the most, if ``erase_fraction`` of it; ``writers`` / ``erasers``: every :class:`BlockStep` of ``path_share``;
    ``top_neurons`` / ``total_effect``: ``(layer, neuron, value)`` by direct contribution / total effect, best first.
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
    writers: list[BlockStep] = field(default_factory=list)
    erasers: list[BlockStep] = field(default_factory=list)
    first_massive_stream: int | None = None
    total_effect: list[tuple[int, int, float]] = field(default_factory=list)


@dataclass(repr=False, eq=False)
class SuperNeurons(SettingsFields, CompactRepr):
    """Super neurons at the sink and the paths of the massive dims (:mod:`sinklens.analysis.neurons`).

    Attributes:
        sink_act: mean ``mlp.hook_post`` at the sink; ``other_rms`` / ``other_max_abs``: over the other valid
            positions; ``position_ratio = |sink_act| / other_rms``; ``neuron_ratio``: over the layer's median
            ``|sink_act|``; ``is_outlier``: both reach their thresholds.
        contribution: the residual-unit write into ``dims`` at the sink; ``mlp_offset_sink`` / ``attn_offset_sink``:
            ``b_out`` / ``b_O`` through the post norm, so that contributions (and ``head_contribution``) plus offset
            are ``mlp_out_sink`` (``attn_out_sink``).
        row_kurtosis / row_top_share: Pearson kurtosis of each ``W_out`` row and the share of its squared norm in its
            ``row_top_k`` largest entries.
        n_massive: dimensions detected as massive (None when ``dims`` were given).
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
    is_outlier: Bool[Tensor, "layer neuron"]
    mlp_offset_sink: Float[Tensor, "block d_model"]
    post_norm_blocks: list[int]
    head_contribution: Float[Tensor, "block head n_dims"]
    attn_offset_sink: Float[Tensor, "block d_model"]
    n_massive: int | None
    total_effect: Float[Tensor, "layer neuron n_dims"] | None = None

    def _ranking(self, dim: int, k: Any, sign: float | None) -> tuple[int, int, float]:
        """``(k, column of dim, sign of its peak unless given)``, checked."""
        k = positive_int(k, what="k")
        path = self.path(dim)
        return k, self.dims.index(path.dim), (1.0 if path.peak_value >= 0 else -1.0) if sign is None else sign

    def top_heads(self, dim: int, block: int, k: int = 3, *, sign: float | None = None) -> list[tuple[int, float]]:
        """``(head, contribution)`` of ``block``'s ``k`` heads writing most into ``dim`` towards its peak (or ``sign``),
        best first."""
        k, j, sign = self._ranking(dim, k, sign)
        col = sign * self.head_contribution[block, :, j]
        vals, idx = col.topk(min(k, col.numel()))
        return [(int(h), float(sign * v)) for h, v in zip(idx, vals)]

    def super_neurons(self, kind: str | None = None) -> list[tuple[int, int]]:
        """``(layer, neuron)`` of every super neuron, largest ``|contribution|`` first;
        ``kind="writers"`` / ``"erasers"``: those whose largest contribution has (has not) its
        dimension's peak sign."""
        kind = None if kind is None else choice(kind, ("writers", "erasers"), what="kind")
        idx = self.is_super.nonzero()
        if not idx.numel():  # always so without dims
            return []
        c = self.contribution[idx[:, 0], idx[:, 1]]  # [super, n_dims]
        size, j = c.abs().max(dim=-1)
        if kind is not None:
            peak_sign = torch.tensor([1.0 if p.peak_value >= 0 else -1.0 for p in self.paths])
            writes = c.gather(1, j[:, None])[:, 0] * peak_sign[j] > 0
            keep = writes if kind == "writers" else ~writes
            idx, size = idx[keep], size[keep]
        order = size.argsort(descending=True, stable=True)
        return [(self.layers[int(r)], int(n)) for r, n in idx[order].tolist()]

    def outliers(self) -> list[tuple[int, int]]:
        """``(layer, neuron)`` of every activation outlier (``is_outlier``), largest ``|sink_act|`` first."""
        idx = self.is_outlier.nonzero()
        order = self.sink_act[idx[:, 0], idx[:, 1]].abs().argsort(descending=True)
        return [(self.layers[int(r)], int(n)) for r, n in idx[order].tolist()]

    def path(self, dim: int) -> MassiveDimPath:
        """The :class:`MassiveDimPath` of one analysed dimension."""
        if found := [p for p in self.paths if p.dim == dim]:
            return found[0]
        raise InvalidArgumentError(f"Dimension {dim} was not analysed; analysed dims: {self.dims}.")

    def top(self, dim: int, k: int = 10, *, block: int | None = None, sign: float | None = None,
            by: str = "direct") -> list[tuple[int, int, float]]:
        """``(layer, neuron, contribution)`` of the ``k`` neurons writing most into ``dim`` towards
        its peak (or ``sign``), best first; ``block``: one layer's neurons only; ``by="total"``:
        ranked by ``total_effect``."""
        k, j, sign = self._ranking(dim, k, sign)
        if choice(by, ("direct", "total"), what="by") == "total" and self.total_effect is None:
            raise InvalidArgumentError("by='total' needs total_effect: call add_total_effects(model, batches, result).")
        contrib = (self.total_effect if by == "total" else self.contribution)[:, :, j]
        layers = self.layers if block is None else [block] if block in self.layers else []
        flat = (sign * contrib[[self.layers.index(layer) for layer in layers]]).flatten()
        vals, idx = flat.topk(min(k, flat.numel()))
        n = self.contribution.shape[1]
        return [(layers[int(i) // n], int(i) % n, float(sign * v)) for i, v in zip(idx, vals)]

    def neuron_row(self, layer: int, neuron: int) -> dict[str, Any]:
        """All statistics of one neuron as a dict."""
        r = row_index(self.layers, layer)
        names = ("sink_act", "other_rms", "other_max_abs", "position_ratio", "neuron_ratio", "is_super",
                 "is_outlier", "row_kurtosis", "row_top_share")  # .item(): a float, or a bool for the masks
        return ({"layer": layer, "neuron": neuron} | {name: getattr(self, name)[r, neuron].item() for name in names}
                | {f"contribution_{d}": float(self.contribution[r, neuron, j]) for j, d in enumerate(self.dims)})

    def rows(self, k: int = 10) -> list[dict[str, Any]]:
        """DataFrame-ready rows: each dim's ``k`` top writers, then every other super neuron (``dim`` None)."""
        out = [{"dim": d, "rank": rank, "contribution": c} | self.neuron_row(layer, n)
               for d in self.dims for rank, (layer, n, c) in enumerate(self.top(d, k))]
        seen = {(row["layer"], row["neuron"]) for row in out}
        return out + [{"dim": None, "rank": None, "contribution": None} | self.neuron_row(layer, n)
                      for layer, n in self.super_neurons() if (layer, n) not in seen]

    def to_dict(self, k: int = 10) -> dict[str, Any]:
        """JSON-ready summary: thresholds, dims and their paths, super neurons, top-neuron rows."""
        return to_json({
            "layers": self.layers, "settings": self.settings, "dims": self.dims, "n_sequences": self.n_sequences,
            "units": "residual (after any post-MLP norm)", "post_norm_blocks": self.post_norm_blocks,
            "n_massive": self.n_massive, "max_dims": self.max_dims,
            "super_neurons": self.super_neurons(), "super_writers": self.super_neurons("writers"),  # pairs as lists
            "super_erasers": self.super_neurons("erasers"), "activation_outliers": self.outliers(),
            "paths": self.paths, "rows": self.rows(k),
        })
