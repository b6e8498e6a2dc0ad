"""Value-aggregation variance: why the first token's head output stands out.

A head's output at position ``t`` is ``z_t = Σ_{j<=t} A_tj v_j``. If the values ``v_j`` are
independent across positions with a common mean ``μ`` and per-coordinate variance ``σ_v²`` (and
independent of ``A``), then ``E z_t = μ`` and ``E|z_t − μ|² / d_head = σ_v² · E[Σ_j A_tj²]``, which
is ``σ_v² / (t + 1)`` under uniform attention: the first token keeps the full variance of one value,
later tokens average it away. :class:`VarianceReducer` measures both sides in one streaming pass.

**Definition** (``z_var``, used throughout). For layer ``l``, head ``h`` and position ``t``::

    z_var[l, h, t] = mean_c  mean_{sequences b valid at t}  (z[b, t, h, c] − m[l, h, c])²

where ``z`` is ``blocks.{l}.attn.hook_z`` and ``m[l, h, c]`` is the mean of ``z[..., h, c]`` over
*all* valid (sequence, position) pairs. One mean for all positions makes the law above exact and
counts a position whose output sits far from the others (a constant BOS output has zero variance
across sequences but a large deviation here). ``z_var_seq`` centres on the per-position mean
instead. Both use ``1/n``.

The same definition is applied to

* ``result_var``: the head's write where it reaches the residual stream, averaged over ``d_model``:
  ``z_h · W_O[l, h]``, through any post-attention norm as ``(z_h · W_O[l, h]) ⊙ g / s[b, t]`` (Gemma's
  ``ln1_post``; ``s`` from its ``hook_scale``, ``g`` its effective gain, :func:`~sinklens.analysis.post_attention.post_attention_gain`),
  or on a post-LN model (BERT, ``ln1``) ``C(z_h · W_O[l, h]) ⊙ g / s`` with ``C`` the mean removal. The
  per-head terms plus the bias sum to the norm's output (tested). ``result_var_pre_norm`` keeps
  ``z_h · W_O[l, h]``. ``z_h`` is what enters ``W_O`` (:func:`~sinklens.hooks.head_output_site`:
  ``hook_z``, or a SinkLM variant's ``hook_z_normed`` / ``hook_z_gated`` / ``hook_z_calibrated``);
* ``attn_out_var``: the attention's whole write (all heads plus bias) where it reaches the stream
  (:func:`~sinklens.residual_sites.attention_write_hooks`).

**The paper's measure** (``feature_std``, ``feature_std_head``): Li et al.'s per-position spread over
the feature dimension of the output projection's input, as their code computes it
(Siquan-Li/Head-wise-RMSNorm@23793e0, ``attention_sink.ipynb`` cell 2, Sec. 3.1 / Fig. 4: a pre-hook
on ``self_attn.o_proj`` takes ``hidden_states.std(dim=-1)`` per token, then the mean over samples)::

    feature_std[l, t]         = mean_{sequences b valid at t}  std_c  z[b, t, :, :].flatten()[c]
    feature_std_head[l, h, t] = mean_{sequences b valid at t}  std_c  z[b, t, h, c]

``std`` is ``torch.std``'s default (Bessel-corrected, centred on the token's own feature mean); the
``o_proj`` input is ``hook_z`` flattened head-major (tested against a pre-hook on Hugging Face's
``o_proj``). It is a mean of standard deviations over sequences, not a variance across sequences.
The per-head version is ours (the same estimator over one head's ``d_head`` coordinates). Under
uniform attention over i.i.d. Gaussian values, ``E feature_std_head[t] = c₄(d_head) σ / sqrt(t + 1)``
(tested).

Predictions, beside the measurement:

* ``value_var[l, h] = σ_v²``: variance of ``blocks.{l}.attn.hook_v`` over all valid (sequence,
  position) pairs around its overall mean, averaged over ``d_head`` (key/value head ``h // r`` for
  query head ``h`` under grouped-query attention, ``r = n_heads / n_kv_heads``, as ``repeat_kv``);
* ``pred_pattern = σ_v² · attn_sq`` with ``attn_sq[l, h, t]`` = mean over sequences of
  ``Σ_j pattern[l, h, t, j]²`` (the actual attention pattern);
* ``pred_uniform = σ_v² / (t + 1)``.

Each batch is reduced in float32 and folded into float64 running sums on the model's device. The
variances come from those sums (``Σx²/n − (Σx/n)²``), so a true variance of ≈ 0 can leave a float32
residue of about ``1e-6 · mean(x²)``; negative residues are reported as 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.analysis._common import layer_head_position_rows, position_index, run_analyzer
from sinklens.analysis.post_attention import attention_output_grams, post_attention_scale_hooks
from sinklens.display import CompactRepr
from sinklens.errors import InvalidArgumentError
from sinklens.export import to_json
from sinklens.hooks import PATTERN, V, Z, head_output_site, model_device, model_dims, resolve_layers
from sinklens.inputs import Inputs, TokenBatch
from sinklens.options import RunOptions
from sinklens.residual_sites import attention_write_hooks
from sinklens.streaming import BatchFold, Reducer, bound_hooks, grow, per_layer_hooks
from sinklens.validate import choice

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
    return (total / (n * n_coords)).clamp(min=0)


@dataclass(repr=False, eq=False)
class VarianceResult(CompactRepr):
    """Variance of head outputs by position, with the pattern-based and uniform-attention predictions.

    See the module docstring for the exact definitions. Positions with no valid token are NaN.

    Attributes:
        z_var: ``hook_z`` variance around the overall per-(layer, head, coordinate) mean.
        z_var_seq: ``hook_z`` variance across sequences around the per-position mean.
        result_var: variance of the head's write in residual units (``z_h · W_O[l, h]``, through the
            post-attention norm where there is one; same centring as ``z_var``), over ``d_model``;
            ``z_h`` is read at ``output_site``.
        attn_out_var: variance of the attention's write where it reaches the stream (same centring), over
            ``d_model``: ``hook_attn_out`` except on post-LN models (module docstring).
        value_var: ``σ_v²`` per (layer, head), from ``hook_v`` over all valid positions.
        attn_sq: mean over sequences of ``Σ_j A_tj²`` (1/(t+1) under uniform attention).
        counts: sequences valid at each position.
        layers: the model layer of each row.
        n_sequences: sequences streamed.
        prepend_bos: whether position 0 was a prepended BOS token.
        result_var_pre_norm: variance of ``z_h · W_O[l, h]`` before any post-attention norm (equal to
            ``result_var`` on pre-norm models).
        feature_std: Li et al.'s per-position feature std of the concatenated ``o_proj`` input (module docstring).
        feature_std_head: the same per head.
        post_norm_layers: the analysed layers whose heads pass through a post-attention norm.
        output_site: the attention hook site of the head outputs that enter ``W_O``
            (:func:`~sinklens.hooks.head_output_site`): where ``result_var``, ``result_var_pre_norm`` and
            ``feature_std`` read ``z_h``.
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
    result_var_pre_norm: Float[Tensor, "layer head pos"] | None = None
    feature_std: Float[Tensor, "layer pos"] | None = None
    feature_std_head: Float[Tensor, "layer head pos"] | None = None
    post_norm_layers: list[int] | None = None
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

    def position_index(self, position: int) -> int:
        """Index of a measured position (negatives count from the end); a named error if out of range
        or if no sequence reached it."""
        idx = position_index(position, self.counts.shape[0])
        if self.counts[idx] <= 0:
            raise InvalidArgumentError(f"position {position} is out of range: no sequence reached it.")
        return idx

    def variance(self, of: Site = "z") -> Tensor:
        """The measured per-position spread of one site: ``z_var``, ``z_var_seq``, ``result_var``,
        ``result_var_pre_norm``, ``attn_out_var``, or Li et al.'s ``feature_std`` / ``feature_std_head``."""
        sites = {"z": self.z_var, "z_seq": self.z_var_seq, "result": self.result_var,
                 "result_pre_norm": self.result_var_pre_norm, "attn_out": self.attn_out_var,
                 "feature_std": self.feature_std, "feature_std_head": self.feature_std_head}
        got = sites[choice(of, sorted(sites), what="of")]
        if got is None:
            raise InvalidArgumentError(f"of={of!r} was not measured in this result (made by an older sinklens).")
        return got

    def rest_positions(self, position: int = 0) -> list[int]:
        """The positions the discrepancy compares against: valid ``t >= 1`` with ``t != position``."""
        idx = self.position_index(position)
        return [t for t in range(1, self.counts.shape[0]) if t != idx and self.counts[t] > 0]

    def discrepancy(self, position: int = 0, *, of: Site = "z") -> Tensor:
        """Variance-discrepancy ratio: variance at ``position`` over the mean variance of the rest.

        The rest (:meth:`rest_positions`) are the valid positions ``t >= 1`` other than
        ``position``, weighted by how many sequences reach them (each valid token counts once).
        Shape ``[layer, head]`` for ``of`` in ``"z"``, ``"z_seq"``, ``"result"``, ``"result_pre_norm"``,
        ``"feature_std_head"``; ``[layer]`` for ``"attn_out"`` and ``"feature_std"`` (a ratio of standard
        deviations for the two ``feature_std`` sites, of variances otherwise). Under uniform attention over ``T`` positions the ratio for position 0 is
        about ``T / ln T`` already, so compare it with the same ratio of :attr:`pred_uniform`.
        """
        return self.ratio_of(self.variance(of), position)

    def preservation(self, position: int = 0) -> Float[Tensor, "layer head"]:
        """How much of the discrepancy reaches the residual stream: ``discrepancy(of="result") /
        discrepancy(of="z")`` per (layer, head), with ``result`` in residual units (through the
        post-attention norm where there is one). 1 = the output projection keeps the first token's
        excess variance (relative to the rest), < 1 = it shrinks it, > 1 = it amplifies it."""
        return self.discrepancy(position, of="result") / self.discrepancy(position, of="z")

    def rows(self) -> list[dict[str, Any]]:
        """Long format, one row per (layer, head, position) with every measured and predicted number."""
        lhp = "layer head pos"
        return layer_head_position_rows(self.layers, *self.z_var.shape[1:], {
            "count": ("pos", self.counts),
            "value_var": ("layer head", self.value_var),
            "attn_out_var": ("layer pos", self.attn_out_var),
            "feature_std": ("layer pos", self.feature_std),
            "z_var": (lhp, self.z_var),
            "z_var_seq": (lhp, self.z_var_seq),
            "result_var": (lhp, self.result_var),
            "pred_pattern": (lhp, self.pred_pattern),
            "pred_uniform": (lhp, self.pred_uniform),
            "attn_sq": (lhp, self.attn_sq),
            "result_var_pre_norm": (lhp, self.result_var_pre_norm),
            "feature_std_head": (lhp, self.feature_std_head),
        })

    def summary_rows(self, position: int = 0) -> list[dict[str, Any]]:
        """One row per (layer, head): discrepancy ratios at ``position`` of z, of the measured and
        uniform predictions, of the head's write in residual units, the preservation ratio, the layer's
        ``attn_out`` ratio, and Li et al.'s feature-std ratios (per head and of the concatenated
        ``o_proj`` input); ``sources`` names where each definition comes from."""
        z = self.discrepancy(position, of="z")
        li = self.feature_std_head is not None and self.feature_std is not None
        std_head = self.discrepancy(position, of="feature_std_head") if li else None
        std_all = self.discrepancy(position, of="feature_std") if li else None
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
                **({"feature_std_ratio_head": float(std_head[i, h]), "feature_std_ratio": float(std_all[i]),
                    "sources": {"discrepancy_z": SOURCES["z_var"], "discrepancy_result": SOURCES["result_var"],
                                "feature_std_ratio": SOURCES["feature_std"],
                                "feature_std_ratio_head": SOURCES["feature_std_head"]}}
                   if li else {}),
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
        li: dict[str, Any] = {}
        if self.feature_std is not None and self.feature_std_head is not None:
            li = {"li_feature_std": {
                "source": SOURCES["feature_std"],
                "source_head": SOURCES["feature_std_head"],
                "feature_std": self.feature_std.tolist(),
                "feature_std_head_mean": self.feature_std_head.mean(dim=1).tolist(),
                "ratio": self.discrepancy(position, of="feature_std").tolist(),
                "ratio_head": self.discrepancy(position, of="feature_std_head").tolist(),
            }}
        return to_json({
            "sources": {k: SOURCES[k] for k in ("z_var", "z_var_seq", "result_var")},
            "post_norm_layers": list(self.post_norm_layers or []),
            "output_site": self.output_site,
            **({"discrepancy_result_pre_norm": self.discrepancy(position, of="result_pre_norm").tolist()}
               if self.result_var_pre_norm is not None else {}),
            **li,
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

class VarianceReducer(Reducer[VarianceResult]):
    """Streams ``hook_v``, ``hook_pattern``, ``hook_z`` (and the head output site where a model has its own,
    :func:`~sinklens.hooks.head_output_site`), the attention write
    (:func:`~sinklens.residual_sites.attention_write_hooks`) and the post-attention norm's ``hook_scale`` on
    post-norm layers into a :class:`VarianceResult`.

    Per layer it keeps (float64, positions grown to the longest batch seen): ``Σ z`` per
    (head, position, coordinate), ``Σ |z|²`` and ``Σ |z W_O|²`` per (head, position), ``Σ attn_out``
    per (position, coordinate) and ``Σ |attn_out|²`` per position, ``Σ_b Σ_j A_tj²`` per (head,
    position), ``Σ v``, ``Σ |v|²`` per (kv head, coordinate) pooled over positions, and Li et al.'s
    ``Σ_b std`` per (head, position) and per position. ``Σ z W_O`` is not stored: it is ``(Σ z) W_O``,
    applied at :meth:`result` time. On a post-norm layer ``z`` waits in the batch's fold state until
    the post-attention norm's ``hook_scale`` fires (``ln1_post``; post-LN: ``ln1``), and ``Σ z/s``,
    ``Σ |(z/s) W_O ⊙ g|²`` are kept as well.
    """

    statistics = ("z_s1", "z_s2", "out_s1", "r_s2", "zs_s1", "rs_s2", "fs_head", "fs_all", "a_sq", "o_s1", "o_s2", "n",
                  "v_s1", "v_s2", "v_n", "n_seq", "prepend_bos")

    def __init__(self, model: Any, *, layers: int | Sequence[int] | None = None):
        dims = model_dims(model)
        self.model = model
        self.dims = dims
        self.layers = resolve_layers(layers, dims.n_layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.device = model_device(model)
        self.scale_hooks = post_attention_scale_hooks(model, self.layers)
        self.post_norm = list(self.scale_hooks)
        self.output_site = head_output_site(model)
        # Gram matrices of W_O and of the residual-unit output map M = C(W_O) diag(g) (W_O without a post-norm).
        self.gram, self.gram_res = (g.to(self.device) for g in attention_output_grams(model, self.layers))
        self.gram32 = self.gram.float()
        self.gram_res32 = self.gram_res.float()
        self.reset()

    def reset(self) -> None:
        dims, n_l = self.dims, len(self.layers)
        f64 = dict(device=self.device, dtype=torch.float64)
        self.z_s1 = torch.zeros(n_l, dims.n_heads, 0, dims.d_head, **f64)
        self.z_s2 = torch.zeros(n_l, dims.n_heads, 0, **f64)
        self.out_s1 = torch.zeros(n_l, dims.n_heads, 0, dims.d_head, **f64)  # Σ of the head output site (≠ hook_z)
        self.r_s2 = torch.zeros(n_l, dims.n_heads, 0, **f64)
        self.zs_s1 = torch.zeros(n_l, dims.n_heads, 0, dims.d_head, **f64)  # Σ z/s (post-norm layers)
        self.rs_s2 = torch.zeros(n_l, dims.n_heads, 0, **f64)  # Σ |(z/s) W_O ⊙ g|² (post-norm layers)
        self.a_sq = torch.zeros(n_l, dims.n_heads, 0, **f64)
        self.o_s1 = torch.zeros(n_l, 0, dims.d_model, **f64)
        self.o_s2 = torch.zeros(n_l, 0, **f64)
        self.fs_head = torch.zeros(n_l, dims.n_heads, 0, **f64)  # Σ_b std over a head's features
        self.fs_all = torch.zeros(n_l, 0, **f64)  # Σ_b std over the concatenated o_proj input
        self.n = torch.zeros(0, **f64)
        self.v_s1 = torch.zeros(n_l, dims.n_kv_heads, dims.d_head, **f64)  # [layer, kv_head, d_head]
        self.v_s2 = torch.zeros(n_l, dims.n_kv_heads, **f64)
        self.v_n = 0.0
        self.n_seq = 0
        self.prepend_bos = True

    def _reserve(self, n: int) -> None:
        """Grow every per-position sum to ``n`` positions (zeros for new positions)."""
        self.z_s1, self.zs_s1, self.out_s1 = grow(self.z_s1, 2, n), grow(self.zs_s1, 2, n), grow(self.out_s1, 2, n)
        self.z_s2, self.r_s2, self.rs_s2, self.a_sq, self.fs_head = (
            grow(t, 2, n) for t in (self.z_s2, self.r_s2, self.rs_s2, self.a_sq, self.fs_head))
        self.o_s1, self.o_s2, self.fs_all = grow(self.o_s1, 1, n), grow(self.o_s2, 1, n), grow(self.fs_all, 1, n)
        self.n = grow(self.n, 0, n)

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        self._reserve(batch.tokens.shape[1])
        w = batch.valid.to(self.device, torch.float64)  # [batch, pos]
        w32 = w.float()
        waiting: dict[int, Tensor] = {}  # post-norm layers: hook_z until the post-attention norm's hook_scale fires

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

        separate = self.output_site != Z  # a SinkLM variant: W_O reads its own site, not hook_z

        def fold_z(z: Tensor, layer: int) -> None:  # [batch, pos, head, d_head]: the aggregation
            row, z = self.row[layer], z.float()
            n = z.shape[1]
            sq = z.square().sum(-1)  # Σ_c z² per (b, t, head)
            self.z_s1[row, :, :n] += (z * w32[..., None, None]).sum(0).transpose(0, 1).double()
            self.z_s2[row, :, :n] += (sq * w32[..., None]).sum(0).T.double()
            if not separate:
                fold_out(z, layer, sq)

        def fold_out(z: Tensor, layer: int, sq: Tensor | None = None) -> None:  # [batch, pos, head, d_head]: enters W_O
            row, z = self.row[layer], z.float()
            n = z.shape[1]
            sq = z.square().sum(-1) if sq is None else sq  # Σ_c z² per (b, t, head)
            if separate:
                self.out_s1[row, :, :n] += (z * w32[..., None, None]).sum(0).transpose(0, 1).double()
            zg = torch.einsum("bphd,hde->bphe", z, self.gram32[row])  # |z W_O|² = z G zᵀ
            self.r_s2[row, :, :n] += ((zg * z).sum(-1) * w32[..., None]).sum(0).T.double()
            # Li et al.: torch.std (Bessel) over the features at each token, as their code calls it, averaged over
            # sequences. Two passes, as torch.std makes them (a large common mean must not cancel the spread): centre
            # each head on its mean, then the whole token's sum of squares about its overall mean is the heads' own
            # plus d_head × (head mean − token mean)², all terms >= 0.
            d, big = z.shape[-1], z.shape[-1] * z.shape[-2]
            head_mean = z.mean(-1, keepdim=True)  # [b, t, head, 1]
            within = (z - head_mean).square().sum(-1)  # [b, t, head]
            head_mean = head_mean.squeeze(-1)
            between = (head_mean - head_mean.mean(-1, keepdim=True)).square().sum(-1) * d  # [b, t]
            std_head = (within / (d - 1)).sqrt()
            std_all = ((within.sum(-1) + between) / (big - 1)).sqrt()
            self.fs_head[row, :, :n] += (std_head.double() * w[..., None]).sum(0).T
            self.fs_all[row, :n] += (std_all.double() * w).sum(0)
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
            row, out = self.row[layer], out.float()
            n = out.shape[1]
            self.o_s1[row, :n] += (out * w32[..., None]).sum(0).double()
            self.o_s2[row, :n] += (out.square().sum(-1) * w32).sum(0).double()

        sites = [(V, fold_v), (PATTERN, fold_pattern), (Z, fold_z)] + ([(self.output_site, fold_out)] if separate else [])
        hooks = [hook for site, fold in sites for hook in per_layer_hooks(site, self.layers, fold)]
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
        valid = torch.nonzero(self.n > 0)
        p = int(valid.max()) + 1
        n = self.n[:p]
        d_head, d_model = self.dims.d_head, self.dims.d_model
        z_s1, z_s2 = self.z_s1[:, :, :p], self.z_s2[:, :, :p]
        z_var = _global_centred(z_s1, z_s2, n, d_head)
        z_var_seq = ((z_s2 - z_s1.square().sum(-1) / n) / (n * d_head)).clamp(min=0)
        out_s1 = self.out_s1[:, :, :p] if self.output_site != Z else z_s1
        result_pre = _global_centred(out_s1, self.r_s2[:, :, :p], n, d_model, gram=self.gram)
        result_var = result_pre.clone()
        for layer in self.post_norm:
            row = self.row[layer]
            result_var[row] = _global_centred(self.zs_s1[row, :, :p], self.rs_s2[row, :, :p], n, d_model,
                                              gram=self.gram_res[row])
        out_var = _global_centred(self.o_s1[:, :p], self.o_s2[:, :p], n, d_model)
        v_mean = self.v_s1 / self.v_n
        value_var = ((self.v_s2 / self.v_n - v_mean.square().sum(-1)) / d_head).clamp(min=0)  # [layer, kv_head]
        n_heads = self.dims.n_heads
        if value_var.shape[1] != n_heads:  # kv head j serves query heads j*r .. (j+1)*r - 1 (HF repeat_kv)
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
            result_var_pre_norm=out(result_pre),
            feature_std=out(self.fs_all[:, :p] / n),
            feature_std_head=out(self.fs_head[:, :, :p] / n),
            post_norm_layers=list(self.post_norm),
            output_site=self.output_site,
        )


def measure_variance(
    model: Any,
    inputs: Inputs | None = None,
    *,
    layers: int | Sequence[int] | None = None,
    options: RunOptions = RunOptions(),
) -> VarianceResult:
    """Measure value-aggregation variance per layer × head × position, with its predictions.

    Args:
        inputs: anything :func:`sinklens.inputs.as_batches` accepts (None: the built-in prompts). The
            variances are across sequences, so use many (e.g. :func:`~sinklens.inputs.random_token_batches`).
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
    return run_analyzer(model, inputs, VarianceReducer, where="measure_variance", options=options,
                        layers=layers)
