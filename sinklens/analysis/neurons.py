"""Super neurons: FFN neurons that write the massive residual dimensions at the sink, in residual units.

Definitions (activations are ``blocks.{l}.mlp.hook_post``, i.e. what multiplies ``W_out``; ``s`` is the sink):

* ``sink_act[l, n]``: mean over sequences of the neuron's activation at the sink.
* ``contribution[l, n, j]``: mean over sequences of what the neuron adds to the **residual stream** in
  dimension ``dims[j]`` at the sink: ``act × W_out[l, n]``, through block ``l``'s post-MLP norm when there
  is one (Gemma 2/3 ``ln2_post``: ``(act / scale) × gain ⊙ W_out[l, n]``, ``scale`` from its ``hook_scale``,
  :mod:`sinklens.residual_units`). Summed over neurons plus ``mlp_offset_sink[l]`` it is exactly the mean
  ``hook_mlp_out`` at the sink.
* A neuron is a **super neuron** when its ``|contribution|`` to some analysed massive dimension reaches
  ``super_share`` (default 5%) of that dimension's peak ``|value|``; :meth:`SuperNeurons.super_neurons`
  ranks them by that contribution (largest ``|contribution|`` first).
* Activation-outlier statistics (``is_outlier``): ``other_rms`` (RMS of the activation over every other valid position), ``position_ratio = |sink_act| /
  other_rms``, ``neuron_ratio = |sink_act| / median_n' |sink_act[l, n']|``; ``is_outlier`` when both reach
  their thresholds (default 10 each). An outlier whose write a post norm shrinks is not a super neuron.
* ``W_out`` row sparsity: Pearson kurtosis of ``W_out[l, n, :]`` over ``d_model`` (3 for a Gaussian row,
  ``≈ d_model`` for a one-hot row) and the share of its squared norm in its ``row_top_k`` largest entries.

Massive dimensions (unless given as ``dims``): dimensions ``d`` whose mean residual value at the sink,
``|resid[s, d]|``, exceeds ``dim_threshold`` × the median over dimensions of ``|resid[s, :]|`` at some residual
stream index ``s`` (the residual is averaged over sequences at the sink position). For each, a
:class:`MassiveDimPath` lists every block that writes it (a step ``hook_attn_out + hook_mlp_out`` at the sink —
both already in residual units, after any post norm — towards the peak's sign of at least ``path_share`` of the
peak) and every block that erases it (a step back of at least that share), in block order, each with its
attention/MLP split and its top neurons (parallel blocks alike).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.analysis._common import TINY as _TINY
from sinklens.analysis._common import (
    check_sink_position,
    checked_options,
    other_positions,
    resolve_streams,
    run_analyzer,
    stream_hook,
)
from sinklens.analysis.neuron_result import BlockStep, MassiveDimPath, SuperNeurons, SuperNeuronSettings
from sinklens.errors import InvalidArgumentError
from sinklens.hooks import (
    ATTN_OUT, MLP_OUT, MLP_POST, eval_mode, head_output_site, layer_weight, model_device, model_dims, model_dtype,
    resolve_layers, weight, weight_cached,
)
from sinklens.inputs import Inputs, TokenBatch, is_encoder, right_align
from sinklens.options import RunOptions
from sinklens.residual_units import attn_out_bias, check_neuron_mlp, mlp_out_bias, post_norm_map
from sinklens.streaming import BatchFold, Reducer, batches_for, bound_hooks, forward, per_layer_hooks


def neuron_contributions(
    model: Any, layer: int, post: Float[Tensor, "*batch neuron"], *, scale: Tensor | None = None
) -> Float[Tensor, "*batch neuron d_model"]:
    """Each neuron's write into the residual stream, in residual units.

    ``post[..., n] × W_out[layer, n, :]``, taken through the post-MLP norm's affine map where there is one
    (:func:`sinklens.residual_units.post_norm_map`; ``scale``: its ``hook_scale`` at the same positions, then
    required). Summed over neurons and added to :func:`mlp_offset` it is exactly ``hook_mlp_out``.
    """
    W_out = weight(model, "W_out")[layer]
    writes = post[..., :, None] * W_out.to(post.dtype)
    pm = post_norm_map(model, layer, "mlp")
    if pm.is_identity:
        return writes
    if scale is None:
        raise InvalidArgumentError(_needs_scale(pm))
    if scale.shape[-1:] == (1,) and scale.dim() == post.dim():
        scale = scale[..., 0]
    return pm.linear(writes, scale[..., None, None])


def _needs_scale(pm: Any) -> str:
    return (f"Block {pm.layer}'s MLP output passes through the post norm {pm.norm}: pass scale= (the value of "
            f"{pm.scale_hook} at the same positions) to put contributions in residual units.")


def mlp_offset(model: Any, layer: int, scale: Tensor | None = None) -> Float[Tensor, "*batch d_model"]:
    """The part of ``hook_mlp_out`` no neuron wrote: ``b_out`` (through the post-MLP norm and plus its bias
    when there is one; ``scale`` as in :func:`neuron_contributions`)."""
    b = mlp_out_bias(model, layer)
    pm = post_norm_map(model, layer, "mlp")
    if pm.is_identity:
        return b
    if scale is None:
        raise InvalidArgumentError(_needs_scale(pm))
    if scale.shape[-1:] != (1,):
        scale = scale[..., None]
    return pm.linear(b.to(scale.dtype).expand(*scale.shape[:-1], b.shape[-1]), scale) + pm.offset(b.to(scale.dtype))


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


def mlp_weight_statistics(model: Any, layers: Sequence[int], row_top_k: int = 1) -> dict[str, Tensor | None]:
    """Weight-only statistics of each neuron of ``layers``, each ``[layer, neuron]`` float32 on the model's device.

    ``in_norm`` / ``gate_norm``: ``‖W_in[:, n]‖`` / ``‖W_gate[:, n]‖`` (``gate_norm`` None without a gated MLP);
    ``out_norm``: ``‖W_out[n]‖``; ``out_kurtosis`` / ``out_top_share``: :func:`row_sparsity` of ``W_out[n]``
    with ``row_top_k``. Kept until the weights change (:func:`~sinklens.hooks.weight_cached`).
    """

    def compute() -> dict[str, Tensor | None]:
        out: dict[str, list[Tensor]] = {name: [] for name in ("in_norm", "gate_norm", "out_norm", "out_kurtosis", "out_top_share")}
        gated = True
        for layer in layers:
            out["in_norm"].append(layer_weight(model, "W_in", layer).float().norm(dim=0))
            if gated:
                try:
                    out["gate_norm"].append(layer_weight(model, "W_gate", layer).float().norm(dim=0))
                except AttributeError:
                    gated = False
            w_out = layer_weight(model, "W_out", layer).float().contiguous()  # [neuron, d_model]
            out["out_norm"].append(w_out.norm(dim=-1))
            kurt, share = row_sparsity(w_out, row_top_k)
            out["out_kurtosis"].append(kurt)
            out["out_top_share"].append(share)
        return {name: torch.stack(rows) if rows and (gated or name != "gate_norm") else None for name, rows in out.items()}

    stats = weight_cached(model, ("mlp_weight_statistics", tuple(layers), row_top_k), compute)
    return {name: None if t is None else t.clone() for name, t in stats.items()}  # callers own their copies


def _massive(resid: Float[Tensor, "stream d_model"], threshold: float) -> Tensor:
    """``[stream, d_model]``: ``|resid[s, d]|`` exceeds ``threshold`` × the median ``|resid[s, :]|``."""
    a = resid.abs()
    return a / a.median(dim=-1, keepdim=True).values.clamp_min(_TINY) > threshold


def massive_dims_from_resid(resid: Float[Tensor, "stream d_model"], threshold: float, max_dims: int) -> tuple[list[int], int]:
    """(the ``max_dims`` dims with the largest peaks among those massive at some stream (:func:`_massive`), peak
    first; how many were massive)."""
    hit = _massive(resid, threshold).any(dim=0).nonzero().flatten()
    peak = resid.abs().amax(dim=0)[hit]
    return [int(d) for d in hit[peak.argsort(descending=True)][:max_dims]], int(hit.numel())


def dim_path(
    resid: Float[Tensor, "stream d_model"],
    attn: Float[Tensor, "block d_model"],
    mlp: Float[Tensor, "block d_model"],
    dim: int,
    *,
    erase_fraction: float = 0.5,
    path_share: float = SuperNeuronSettings.path_share,
    dim_threshold: float = SuperNeuronSettings.dim_threshold,
) -> MassiveDimPath:
    """Peak, writer and eraser blocks of one dimension (see :class:`MassiveDimPath`; the ``top_neurons`` lists
    are left empty: they need the neurons, see :meth:`SuperNeurons.top`)."""
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
    writers, erasers = [], []
    scale = max(abs(peak_value), _TINY)
    for block in range(delta.shape[0]):
        d, ab, mb = float(delta[block]), float(attn[block, dim]), float(mlp[block, dim])
        toward = sign * d / scale
        if abs(toward) >= path_share:
            step = BlockStep(block, d, ab, mb, abs(ab) / max(abs(ab) + abs(mb), _TINY), toward)
            (writers if toward > 0 else erasers).append(step)
    first = _massive(resid, dim_threshold)[:, dim].nonzero().flatten()
    return MassiveDimPath(dim, peak, peak_value, write, float(delta[write]), a, m, share, erase, erase_delta,
                          writers=writers, erasers=erasers, first_massive_stream=int(first[0]) if first.numel() else None)


class SuperNeuronReducer(Reducer[SuperNeurons]):
    """Streams ``mlp.hook_post`` (all positions) and the residual/attn/mlp outputs (sink only) into :class:`SuperNeurons`.

    Keeps per-neuron sums at the sink and at other positions (sum, sum of squares, max ``|act|``) and per-layer
    sums of the sink's residual stream, ``hook_attn_out`` and ``hook_mlp_out``; nothing else.
    Settings: ``settings=SuperNeuronSettings(...)`` or its fields as keyword arguments.
    """

    statistics = ("sink_sum", "sink_scaled_sum", "inv_scale_sum", "head_sum", "attn_inv_scale_sum", "other_sq", "other_max",
                  "resid", "attn", "mlp", "n_sequences", "n_other")
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
            raise InvalidArgumentError("This model has no MLP (attention-only: cfg.attn_only, or cfg.d_mlp 0): there are no "
                                       "neurons to analyse.")
        check_neuron_mlp(model)
        self.model = model
        self.settings = settings
        self.n_layers, self.d_model, self.d_mlp = d.n_layers, d.d_model, d.d_mlp
        self.layers = resolve_layers(layers, d.n_layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.sink = settings.sink_position
        self.device = model_device(model)
        self.maps = [post_norm_map(model, block, "mlp") for block in range(d.n_layers)]
        self.post_norm_blocks = [b for b, pm in enumerate(self.maps) if not pm.is_identity]
        self.attn_maps = [post_norm_map(model, block, "attn") for block in range(d.n_layers)]
        self.n_heads = d.n_heads
        self.reset()

    def reset(self) -> None:
        dev, f64, n = self.device, torch.float64, len(self.layers)
        self.sink_sum = torch.zeros(n, self.d_mlp, device=dev, dtype=f64)
        self.sink_scaled_sum = torch.zeros(n, self.d_mlp, device=dev, dtype=f64)  # Σ act / post-norm scale
        self.inv_scale_sum = torch.zeros(self.n_layers, device=dev, dtype=f64)  # Σ 1 / post-norm scale
        self.head_sum = torch.zeros(self.n_layers, self.n_heads, self.d_model, device=dev, dtype=f64)  # Σ z_h W_O / scale
        self.attn_inv_scale_sum = torch.zeros(self.n_layers, device=dev, dtype=f64)
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
        state: dict[str, dict[int, Tensor]] = {"post": {}, "scale": {}, "z": {}, "attn_scale": {}}  # sink values

        def fold_post(act: Tensor, layer: int) -> None:  # [batch, pos, d_mlp]
            i, x = self.row[layer], act.float()
            self.sink_sum[i] += x[:, s].sum(0).double()
            if layer in self.post_norm_blocks:
                state["post"][layer] = x[:, s].double()
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

        def fold_scale(act: Tensor, block: int) -> None:  # [batch, pos, 1]: the post norm's divisor
            state["scale"][block] = act[:, s].reshape(act.shape[0]).double()

        blocks_pn = self.post_norm_blocks
        hooks += bound_hooks([self.maps[b].scale_hook for b in blocks_pn], blocks_pn, fold_scale)

        def fold_z(act: Tensor, block: int) -> None:  # [batch, pos, head, d_head]
            state["z"][block] = act[:, s].clone().float()  # a copy: a view would hold every layer's hook_z to end_batch

        def fold_attn_scale(act: Tensor, block: int) -> None:
            state["attn_scale"][block] = act[:, s].reshape(act.shape[0]).double()

        hooks += per_layer_hooks(head_output_site(self.model), blocks, fold_z)
        attn_pn = [b for b in blocks if not self.attn_maps[b].is_identity]
        hooks += bound_hooks([self.attn_maps[b].scale_hook for b in attn_pn], attn_pn, fold_attn_scale)
        return BatchFold(hooks, state)

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        for block, scale in fold.state["scale"].items():
            inv = 1.0 / scale
            self.inv_scale_sum[block] += inv.sum()
            if block in fold.state["post"]:
                self.sink_scaled_sum[self.row[block]] += (fold.state["post"][block] * inv[:, None]).sum(0)
        for block, z in fold.state["z"].items():
            w_o = layer_weight(self.model, "W_O", block).float().to(z.device)  # [head, d_head, d_model]: a view, no stack
            write = torch.einsum("bhk,hkd->bhd", z.float(), w_o).double()
            scale = fold.state["attn_scale"].get(block)
            if scale is not None:
                inv = 1.0 / scale
                self.attn_inv_scale_sum[block] += inv.sum()
                write = write * inv[:, None, None]
            self.head_sum[block] += write.sum(0)
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
        is_outlier = (position_ratio >= cfg.position_threshold) & (neuron_ratio >= cfg.neuron_threshold)
        resid, attn, mlp = (t.float() / self.n_sequences for t in (self.resid, self.attn, self.mlp))
        dims, n_massive = (list(cfg.dims), None) if cfg.dims is not None else massive_dims_from_resid(
            resid, cfg.dim_threshold, cfg.max_dims)
        dev = sink_act.device
        # Residual units: act × W_out without a post norm; mean(act / scale) × gain ⊙ C(W_out) through one.
        res_act = sink_act.clone()
        offset = torch.stack([mlp_out_bias(self.model, b).float().to(dev) for b in range(self.n_layers)])
        for block in self.post_norm_blocks:
            pm, inv = self.maps[block], float(self.inv_scale_sum[block]) / self.n_sequences
            offset[block] = pm.linear(offset[block], torch.tensor([1.0 / inv], device=offset.device)) + pm.offset(offset[block])
            if block in self.row:
                res_act[self.row[block]] = (self.sink_scaled_sum[self.row[block]] / self.n_sequences).float()
        rebuilt, w_dims = [], []  # one layer's W_out at a time: no stacked copy
        for i, layer in enumerate(self.layers):
            w_res = layer_weight(self.model, "W_out", layer).float().to(dev)  # [neuron, d_model]
            if not self.maps[layer].is_identity:
                w_res = self.maps[layer].linear(w_res, torch.ones(1, device=dev))
            rebuilt.append(res_act[i] @ w_res)
            w_dims.append(w_res[:, dims])
        self._check_identity(torch.stack(rebuilt) + offset[self.layers], mlp)
        heads, attn_offset = self._heads(attn)
        contribution = res_act[:, :, None] * torch.stack(w_dims)
        peaks = resid[:, dims].abs().amax(dim=0) if dims else resid.new_zeros(0)
        is_super = (contribution.abs() >= cfg.super_share * peaks.clamp_min(_TINY)).any(dim=-1)
        stats = mlp_weight_statistics(self.model, self.layers, cfg.row_top_k)
        kurt, share = stats["out_kurtosis"], stats["out_top_share"]
        result = SuperNeurons(
            layers=list(self.layers), settings=cfg, dims=list(dims),
            sink_act=sink_act.cpu(), other_rms=other_rms.cpu(), other_max_abs=self.other_max.cpu(),
            position_ratio=position_ratio.cpu(), neuron_ratio=neuron_ratio.cpu(), is_super=is_super.cpu(),
            contribution=contribution.cpu(), row_kurtosis=kurt.cpu(), row_top_share=share.cpu(),
            resid_sink=resid.cpu(), attn_out_sink=attn.cpu(), mlp_out_sink=mlp.cpu(),
            paths=[], n_sequences=self.n_sequences, is_outlier=is_outlier.cpu(), mlp_offset_sink=offset.cpu(),
            post_norm_blocks=list(self.post_norm_blocks),
            head_contribution=heads[:, :, dims].cpu(), attn_offset_sink=attn_offset.cpu(), n_massive=n_massive,
        )
        for d in dims:
            path = dim_path(result.resid_sink, result.attn_out_sink, result.mlp_out_sink, d,
                            erase_fraction=cfg.erase_fraction, path_share=cfg.path_share, dim_threshold=cfg.dim_threshold)
            result.paths.append(path)
            path.top_neurons = result.top(d, cfg.top_k)
            for step in path.writers + path.erasers:
                sign = 1.0 if step.delta >= 0 else -1.0
                step.top_neurons = result.top(d, cfg.top_k, block=step.block, sign=sign)
                step.top_heads = result.top_heads(d, step.block, 3, sign=sign)
        return result

    def _heads(self, attn: Tensor) -> tuple[Tensor, Tensor]:
        """``[block, head, d_model]`` residual-unit head contributions at the sink and ``[block, d_model]`` offsets
        (``b_O`` through the post-attention norm plus its bias); warns if they miss ``attn_out_sink``."""
        heads = (self.head_sum / self.n_sequences).float()
        offset = torch.stack([attn_out_bias(self.model, b).float().to(heads.device) for b in range(self.n_layers)])
        for block, pm in enumerate(self.attn_maps):
            if pm.is_identity:
                continue
            inv = float(self.attn_inv_scale_sum[block]) / self.n_sequences
            heads[block] = pm.linear(heads[block], torch.ones(1, device=heads.device))
            offset[block] = pm.linear(offset[block], torch.tensor([1.0 / inv], device=heads.device)) + pm.offset(offset[block])
        err = float((heads.sum(1) + offset - attn).abs().max())
        size = float(attn.abs().max())
        if err > self._rebuild_tolerance() * size + 1e-5:
            warnings.warn(f"Head contributions at the sink do not add up to hook_attn_out (max error {err:.3g} vs max "
                          f"|hook_attn_out| {size:.3g}): they are approximate for this model.", RuntimeWarning, stacklevel=3)
        return heads, offset

    def _rebuild_tolerance(self) -> float:
        """Relative error allowed between a float32 rebuild and the model's own output: that output was rounded
        to the model's dtype (bfloat16 keeps 8 bits, a relative error up to 2^-8 per value), hence 8 of its eps,
        and at least 1e-3 (float32 sums over thousands of terms)."""
        return max(1e-3, 8 * torch.finfo(model_dtype(self.model)).eps)

    def _check_identity(self, rebuilt: Tensor, mlp: Tensor) -> None:
        """Warn if ``rebuilt`` (``Σ_n contribution + offset`` per layer) misses the mean ``hook_mlp_out`` at the sink (a
        model whose MLP output is not ``post W_out + b_out`` through its post norm: the contributions would not be exact)."""
        target = mlp[self.layers]
        err = float((rebuilt - target).abs().max()) if target.numel() else 0.0
        size = float(target.abs().max()) if target.numel() else 0.0
        if err > self._rebuild_tolerance() * size + 1e-5:
            warnings.warn(f"Neuron contributions at the sink do not add up to hook_mlp_out (max error {err:.3g} vs "
                          f"max |hook_mlp_out| {size:.3g}): this model's MLP output is not act × W_out + b_out "
                          "through its post norm, so contributions are approximate.", RuntimeWarning, stacklevel=3)


def add_total_effects(model: Any, batches: Sequence[TokenBatch], neurons: SuperNeurons, *,
                      options: RunOptions = RunOptions()) -> SuperNeurons:
    """Fill ``neurons.total_effect`` and each path's ``total_effect`` rows by attribution patching; return ``neurons``.

    ``total_effect[l, n, j]``: mean over sequences of ``act × ∂resid[peak, s, dims[j]] / ∂act`` (``act``: the
    neuron's ``mlp.hook_post`` at the sink ``s``; ``peak``: the dim's peak stream), the gradient flowing through
    every later block: the first-order estimate of what zeroing the neuron at the sink removes from the dim, its
    direct write and what later blocks build on it. One forward and one backward per dim per batch; a causal
    model runs only the tokens up to the sink (nothing later reaches it) unless ``options.extra_hooks`` are given.
    ``batches``: those ``neurons`` was computed on (:func:`sinklens.streaming.batches_for`); ``find_super_neurons``
    and ``analyze`` call this.
    """
    s, dims, layers = neurons.sink_position, neurons.dims, neurons.layers
    n_layers = model_dims(model).n_layers
    peaks = [neurons.path(d).peak_layer for d in dims]
    total = torch.zeros(len(layers), neurons.contribution.shape[1], len(dims), device=model_device(model), dtype=torch.float64)
    batches = batches if dims else []
    prefix = not is_encoder(model) and not options.extra_hooks
    n_seq, acts, leaves, streams = 0, {}, {}, {}
    with eval_mode(model), torch.enable_grad():
        for batch in batches:
            batch = right_align(batch)  # then the first s + 1 tokens of every row are real (checked by the reducer)

            def post(act: Tensor, layer: int) -> Tensor:
                acts[layer], leaves[layer] = act[:, s].detach(), torch.zeros_like(act, requires_grad=True)
                return act + leaves[layer]

            def read(act: Tensor, stream: int) -> None:
                streams[stream] = act

            hooks = list(options.extra_hooks) + per_layer_hooks(MLP_POST, layers, post)
            hooks += bound_hooks([stream_hook(p, n_layers) for p in set(peaks)], list(set(peaks)), read)
            with model.hooks(fwd_hooks=hooks):
                if prefix:
                    model(batch.tokens[:, : s + 1], return_type=None)
                else:
                    forward(model, batch, return_type=None)
            for j, (d, p) in enumerate(zip(dims, peaks)):
                if not streams[p].requires_grad:  # peak before every analysed MLP (e.g. at the embedding)
                    continue
                grads = torch.autograd.grad(streams[p][:, s, d].sum(), [leaves[l] for l in layers],
                                            retain_graph=j + 1 < len(dims), allow_unused=True)
                for i, (layer, g) in enumerate(zip(layers, grads)):
                    if g is not None:
                        total[i, :, j] += (acts[layer] * g[:, s]).double().sum(0).to(total.device)
            n_seq += batch.tokens.shape[0]
    neurons.total_effect = (total / max(n_seq, 1)).float().cpu()
    for path in neurons.paths:
        path.total_effect = neurons.top(path.dim, neurons.top_k, by="total")
    return neurons


def find_super_neurons(
    model: Any,
    inputs: Inputs | None = None,
    *,
    layers: int | Sequence[int] | None = None,
    settings: SuperNeuronSettings | None = None,
    options: RunOptions = RunOptions(),
    **settings_kwargs: Any,
) -> SuperNeurons:
    """Find super neurons at ``sink_position`` and the blocks/neurons that write each massive dimension, ranked by
    direct contribution and by total effect (:func:`add_total_effects`).

    Args:
        inputs: anything :func:`sinklens.inputs.as_batches` accepts (None = the built-in prompts).
        layers: model layers whose neurons are analysed (None = all). The residual path always uses all.
        settings: the analysis settings (default ``SuperNeuronSettings()``).
        **settings_kwargs: any field of :class:`SuperNeuronSettings` as a keyword, replacing that of ``settings``:
            ``sink_position=``, ``dims=`` (massive residual dimensions to attribute; None: detected at the sink
            with ``dim_threshold``, at most ``max_dims``; e.g. pass ``MassiveActivations.massive_dims()``),
            ``position_threshold=``, ``neuron_threshold=``, ...
        options: batching, BOS, truncation, extra hooks and progress bar.

    Examples:
        >>> from sinklens.testing.planted import planted_model
        >>> model, spec = planted_model(n_layers=2, layer=0, neuron=7, dim=5)
        >>> found = find_super_neurons(model, "t3 t4 t5 t6", options=RunOptions(progress=False))
        >>> found.dims, found.top(5, 1)[0][:2], found.path(5).write_layer
        ([5], (0, 7), 0)
    """
    options = checked_options(options, "find_super_neurons")
    batches = batches_for(model, inputs, options)
    found = run_analyzer(model, batches, SuperNeuronReducer, where="find_super_neurons", options=options,
                         kwargs=settings_kwargs, settings_cls=SuperNeuronSettings, settings=settings, layers=layers)
    return add_total_effects(model, batches, found, options=options)
