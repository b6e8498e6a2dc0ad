"""Value-aggregation variance: with values independent across positions (variance ``σ_v²``), a head's output
``z_t = Σ_j A_tj v_j`` has ``E|z_t − μ|² / d_head = σ_v² · E[Σ_j A_tj²]``, ``σ_v² / (t + 1)`` under uniform
attention, so the first token keeps the full variance of one value (:class:`VarianceResult`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.analysis._common import layer_head_position_rows, run_analyzer
from sinklens.analysis.post_attention import attention_output_grams, post_attention_scale_hooks
from sinklens.analysis.qk_attention import attention_parts, qk_hooks
from sinklens.display import CompactRepr
from sinklens.errors import InvalidArgumentError
from sinklens.export import to_json
from sinklens.hooks import PATTERN, V, Z, expand_kv_heads, head_output_site, model_dims
from sinklens.inputs import Inputs, TokenBatch
from sinklens.options import AttentionMethod, RunOptions
from sinklens.residual_sites import attention_write_hooks
from sinklens.streaming import BatchFold, Reducer, bound_hooks, grow, per_layer_hooks
from sinklens.validate import choice, index

Site = Literal["z", "z_seq", "result", "result_pre_norm", "attn_out", "feature_std", "feature_std_head"]

#: Where each number of :class:`VarianceResult` comes from (written into ``to_dict`` and summary rows).
SOURCES = {
    "z_var": "sinklens: variance across (sequence, position) around the overall mean, per position",
    "z_var_seq": "sinklens: variance across sequences around the per-position mean",
    "result_var": "sinklens: z_var's definition applied to the head's write in residual units (the head output that "
                  "enters W_O, through any post-attention norm)",
    "feature_std": "Li et al. (Siquan-Li/Head-wise-RMSNorm@23793e0 attention_sink.ipynb cell 2): mean over sequences of "
                   "torch.std over the features of the o_proj input (all heads concatenated) at each position",
    "feature_std_head": "sinklens variant of Li et al.'s feature_std: the same estimator over one head's d_head features",
}


def _global_centred(s1: Float[Tensor, "*lead pos dim"], s2: Float[Tensor, "*lead pos"], n: Float[Tensor, " pos"],
                    n_coords: int, gram: Float[Tensor, "*lead dim dim"] | None = None) -> Float[Tensor, "*lead pos"]:
    """``mean_c mean_b (x − m)²`` per position from ``Σ_b x`` (``s1``), ``Σ_b |x|²`` (``s2``) and counts, ``m``
    the mean of ``x`` over all positions; with ``gram = W Wᵀ``, of ``x W`` (``s2`` then ``Σ_b |x W|²``)."""
    mean = s1.sum(dim=-2) / n.sum()  # [*lead, dim]
    proj = mean if gram is None else torch.einsum("...d,...de->...e", mean, gram)
    cross, sq = torch.einsum("...e,...pe->...p", proj, s1), (proj * mean).sum(-1)
    total = s2 - 2 * cross + n * sq[..., None]
    return (total / (n * n_coords)).clamp(min=0)


@dataclass(repr=False, eq=False)
class VarianceResult(CompactRepr):
    """Variance of head outputs by position, with its predictions (``Σx²/n − (Σx/n)²`` in float64, clamped at 0).

    Attributes:
        z_var: ``mean_c mean_{b valid at t} (z[b, t, h, c] − m[l, h, c])²``, ``z`` = ``hook_z``, ``m`` its mean over
            all valid (sequence, position) pairs (which makes the law exact); z_var_seq: around the per-position mean.
        result_var: the same for the head's write ``z_h W_O[l, h]`` (``z_h`` at ``output_site``) where it reaches the
            stream, through any post-attention norm; result_var_pre_norm: before it; attn_out_var: whole attention.
        value_var: ``σ_v²`` per (layer, head) from ``hook_v`` (kv head ``h // r``); attn_sq: mean_b ``Σ_j A_tj²``.
        counts: sequences valid at each position (positions with none are NaN elsewhere).
        feature_std: Li et al.'s measure as their code computes it (:data:`SOURCES`); feature_std_head (ours): per head.
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
    result_var_pre_norm: Float[Tensor, "layer head pos"]
    feature_std: Float[Tensor, "layer pos"]
    feature_std_head: Float[Tensor, "layer head pos"]
    post_norm_layers: list[int]
    output_site: str = Z

    @property
    def pred_pattern(self) -> Float[Tensor, "layer head pos"]:
        """Prediction from the measured pattern: ``σ_v² · mean_b Σ_j A_tj²``."""
        return self.value_var[:, :, None] * self.attn_sq

    @property
    def pred_uniform(self) -> Float[Tensor, "layer head pos"]:
        """Uniform-attention law ``σ_v² / (t + 1)``."""
        t = torch.arange(self.z_var.shape[-1], dtype=self.z_var.dtype, device=self.z_var.device)
        return self.value_var[:, :, None] / (t + 1)

    def variance(self, of: Site = "z") -> Tensor:
        """The measured per-position spread at one site (``of``: the field name without ``_var``)."""
        sites = {"z": self.z_var, "z_seq": self.z_var_seq, "result": self.result_var,
                 "result_pre_norm": self.result_var_pre_norm, "attn_out": self.attn_out_var,
                 "feature_std": self.feature_std, "feature_std_head": self.feature_std_head}
        return sites[choice(of, sorted(sites), what="of")]

    def discrepancy(self, position: int = 0, *, of: Site = "z") -> Tensor:
        """:meth:`ratio_of` one site's :meth:`variance` (``[layer]`` for ``"attn_out"``, ``"feature_std"``);
        uniform attention over ``T`` positions already gives about ``T / ln T`` at 0 (:attr:`pred_uniform`)."""
        return self.ratio_of(self.variance(of), position)

    def rows(self) -> list[dict[str, Any]]:
        """Long format, one row per (layer, head, position) with every measured and predicted number."""
        columns = {"count": ("pos", self.counts), "value_var": ("layer head", self.value_var),
                   "attn_out_var": ("layer pos", self.attn_out_var), "feature_std": ("layer pos", self.feature_std)}
        columns |= {name: ("layer head pos", getattr(self, name)) for name in (
            "z_var", "z_var_seq", "result_var", "pred_pattern", "pred_uniform", "attn_sq", "result_var_pre_norm",
            "feature_std_head")}
        return layer_head_position_rows(self.layers, *self.z_var.shape[1:], columns)

    def summary_rows(self, position: int = 0) -> list[dict[str, Any]]:
        """One row per (layer, head): every discrepancy ratio at ``position``, ``value_var`` and their ``sources``;
        ``preservation`` = result / z ratio (1: ``W_O`` and any post-norm keep the position's excess variance)."""
        ratio = partial(self.discrepancy, position)
        z, res = ratio(of="z"), ratio(of="result")
        cols = {"discrepancy_z": z, "discrepancy_pred_pattern": self.ratio_of(self.pred_pattern, position),
                "discrepancy_pred_uniform": self.ratio_of(self.pred_uniform, position), "discrepancy_result": res,
                "preservation": res / z, "discrepancy_attn_out": ratio(of="attn_out"), "value_var": self.value_var,
                "feature_std_ratio_head": ratio(of="feature_std_head"), "feature_std_ratio": ratio(of="feature_std")}
        sources = {"discrepancy_z": SOURCES["z_var"], "discrepancy_result": SOURCES["result_var"],
                   "feature_std_ratio": SOURCES["feature_std"], "feature_std_ratio_head": SOURCES["feature_std_head"]}
        return [{"layer": layer, "head": h, "position": position}  # [layer] columns: the same for every head
                | {k: float(v[i, h] if v.dim() == 2 else v[i]) for k, v in cols.items()} | {"sources": sources}
                for i, layer in enumerate(self.layers) for h in range(self.z_var.shape[1])]

    def ratio_of(self, var: Float[Tensor, "*lead pos"], position: int = 0) -> Float[Tensor, "*lead"]:
        """``var`` at ``position`` over its mean over the valid positions ``t >= 1``, ``t != position``,
        weighted by how many sequences reach each (the discrepancy ratio of any per-position variance)."""
        idx = index(position, self.counts.shape[0], what="position")
        if self.counts[idx] <= 0:
            raise InvalidArgumentError(f"position {position} is out of range: no sequence reached it.")
        rest = [t for t in range(1, self.counts.shape[0]) if t != idx and self.counts[t] > 0]
        if not rest:
            raise InvalidArgumentError("Need at least one valid position >= 1 besides the chosen one to compare with.")
        w = self.counts[rest]
        return var[..., idx] / ((var[..., rest] * w).sum(-1) / w.sum())

    def to_dict(self, position: int = 0) -> dict[str, Any]:
        """JSON-ready: settings, per-(layer, head) discrepancies at ``position``, head-mean curves."""
        ratio = partial(self.discrepancy, position)
        z = ratio(of="z")
        return to_json({
            "sources": {k: SOURCES[k] for k in ("z_var", "z_var_seq", "result_var")},
            "post_norm_layers": list(self.post_norm_layers), "output_site": self.output_site,
            "discrepancy_result_pre_norm": ratio(of="result_pre_norm"),
            "li_feature_std": {
                "source": SOURCES["feature_std"], "source_head": SOURCES["feature_std_head"],
                "feature_std": self.feature_std, "feature_std_head_mean": self.feature_std_head.mean(dim=1),
                "ratio": ratio(of="feature_std"), "ratio_head": ratio(of="feature_std_head"),
            },
            "layers": list(self.layers), "n_sequences": self.n_sequences, "prepend_bos": self.prepend_bos,
            "position": position, "counts": self.counts, "value_var": self.value_var, "discrepancy_z": z,
            "discrepancy_result": ratio(of="result"), "discrepancy_attn_out": ratio(of="attn_out"),
            "discrepancy_pred_pattern": self.ratio_of(self.pred_pattern, position),
            "discrepancy_pred_uniform": self.ratio_of(self.pred_uniform, position),
            "share_layers_discrepancy_gt_1": float((z.mean(dim=1) > 1).float().mean()),
            "z_var_head_mean": self.z_var.mean(dim=1), "pred_pattern_head_mean": self.pred_pattern.mean(dim=1),
            "pred_uniform_head_mean": self.pred_uniform.mean(dim=1), "attn_out_var": self.attn_out_var,
        }, digits=None)


class VarianceReducer(Reducer[VarianceResult]):
    """Streams ``hook_v``, the attention, ``hook_z`` and the output site, the attention write and any
    ``hook_scale`` into float64 sums per layer: ``Σ |z W_O|² = Σ z G zᵀ`` (``G = W_O W_Oᵀ``); on a post-norm
    layer ``z`` waits for its scale ``s`` (``Σ z/s``, ``Σ |(z/s) M|²``)."""

    statistics = ("z_s1", "z_s2", "out_s1", "r_s2", "zs_s1", "rs_s2", "fs_head", "fs_all", "a_sq", "o_s1", "o_s2", "n",
                  "v_s1", "v_s2", "v_n", "n_seq", "prepend_bos")

    def __init__(self, model: Any, *, layers: int | Sequence[int] | None = None, method: AttentionMethod = "auto"):
        self.model, self.dims = model, model_dims(model)
        self.layers, self.row, self.plan, self.visibility, self.device = attention_parts(model, layers, method)
        self.scale_hooks = post_attention_scale_hooks(model, self.layers)
        self.post_norm = list(self.scale_hooks)
        self.output_site = head_output_site(model)
        # Gram matrices of W_O and of the residual-unit output map M = C(W_O) diag(g) (W_O without a post-norm).
        self.gram, self.gram_res = (g.to(self.device) for g in attention_output_grams(model, self.layers))
        self.gram32, self.gram_res32 = self.gram.float(), self.gram_res.float()
        self.reset()

    def reset(self) -> None:
        d, n_l = self.dims, len(self.layers)
        zeros = partial(torch.zeros, device=self.device, dtype=torch.float64)
        # [layer, head, pos, d_head]: Σ z, Σ of the head output site, Σ z/s (post-norm layers)
        self.z_s1, self.out_s1, self.zs_s1 = (zeros(n_l, d.n_heads, 0, d.d_head) for _ in range(3))
        # [layer, head, pos]: Σ |z|², Σ |z W_O|², Σ |(z/s) M|², Σ_b Σ_j A_tj², Σ_b std over a head's features
        self.z_s2, self.r_s2, self.rs_s2, self.a_sq, self.fs_head = (zeros(n_l, d.n_heads, 0) for _ in range(5))
        # [layer, pos, d_model] / [layer, pos]: Σ attn_out, Σ |attn_out|², Σ_b std over the whole o_proj input
        self.o_s1, self.o_s2, self.fs_all = zeros(n_l, 0, d.d_model), zeros(n_l, 0), zeros(n_l, 0)
        self.n = zeros(0)
        self.v_s1, self.v_s2 = zeros(n_l, d.n_heads, d.d_head), zeros(n_l, d.n_heads)
        self.v_n, self.n_seq, self.prepend_bos = 0.0, 0, True

    def _reserve(self, n: int) -> None:
        """Grow every per-position sum to ``n`` positions (zeros for new positions)."""
        heads = ("z_s1", "out_s1", "zs_s1", "z_s2", "r_s2", "rs_s2", "a_sq", "fs_head")
        for axis, names in ((2, heads), (1, ("o_s1", "o_s2", "fs_all")), (0, ("n",))):
            for name in names:
                setattr(self, name, grow(getattr(self, name), axis, n))

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        self._reserve(batch.tokens.shape[1])
        w = batch.valid.to(self.device, torch.float64)  # [batch, pos]
        w32 = w.float()
        waiting: dict[int, Tensor] = {}  # post-norm layers: hook_z until the post-attention norm's hook_scale fires

        def fold_v(v: Tensor, layer: int) -> None:  # [batch, pos, kv_head, d_head]
            row = self.row[layer]
            v = expand_kv_heads(v.float()[..., None], self.dims.n_heads)[..., 0]  # HF repeat_kv order
            self.v_s1[row] += (v * w32[..., None, None]).sum(dim=(0, 1)).double()
            self.v_s2[row] += (v.square().sum(-1) * w32[..., None]).sum(dim=(0, 1)).double()

        def fold_squares(sq: Tensor, layer: int) -> None:  # Σ_k A_qk², [batch, head, query]
            self.a_sq[self.row[layer], :, : sq.shape[2]] += (sq * w32[:, None]).sum(0).double()

        def fold_z(z: Tensor, layer: int) -> None:  # [batch, pos, head, d_head]: the aggregation
            row, z, n = self.row[layer], z.float(), z.shape[1]
            self.z_s1[row, :, :n] += (z * w32[..., None, None]).sum(0).transpose(0, 1).double()
            self.z_s2[row, :, :n] += (z.square().sum(-1) * w32[..., None]).sum(0).T.double()

        def fold_out(z: Tensor, layer: int) -> None:  # [batch, pos, head, d_head]: what W_O reads (output_site)
            row, z, n = self.row[layer], z.float(), z.shape[1]
            self.out_s1[row, :, :n] += (z * w32[..., None, None]).sum(0).transpose(0, 1).double()
            zg = torch.einsum("bphd,hde->bphe", z, self.gram32[row])  # |z W_O|² = z G zᵀ
            self.r_s2[row, :, :n] += ((zg * z).sum(-1) * w32[..., None]).sum(0).T.double()
            # Li et al.'s torch.std in two passes, so a large common mean cannot cancel the spread: a token's sum of
            # squares about its mean = the heads' own + d_head × (head mean − token mean)².
            d, head_mean = z.shape[-1], z.mean(-1)  # [b, t, head]
            within = (z - head_mean[..., None]).square().sum(-1)  # [b, t, head]
            between = (head_mean - head_mean.mean(-1, keepdim=True)).square().sum(-1) * d  # [b, t]
            self.fs_head[row, :, :n] += ((within / (d - 1)).sqrt().double() * w[..., None]).sum(0).T
            self.fs_all[row, :n] += (((within.sum(-1) + between) / (d * z.shape[-2] - 1)).sqrt().double() * w).sum(0)
            if layer in self.post_norm:
                waiting[layer] = z.clone()

        def fold_scale(scale: Tensor, layer: int) -> None:  # [batch, pos, 1]: RMS of the attention output
            row, z = self.row[layer], waiting.pop(layer)
            n = z.shape[1]
            u = w32 / scale.to(self.device, torch.float32).reshape(z.shape[:2])  # valid weight / s[b, t]
            zs = z * u[..., None, None]
            self.zs_s1[row, :, :n] += zs.sum(0).transpose(0, 1).double()
            zg = torch.einsum("bphd,hde->bphe", z, self.gram_res32[row])  # |z W_O ⊙ g|²
            self.rs_s2[row, :, :n] += ((zg * z).sum(-1) * (u * u)[..., None]).sum(0).T.double()

        def fold_attn_out(out: Tensor, layer: int) -> None:  # [batch, pos, d_model]
            row, out, n = self.row[layer], out.float(), out.shape[1]
            self.o_s1[row, :n] += (out * w32[..., None]).sum(0).double()
            self.o_s2[row, :n] += (out.square().sum(-1) * w32).sum(0).double()

        qk = self.plan.reads_qk(batch.tokens.shape[1])
        fold_pattern = lambda pattern, layer: fold_squares(pattern.float().square().sum(dim=-1), layer)  # noqa: E731
        sites = [(V, fold_v), (Z, fold_z), (self.output_site, fold_out)] + ([] if qk else [(PATTERN, fold_pattern)])
        hooks = [hook for site, fold in sites for hook in per_layer_hooks(site, self.layers, fold)]
        if qk:  # Σ_k A_qk² from queries and keys
            hooks += qk_hooks(self.plan.sites, self.plan.rules, self.visibility, batch.valid,
                              lambda cols, layer: fold_squares(cols.squares, layer), squares=True)
        hooks += attention_write_hooks(self.model, self.layers, lambda layer, out: fold_attn_out(out, layer))
        hooks += bound_hooks(list(self.scale_hooks.values()), self.post_norm, fold_scale)
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
        p = int(torch.nonzero(self.n > 0).max()) + 1
        n = self.n[:p]
        d_head, d_model = self.dims.d_head, self.dims.d_model
        z_s1, z_s2 = self.z_s1[:, :, :p], self.z_s2[:, :, :p]
        z_var = _global_centred(z_s1, z_s2, n, d_head)
        z_var_seq = ((z_s2 - z_s1.square().sum(-1) / n) / (n * d_head)).clamp(min=0)
        result_pre = _global_centred(self.out_s1[:, :, :p], self.r_s2[:, :, :p], n, d_model, gram=self.gram)
        result_var = result_pre.clone()
        for layer in self.post_norm:
            row = self.row[layer]
            result_var[row] = _global_centred(self.zs_s1[row, :, :p], self.rs_s2[row, :, :p], n, d_model,
                                              gram=self.gram_res[row])
        out_var = _global_centred(self.o_s1[:, :p], self.o_s2[:, :p], n, d_model)
        v_mean = self.v_s1 / self.v_n
        value_var = ((self.v_s2 / self.v_n - v_mean.square().sum(-1)) / d_head).clamp(min=0)
        tensors = dict(z_var=z_var, z_var_seq=z_var_seq, result_var=result_var, attn_out_var=out_var,
                       value_var=value_var, attn_sq=self.a_sq[:, :, :p] / n, counts=n, result_var_pre_norm=result_pre,
                       feature_std=self.fs_all[:, :p] / n, feature_std_head=self.fs_head[:, :, :p] / n)
        return VarianceResult(**{name: t.float().cpu() for name, t in tensors.items()}, layers=list(self.layers),
                              n_sequences=self.n_seq, prepend_bos=self.prepend_bos,
                              post_norm_layers=list(self.post_norm), output_site=self.output_site)


def measure_variance(model: Any, inputs: Inputs | None = None, *, layers: int | Sequence[int] | None = None,
                     method: AttentionMethod = "auto", options: RunOptions = RunOptions()) -> VarianceResult:
    """Measure value-aggregation variance per layer × head × position across sequences, so stream many
    (:class:`VarianceResult`); ``method``: where ``attn_sq`` is read, as ``SinkSettings.method``.

    Examples:
        >>> from sinklens.testing import tiny_model
        >>> result = measure_variance(tiny_model(), ["t5 t6 t7 t8 t9", "t3 t4 t5 t6 t7"],
        ...                           options=RunOptions(progress=False))
        >>> result.z_var.shape, result.discrepancy(0).shape
        (torch.Size([2, 4, 6]), torch.Size([2, 4]))
    """
    return run_analyzer(model, inputs, VarianceReducer, where="measure_variance", options=options,
                        layers=layers, method=method)
