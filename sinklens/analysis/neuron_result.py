"""What a super-neuron analysis returns: its settings, :class:`SuperNeurons` and the massive-dimension paths in it.

The definitions of every number are in :mod:`sinklens.analysis.neurons`, which computes them in one streaming pass.
"""

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
    """Settings of one super-neuron analysis, held by :class:`~sinklens.analysis.neurons.SuperNeuronReducer` and :class:`SuperNeurons`.

    Attributes:
        sink_position: the position whose neurons and residual path are analysed.
        dims: massive residual dimensions to attribute (None: detected at the sink, see ``dim_threshold``).
        position_threshold / neuron_threshold: activation-outlier thresholds on ``position_ratio`` /
            ``neuron_ratio`` (``is_outlier``).
        dim_threshold: a dimension is massive if ``|resid[s, d]|`` exceeds this × the median ``|resid[s, :]|``.
        max_dims: at most this many detected dimensions (those with the largest peaks; ``SuperNeurons.n_massive``
            says how many were detected).
        erase_fraction: ``MassiveDimPath.erase_layer`` must undo at least this share of the peak.
        top_k: top neurons listed per dimension (and per writer/eraser block) in :class:`MassiveDimPath`.
        row_top_k: entries counted in ``row_top_share``.
        path_share: a block is listed as a writer (eraser) of a dimension when its step at the sink moves the
            dimension towards (away from) its peak's sign by at least this share of ``|peak|`` (default 5%).
        super_share: a neuron is a super neuron when its ``|contribution|`` to an analysed dimension reaches
            this share of that dimension's ``|peak|`` (default 5%).
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
    path_share: float = 0.05
    super_share: float = 0.05

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
        for name in ("path_share", "super_share"):
            set_(self, name, finite_number(getattr(self, name), what=name, low=0.0, high=1.0, low_open=True))


@dataclass(eq=False)
class BlockStep(StructuralEq):
    """One block's step in a massive dimension at the sink (residual units: after any post norm).

    Attributes:
        block: the block; ``delta``: its step ``attn + mlp`` in the dimension (``hook_attn_out`` +
            ``hook_mlp_out`` at the sink, mean over sequences); ``attn`` / ``mlp``: the two parts;
            ``attn_share = |attn| / (|attn| + |mlp|)``.
        share: ``delta / |peak|`` signed towards the peak (> 0: writes towards the peak's sign, < 0: erases).
        top_neurons: ``(layer, neuron, contribution)`` of the block's neurons contributing most in the step's
            direction, best first (empty when the block's neurons were not analysed).
        top_heads: ``(head, contribution)`` of the block's attention heads contributing most in the step's
            direction (``z_h W_O[h]`` through the post-attention norm when there is one), best first.
    """

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
        top_neurons: ``(layer, neuron, contribution)`` of the neurons writing most in the peak's direction
            (direct effect, residual units), best first.
        writers / erasers: every block whose step writes (erases) at least ``path_share`` of ``|peak|``, in
            block order (:class:`BlockStep`).
        first_massive_stream: the first residual stream where ``|value|`` exceeds ``dim_threshold`` × the median
            ``|resid[s, :]|`` (stream ``s`` is block ``s - 1``'s output; 0 the embedding); None if never.
        total_effect: ``(layer, neuron, total effect)`` rows, best first: the dimension's value at ``peak_layer``
            that zeroing the neuron at the sink would remove, through every later block
            (:func:`~sinklens.analysis.neurons.add_total_effects`); empty when not computed.
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

    def to_dict(self) -> dict[str, Any]:
        return to_json(self)


@dataclass(repr=False, eq=False)
class SuperNeurons(SettingsFields, CompactRepr):
    """Super neurons at the sink and the paths of the massive dimensions (see the module docstring).

    Attributes:
        layers: model layers of the neuron rows. ``dims``: the massive dimensions analysed.
        settings: the :class:`SuperNeuronSettings` of the run; its fields also read as attributes
            (``result.sink_position``, ``result.row_top_k``, ...).
        sink_act / other_rms / other_max_abs / position_ratio / neuron_ratio / is_outlier: per-neuron
            activation statistics (the activation-outlier columns).
        contribution: residual-unit contribution to ``dims`` at the sink (see the module docstring).
        is_super: super neurons (``|contribution|`` >= ``super_share`` × the dimension's ``|peak|``).
        row_kurtosis / row_top_share: sparsity of each ``W_out`` row (``row_top_k`` largest entries).
        resid_sink: mean residual stream at the sink, per stream index ``0..n_layers``.
        attn_out_sink / mlp_out_sink: mean ``hook_attn_out`` / ``hook_mlp_out`` at the sink, per block (what the
            block adds to the residual stream, after any post norm).
        paths: one :class:`MassiveDimPath` per entry of ``dims``.
        mlp_offset_sink: per block, the part of ``mlp_out_sink`` no neuron wrote (``b_out`` through the post
            norm plus its bias), so ``contribution.sum(neuron) + mlp_offset_sink[l, dims] == mlp_out_sink[l, dims]``.
        post_norm_blocks: blocks whose MLP output passes a post norm (their contributions went through it).
        head_contribution: ``[block, head, n_dims]`` each head's residual-unit contribution to ``dims`` at the sink:
            mean over sequences of ``z_h W_O[block, h]`` (``z_h`` at the sink from the head output site,
            :func:`~sinklens.hooks.head_output_site`: ``attn.hook_z``, or a SinkLM variant's own) taken through the
            post-attention norm (``ln1_post``: ``× gain / scale``) when there is one; with ``attn_offset_sink``
            (``b_O`` through the norm, plus its bias) it adds up to ``attn_out_sink``.
        n_massive: how many dimensions were detected as massive (``dims`` holds the ``max_dims`` largest); None
            when ``dims`` were given.
        total_effect: ``[layer, neuron, n_dims]`` attribution-patching estimate of what zeroing each neuron at the
            sink removes from each dim at its peak stream (:func:`~sinklens.analysis.neurons.add_total_effects`);
            None until computed.
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
    is_outlier: Bool[Tensor, "layer neuron"] | None = None
    mlp_offset_sink: Float[Tensor, "block d_model"] | None = None
    post_norm_blocks: list[int] = field(default_factory=list)
    head_contribution: Float[Tensor, "block head n_dims"] | None = None
    attn_offset_sink: Float[Tensor, "block d_model"] | None = None
    n_massive: int | None = None
    total_effect: Float[Tensor, "layer neuron n_dims"] | None = None

    def _ranking(self, dim: int, k: Any, sign: float | None) -> tuple[int, int, float]:
        """``(k, column of dim, sign)`` for :meth:`top` and :meth:`top_heads`: ``k`` checked, ``dim`` analysed,
        the sign of its peak unless given."""
        k = positive_int(k, what="k")
        path = self.path(dim)
        return k, self.dims.index(path.dim), (1.0 if path.peak_value >= 0 else -1.0) if sign is None else sign

    def top_heads(self, dim: int, block: int, k: int = 3, *, sign: float | None = None) -> list[tuple[int, float]]:
        """``(head, contribution)`` of block ``block``'s ``k`` heads writing most into ``dim`` in the peak's direction
        (or ``sign``), residual units, best first."""
        if self.head_contribution is None:
            return []
        k, j, sign = self._ranking(dim, k, sign)
        col = sign * self.head_contribution[block, :, j]
        vals, idx = col.topk(min(k, col.numel()))
        return [(int(h), float(sign * v)) for h, v in zip(idx, vals)]

    def super_neurons(self, kind: str | None = None) -> list[tuple[int, int]]:
        """``(layer, neuron)`` of every super neuron, largest residual-unit ``|contribution|`` (over the analysed
        dims) first; ``kind="writers"`` / ``"erasers"``: only those whose largest contribution has (does not have)
        its dimension's peak sign."""
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
        mask = self.is_outlier if self.is_outlier is not None else torch.zeros_like(self.is_super)
        idx = mask.nonzero()
        order = self.sink_act[idx[:, 0], idx[:, 1]].abs().argsort(descending=True)
        return [(self.layers[int(r)], int(n)) for r, n in idx[order].tolist()]

    def path(self, dim: int) -> MassiveDimPath:
        """The :class:`MassiveDimPath` of one analysed dimension."""
        for p in self.paths:
            if p.dim == dim:
                return p
        raise InvalidArgumentError(f"Dimension {dim} was not analysed; analysed dims: {self.dims}.")

    def top(self, dim: int, k: int = 10, *, block: int | None = None, sign: float | None = None,
            by: str = "direct") -> list[tuple[int, int, float]]:
        """``(layer, neuron, contribution)`` of the ``k`` neurons writing most into ``dim`` in its peak's direction
        (residual units), best first; ``block`` restricts to one layer's neurons (empty if it was not analysed),
        ``sign`` (+1/-1) overrides the direction (e.g. -peak sign for erasers); ``by="total"`` ranks by
        ``total_effect`` instead of the direct ``contribution``."""
        k, j, sign = self._ranking(dim, k, sign)
        if choice(by, ("direct", "total"), what="by") == "total" and self.total_effect is None:
            raise InvalidArgumentError("by='total' needs total_effect: call add_total_effects(model, batches, result).")
        contrib = (self.total_effect if by == "total" else self.contribution)[:, :, j]
        rows = list(range(len(self.layers)))
        if block is not None:
            if block not in self.layers:
                return []
            rows = [self.layers.index(block)]
        flat = (sign * contrib[rows]).flatten()
        vals, idx = flat.topk(min(k, flat.numel()))
        n = self.contribution.shape[1]
        return [(self.layers[rows[int(i) // n]], int(i) % n, float(sign * v)) for i, v in zip(idx, vals)]

    def neuron_row(self, layer: int, neuron: int) -> dict[str, Any]:
        """All statistics of one neuron as a dict."""
        r = row_index(self.layers, layer)
        row = {
            "layer": layer, "neuron": neuron, "sink_act": float(self.sink_act[r, neuron]),
            "other_rms": float(self.other_rms[r, neuron]), "other_max_abs": float(self.other_max_abs[r, neuron]),
            "position_ratio": float(self.position_ratio[r, neuron]), "neuron_ratio": float(self.neuron_ratio[r, neuron]),
            "is_super": bool(self.is_super[r, neuron]),
            "is_outlier": None if self.is_outlier is None else bool(self.is_outlier[r, neuron]),
            "row_kurtosis": float(self.row_kurtosis[r, neuron]),
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
            "units": "residual (after any post-MLP norm)", "post_norm_blocks": self.post_norm_blocks,
            "n_massive": self.n_massive, "max_dims": self.max_dims,
            "super_neurons": [list(x) for x in self.super_neurons()],
            "super_writers": [list(x) for x in self.super_neurons("writers")],
            "super_erasers": [list(x) for x in self.super_neurons("erasers")],
            "activation_outliers": [list(x) for x in self.outliers()],
            "paths": [p.to_dict() for p in self.paths], "rows": self.rows(k),
        })
