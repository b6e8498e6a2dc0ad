"""Value-aggregation variance: why the first token's head output stands out.

A head's output at position ``t`` is ``z_t = Σ_{j<=t} A_tj v_j``. If the values ``v_j`` are
independent across positions with a common mean ``μ`` and per-coordinate variance ``σ_v²`` (and
independent of ``A``), then ``E z_t = μ`` and ``E|z_t − μ|² / d_head = σ_v² · E[Σ_j A_tj²]``, which
is ``σ_v² / (t + 1)`` under uniform attention: the first token (``t = 0``) keeps the full variance of
one value, later tokens average it away. :class:`VarianceReducer` measures both sides in one
streaming pass.

**Definition** (``z_var``, used throughout). For layer ``l``, head ``h`` and position ``t``::

    z_var[l, h, t] = mean_c  mean_{sequences b valid at t}  (z[b, t, h, c] − m[l, h, c])²

where ``z`` is ``blocks.{l}.attn.hook_z`` and ``m[l, h, c]`` is the mean of ``z[..., h, c]`` over
*all* valid (sequence, position) pairs. Centring on one mean for all positions (instead of on a
per-position mean) is what makes the law above exact *and* counts a position whose output sits
far from the others — a constant BOS output has zero variance across sequences but a large
deviation here. The across-sequence variance with a per-position mean is also kept
(``z_var_seq``). Both use ``1/n`` (not ``1/(n−1)``).

The same definition is applied to

* ``result_var``: the head's own contribution to the residual stream, ``z_h · W_O[l, h]``
  (computed from the ``W_O`` weights inside the ``hook_z`` fold, averaged over ``d_model``
  coordinates), so :meth:`VarianceResult.preservation` can tell whether ``W_O`` keeps the
  first token's excess;
* ``attn_out_var``: ``blocks.{l}.hook_attn_out`` (all heads plus bias, averaged over ``d_model``).

Predictions, beside the measurement:

* ``value_var[l, h] = σ_v²``: variance of ``blocks.{l}.attn.hook_v`` over all valid (sequence,
  position) pairs around its overall mean, averaged over ``d_head`` (key/value heads expanded to
  query heads under grouped-query attention);
* ``pred_pattern = σ_v² · attn_sq`` with ``attn_sq[l, h, t]`` = mean over sequences of
  ``Σ_j pattern[l, h, t, j]²`` (the actual attention pattern);
* ``pred_uniform = σ_v² / (t + 1)``.

Each batch is reduced in float32 (so the hooks cost little next to the forward) and folded into
float64 running sums (sum, sum of squares, counts per position) on the model's device; no
activation outlives its hook.

Measured on SmolLM2-135M-Instruct (64 stdlib docstrings, 64 tokens each, with BOS): the
head-median discrepancy ``discrepancy(0)`` is 5.4, 11.4, 2.8 in layers 0-2 and 6.0, 9.9, 1.2 in
layers 10-12, but 0.1-0.9 in the sink-dominated layers 3-9 and 13-29 (> 1 in 7 of 30 layers):
once position 0 is a sink, its output is nearly the same vector in every sequence and sits close
to the others' mean. Without BOS (``prepend_bos=False``) the picture is the same (> 1 in layers
0-2 and 10-12), and the across-sequence variance ``z_var_seq`` at position 0 drops to ~0 from
layer 12 on even though the first token differs between sequences. The uniform law predicts a
ratio of 16.3 for these lengths; ``W_O`` keeps the ratio (head-median ``preservation`` 0.7-1.1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.analysis._common import grow, options_from_legacy, position_index
from sinklens.errors import InvalidArgumentError
from sinklens.export import to_json
from sinklens.hooks import ATTN_OUT, PATTERN, V, Z, model_device, model_dims, resolve_layers, weight
from sinklens.inputs import Inputs, TokenBatch
from sinklens.options import RunOptions
from sinklens.streaming import BatchFold, Reducer, per_layer_hooks, run
from sinklens.validate import choice

Site = Literal["z", "z_seq", "result", "attn_out"]


def _global_centred(
    s1: Float[Tensor, "*lead pos dim"],
    s2: Float[Tensor, "*lead pos"],
    n: Float[Tensor, " pos"],
    n_coords: int,
    gram: Float[Tensor, "*lead dim dim"] | None = None,
) -> Float[Tensor, "*lead pos"]:
    """``mean_c mean_b (x − m)²`` per position from ``Σ_b x`` (``s1``), ``Σ_b |x|²`` (``s2``), counts.

    ``m`` is the mean of ``x`` over all positions. With ``gram = W Wᵀ`` the sums are of ``x`` but
    the variance is that of ``x W`` (``s2`` must then already be ``Σ_b |x W|²``).
    """
    mean = s1.sum(dim=-2) / n.sum()  # [*lead, dim]
    if gram is not None:
        proj = torch.einsum("...d,...de->...e", mean, gram)
        cross, sq = torch.einsum("...e,...pe->...p", proj, s1), (proj * mean).sum(-1)
    else:
        cross, sq = torch.einsum("...e,...pe->...p", mean, s1), (mean * mean).sum(-1)
    total = s2 - 2 * cross + n * sq[..., None]
    return total / (n * n_coords)


@dataclass
class VarianceResult:
    """Variance of head outputs by position, with the pattern-based and uniform-attention predictions.

    See the module docstring for the exact definitions. Positions with no valid token are NaN.

    Attributes:
        z_var: ``hook_z`` variance around the overall per-(layer, head, coordinate) mean.
        z_var_seq: ``hook_z`` variance across sequences around the per-position mean.
        result_var: variance of ``z_h · W_O[l, h]`` (same centring as ``z_var``), over ``d_model``.
        attn_out_var: variance of ``hook_attn_out`` (same centring), over ``d_model``.
        value_var: ``σ_v²`` per (layer, head), from ``hook_v`` over all valid positions.
        attn_sq: mean over sequences of ``Σ_j A_tj²`` (1/(t+1) under uniform attention).
        counts: sequences valid at each position.
        layers: the model layer of each row.
        n_sequences: sequences streamed.
        prepend_bos: whether position 0 was a prepended BOS token.
    """

    z_var: Float[Tensor, "layer head pos"]
    z_var_seq: Float[Tensor, "layer head pos"]
    result_var: Float[Tensor, "layer head pos"]
    attn_out_var: Float[Tensor, "layer pos"]
    value_var: Float[Tensor, "layer head"]
    attn_sq: Float[Tensor, "layer head pos"]
    counts: Float[Tensor, " pos"]
    layers: list[int]
    n_sequences: int
    prepend_bos: bool

    @property
    def pred_pattern(self) -> Float[Tensor, "layer head pos"]:
        """Prediction from the measured pattern: ``σ_v² · mean_b Σ_j A_tj²``."""
        return self.value_var[:, :, None] * self.attn_sq

    @property
    def pred_uniform(self) -> Float[Tensor, "layer head pos"]:
        """Uniform-attention law ``σ_v² / (t + 1)``."""
        t = torch.arange(self.z_var.shape[-1], dtype=self.z_var.dtype)
        return self.value_var[:, :, None] / (t + 1)

    def position_index(self, position: int) -> int:
        """Index of a measured position (negatives count from the end); a named error if out of range
        or if no sequence reached it."""
        idx = position_index(position, self.counts.shape[0])
        if self.counts[idx] <= 0:
            raise InvalidArgumentError(f"position {position} is out of range: no sequence reached it.")
        return idx

    def variance(self, of: Site = "z") -> Tensor:
        """The measured variance of one site: ``z_var``, ``z_var_seq``, ``result_var`` or ``attn_out_var``."""
        sites = {"z": self.z_var, "z_seq": self.z_var_seq, "result": self.result_var, "attn_out": self.attn_out_var}
        return sites[choice(of, sorted(sites), what="of")]

    def rest_positions(self, position: int = 0) -> list[int]:
        """The positions the discrepancy compares against: valid ``t >= 1`` with ``t != position``."""
        idx = self.position_index(position)
        return [t for t in range(1, self.counts.shape[0]) if t != idx and self.counts[t] > 0]

    def discrepancy(self, position: int = 0, *, of: Site = "z") -> Tensor:
        """Variance-discrepancy ratio: variance at ``position`` over the mean variance of the rest.

        The rest (:meth:`rest_positions`) are the valid positions ``t >= 1`` other than
        ``position``, weighted by how many sequences reach them (each valid token counts once).
        Shape ``[layer, head]`` for ``of`` in ``"z"``, ``"z_seq"``, ``"result"``; ``[layer]`` for
        ``"attn_out"``. Under uniform attention over ``T`` positions the ratio for position 0 is
        about ``T / ln T`` already, so compare it with the same ratio of :attr:`pred_uniform`.
        """
        return self.ratio_of(self.variance(of), position)

    def preservation(self, position: int = 0) -> Float[Tensor, "layer head"]:
        """How much of the discrepancy survives the output projection: ``discrepancy(of="result") /
        discrepancy(of="z")`` per (layer, head). 1 = ``W_O`` keeps the first token's excess variance
        (relative to the rest), < 1 = it shrinks it, > 1 = it amplifies it."""
        return self.discrepancy(position, of="result") / self.discrepancy(position, of="z")

    def rows(self) -> list[dict[str, Any]]:
        """Long format, one row per (layer, head, position) with every measured and predicted number."""
        cols = {
            "z_var": self.z_var.tolist(),
            "z_var_seq": self.z_var_seq.tolist(),
            "result_var": self.result_var.tolist(),
            "pred_pattern": self.pred_pattern.tolist(),
            "pred_uniform": self.pred_uniform.tolist(),
            "attn_sq": self.attn_sq.tolist(),
        }
        out_var = self.attn_out_var.tolist()
        counts = self.counts.tolist()
        value_var = self.value_var.tolist()
        return [
            {
                "layer": layer,
                "head": h,
                "position": t,
                "count": counts[t],
                "value_var": value_var[i][h],
                "attn_out_var": out_var[i][t],
                **{name: col[i][h][t] for name, col in cols.items()},
            }
            for i, layer in enumerate(self.layers)
            for h in range(self.z_var.shape[1])
            for t in range(self.z_var.shape[2])
        ]

    def summary_rows(self, position: int = 0) -> list[dict[str, Any]]:
        """One row per (layer, head): discrepancy ratios at ``position`` of z, of the measured and
        uniform predictions, of ``z · W_O``, the preservation ratio, and the layer's ``attn_out`` ratio."""
        z = self.discrepancy(position, of="z")
        res = self.discrepancy(position, of="result")
        out = self.discrepancy(position, of="attn_out")
        pred = self.ratio_of(self.pred_pattern, position)
        unif = self.ratio_of(self.pred_uniform, position)
        return [
            {
                "layer": layer,
                "head": h,
                "position": position,
                "discrepancy_z": float(z[i, h]),
                "discrepancy_pred_pattern": float(pred[i, h]),
                "discrepancy_pred_uniform": float(unif[i, h]),
                "discrepancy_result": float(res[i, h]),
                "preservation": float(res[i, h] / z[i, h]),
                "discrepancy_attn_out": float(out[i]),
                "value_var": float(self.value_var[i, h]),
            }
            for i, layer in enumerate(self.layers)
            for h in range(self.z_var.shape[1])
        ]

    def ratio_of(self, var: Float[Tensor, "*lead pos"], position: int = 0) -> Float[Tensor, "*lead"]:
        """``var`` at ``position`` over its count-weighted mean over :meth:`rest_positions` (the
        discrepancy ratio of any per-position variance, measured or predicted)."""
        rest = self.rest_positions(position)
        if not rest:
            raise InvalidArgumentError("Need at least one valid position >= 1 besides the chosen one to compare with.")
        w = self.counts[rest]
        return var[..., self.position_index(position)] / ((var[..., rest] * w).sum(-1) / w.sum())

    def to_dict(self, position: int = 0) -> dict[str, Any]:
        """JSON-ready: settings, per-(layer, head) discrepancies at ``position``, head-mean curves."""
        z = self.discrepancy(position, of="z")
        return to_json({
            "layers": list(self.layers),
            "n_sequences": self.n_sequences,
            "prepend_bos": self.prepend_bos,
            "position": position,
            "counts": self.counts.tolist(),
            "value_var": self.value_var.tolist(),
            "discrepancy_z": z.tolist(),
            "discrepancy_result": self.discrepancy(position, of="result").tolist(),
            "discrepancy_attn_out": self.discrepancy(position, of="attn_out").tolist(),
            "discrepancy_pred_pattern": self.ratio_of(self.pred_pattern, position).tolist(),
            "discrepancy_pred_uniform": self.ratio_of(self.pred_uniform, position).tolist(),
            "share_layers_discrepancy_gt_1": float((z.mean(dim=1) > 1).float().mean()),
            "z_var_head_mean": self.z_var.mean(dim=1).tolist(),
            "pred_pattern_head_mean": self.pred_pattern.mean(dim=1).tolist(),
            "pred_uniform_head_mean": self.pred_uniform.mean(dim=1).tolist(),
            "attn_out_var": self.attn_out_var.tolist(),
        }, digits=None)

    def plot(
        self,
        path: str | Path | None = None,
        *,
        layers: Sequence[int] | None = None,
        heads: int | Sequence[int] | None = None,
    ) -> Any:
        """Variance vs position, log-log, with both predictions (see
        :func:`sinklens.plotting.variance.plot_variance_by_position`)."""
        from sinklens.plotting.variance import plot_variance_by_position

        return plot_variance_by_position(self, layers=layers, heads=heads, path=path)

    def plot_discrepancy(self, path: str | Path | None = None, *, position: int = 0) -> Any:
        """Discrepancy-ratio heatmaps, layer × head, for z and z·W_O (see
        :func:`sinklens.plotting.variance.plot_discrepancy`)."""
        from sinklens.plotting.variance import plot_discrepancy

        return plot_discrepancy(self, position=position, path=path)


class VarianceReducer(Reducer[VarianceResult]):
    """Streams ``hook_v``, ``hook_pattern``, ``hook_z`` and ``hook_attn_out`` into a :class:`VarianceResult`.

    Per layer it keeps (float64, positions grown to the longest batch seen): ``Σ z`` per
    (head, position, coordinate), ``Σ |z|²`` and ``Σ |z W_O|²`` per (head, position), ``Σ attn_out``
    per (position, coordinate) and ``Σ |attn_out|²`` per position, ``Σ_b Σ_j A_tj²`` per (head,
    position), and ``Σ v``, ``Σ |v|²`` per (kv head, coordinate) pooled over positions. ``Σ z W_O``
    is not stored: it is ``(Σ z) W_O``, applied at :meth:`result` time.
    """

    statistics = ("z_s1", "z_s2", "r_s2", "a_sq", "o_s1", "o_s2", "n", "v_s1", "v_s2", "v_n", "n_seq", "prepend_bos")

    def __init__(self, model: Any, *, layers: int | Sequence[int] | None = None):
        dims = model_dims(model)
        self.dims = dims
        self.layers = resolve_layers(layers, dims.n_layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.device = model_device(model)
        w_o = weight(model, "W_O")[self.layers].to(self.device, torch.float64)  # [layer, head, d_head, d_model]
        self.w_o = w_o
        self.gram = w_o @ w_o.transpose(-1, -2)  # [layer, head, d_head, d_head]
        self.gram32 = self.gram.float()
        self.reset()

    def reset(self) -> None:
        dims, n_l = self.dims, len(self.layers)
        f64 = dict(device=self.device, dtype=torch.float64)
        self.z_s1 = torch.zeros(n_l, dims.n_heads, 0, dims.d_head, **f64)
        self.z_s2 = torch.zeros(n_l, dims.n_heads, 0, **f64)
        self.r_s2 = torch.zeros(n_l, dims.n_heads, 0, **f64)
        self.a_sq = torch.zeros(n_l, dims.n_heads, 0, **f64)
        self.o_s1 = torch.zeros(n_l, 0, dims.d_model, **f64)
        self.o_s2 = torch.zeros(n_l, 0, **f64)
        self.n = torch.zeros(0, **f64)
        self.v_s1 = torch.zeros(n_l, dims.n_kv_heads, dims.d_head, **f64)  # [layer, kv_head, d_head]
        self.v_s2 = torch.zeros(n_l, dims.n_kv_heads, **f64)
        self.v_n = 0.0
        self.n_seq = 0
        self.prepend_bos = True

    def _reserve(self, n: int) -> None:
        """Grow every per-position sum to ``n`` positions (zeros for new positions)."""
        self.z_s1, self.z_s2, self.r_s2, self.a_sq = (grow(t, 2, n) for t in (self.z_s1, self.z_s2, self.r_s2, self.a_sq))
        self.o_s1, self.o_s2 = grow(self.o_s1, 1, n), grow(self.o_s2, 1, n)
        self.n = grow(self.n, 0, n)

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        self._reserve(batch.tokens.shape[1])
        w = batch.valid.to(self.device, torch.float64)  # [batch, pos]
        w32 = w.float()

        def fold_v(v: Tensor, layer: int) -> None:  # [batch, pos, kv_head, d_head]
            row, v = self.row[layer], v.float()
            if v.shape[2] != self.v_s1.shape[1]:  # a model whose hook_v already repeats key/value heads
                self.v_s1 = torch.zeros(*self.v_s1.shape[:1], v.shape[2], v.shape[3], device=self.device, dtype=torch.float64)
                self.v_s2 = torch.zeros(*self.v_s2.shape[:1], v.shape[2], device=self.device, dtype=torch.float64)
            self.v_s1[row] += (v * w32[..., None, None]).sum(dim=(0, 1)).double()
            self.v_s2[row] += (v.square().sum(-1) * w32[..., None]).sum(dim=(0, 1)).double()

        def fold_pattern(pattern: Tensor, layer: int) -> None:  # [batch, head, query, key]
            sq = pattern.float().square().sum(dim=-1)  # Σ_k A_qk², [batch, head, query]
            self.a_sq[self.row[layer], :, : sq.shape[2]] += (sq * w32[:, None]).sum(0).double()

        def fold_z(z: Tensor, layer: int) -> None:  # [batch, pos, head, d_head]
            row, z = self.row[layer], z.float()
            n = z.shape[1]
            self.z_s1[row, :, :n] += (z * w32[..., None, None]).sum(0).transpose(0, 1).double()
            self.z_s2[row, :, :n] += (z.square().sum(-1) * w32[..., None]).sum(0).T.double()
            zg = torch.einsum("bphd,hde->bphe", z, self.gram32[row])  # |z W_O|² = z G zᵀ
            self.r_s2[row, :, :n] += ((zg * z).sum(-1) * w32[..., None]).sum(0).T.double()

        def fold_attn_out(out: Tensor, layer: int) -> None:  # [batch, pos, d_model]
            row, out = self.row[layer], out.float()
            n = out.shape[1]
            self.o_s1[row, :n] += (out * w32[..., None]).sum(0).double()
            self.o_s2[row, :n] += (out.square().sum(-1) * w32).sum(0).double()

        hooks = [hook for site, fold in ((V, fold_v), (PATTERN, fold_pattern), (Z, fold_z), (ATTN_OUT, fold_attn_out))
                 for hook in per_layer_hooks(site, self.layers, fold)]
        return BatchFold(hooks, state=w)

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        w = fold.state
        self.n[: w.shape[1]] += w.sum(dim=0)
        self.v_n += float(w.sum())
        self.n_seq += batch.tokens.shape[0]
        self.prepend_bos = batch.prepend_bos

    def result(self) -> VarianceResult:
        if self.v_n == 0:
            raise InvalidArgumentError("No valid tokens were streamed; nothing to measure.")
        valid = torch.nonzero(self.n > 0)
        p = int(valid.max()) + 1
        n = self.n[:p]
        d_head, d_model = self.dims.d_head, self.dims.d_model
        z_s1, z_s2 = self.z_s1[:, :, :p], self.z_s2[:, :, :p]
        z_var = _global_centred(z_s1, z_s2, n, d_head)
        z_var_seq = (z_s2 - z_s1.square().sum(-1) / n) / (n * d_head)
        result_var = _global_centred(z_s1, self.r_s2[:, :, :p], n, d_model, gram=self.gram)
        out_var = _global_centred(self.o_s1[:, :p], self.o_s2[:, :p], n, d_model)
        v_mean = self.v_s1 / self.v_n
        value_var = (self.v_s2 / self.v_n - v_mean.square().sum(-1)) / d_head  # [layer, kv_head]
        n_heads = self.dims.n_heads
        if value_var.shape[1] != n_heads:
            value_var = value_var.repeat_interleave(n_heads // value_var.shape[1], dim=1)
        attn_sq = self.a_sq[:, :, :p] / n

        def out(t: Tensor) -> Tensor:
            return t.float().cpu()

        return VarianceResult(
            z_var=out(z_var),
            z_var_seq=out(z_var_seq),
            result_var=out(result_var),
            attn_out_var=out(out_var),
            value_var=out(value_var),
            attn_sq=out(attn_sq),
            counts=out(n),
            layers=list(self.layers),
            n_sequences=self.n_seq,
            prepend_bos=self.prepend_bos,
        )


def measure_variance(
    model: Any,
    inputs: Inputs | None = None,
    *,
    layers: int | Sequence[int] | None = None,
    options: RunOptions = RunOptions(),
    **deprecated: Any,
) -> VarianceResult:
    """Measure value-aggregation variance per layer × head × position, with its predictions.

    Args:
        inputs: prompts, token ids or :class:`~sinklens.inputs.TokenBatch` es (default: the built-in
            prompt set), see :func:`~sinklens.inputs.as_batches`. The variances are across
            sequences, so use many (e.g. :func:`~sinklens.inputs.random_token_batches` for the
            theory's setting, or a few hundred natural prompts).
        layers: which layers (default all).
        options: batching, BOS, truncation, extra hooks (e.g. an intervention) and progress bar.

    Examples:
        >>> from sinklens.testing import tiny_model
        >>> from sinklens.inputs import random_token_batches
        >>> model = tiny_model()
        >>> batches = random_token_batches(model, n_sequences=8, seq_len=6)
        >>> result = measure_variance(model, batches, options=RunOptions(progress=False))
        >>> result.z_var.shape, result.discrepancy(0).shape
        (torch.Size([2, 4, 6]), torch.Size([2, 4]))
    """
    options = options_from_legacy(options, deprecated, "measure_variance")
    (result,) = run(model, inputs, VarianceReducer(model, layers=layers), options=options)
    return result
