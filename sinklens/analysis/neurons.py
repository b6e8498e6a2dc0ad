"""Super neurons: FFN neurons whose ``contribution`` (mean ``mlp.hook_post`` at the sink × ``W_out[l, n, d]``, through
any post-MLP norm) reaches ``super_share`` of a massive residual dim's peak ``|value|`` at the sink."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from contextlib import suppress
from functools import partial
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.analysis._common import (
    TINY as _TINY, check_sink_position, checked_options, other_positions, resolve_streams, run_analyzer,
    settings_from, stream_hook,
)
from sinklens.analysis.neuron_result import (
    BlockStep, MassiveDimPath, SuperNeurons, SuperNeuronSettings, check_fits_model,
)
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
    """Each neuron's write into the residual stream: ``post[..., n] × W_out[layer, n, :]`` through
    the post-MLP norm's affine map when there is one (then ``scale``, its ``hook_scale`` at the same
    positions, is required). Summed over neurons plus :func:`mlp_offset` it is ``hook_mlp_out``."""
    writes = post[..., :, None] * weight(model, "W_out")[layer].to(post.dtype)
    if scale is not None:
        scale = (scale[..., 0] if scale.dim() == post.dim() and scale.shape[-1] == 1 else scale)[..., None, None]
    return post_norm_map(model, layer, "mlp").linear(writes, scale)


def mlp_offset(model: Any, layer: int, scale: Tensor | None = None) -> Float[Tensor, "*batch d_model"]:
    """What of ``hook_mlp_out`` no neuron wrote: ``b_out`` through any post-MLP norm (``scale``: as in
    :func:`neuron_contributions`)."""
    b, pm = mlp_out_bias(model, layer), post_norm_map(model, layer, "mlp")
    if pm.is_identity or scale is None:
        return pm.linear(b)  # b itself, or the error naming the missing scale
    scale = scale if scale.shape[-1:] == (1,) else scale[..., None]
    b = b.to(scale.dtype)
    return pm(b.expand(*scale.shape[:-1], b.shape[-1]), scale)


def row_sparsity(rows: Float[Tensor, "*rows d"], k: int = 1) -> tuple[Float[Tensor, "*rows"], Float[Tensor, "*rows"]]:
    """(Pearson kurtosis with ``1/n`` moments, share of the squared norm in the top ``k`` entries) of each row."""
    x = rows.float()
    centred = x - x.mean(-1, keepdim=True)
    c2 = centred * centred  # products, not pow: several times faster on CPU for large weights
    var = c2.mean(-1)
    kurt = (c2 * c2).mean(-1) / (var * var).clamp_min(_TINY)
    sq = x * x
    top = sq.amax(dim=-1) if k == 1 else sq.topk(k, dim=-1).values.sum(-1)
    return kurt, top / sq.sum(-1).clamp_min(_TINY)


def mlp_weight_statistics(model: Any, layers: Sequence[int], row_top_k: int = 1) -> dict[str, Tensor | None]:
    """Per ``[layer, neuron]`` of ``layers`` (float32, model's device, cached until the weights change): ``in_norm``
    / ``gate_norm`` (None without a gate) / ``out_norm``: ``‖W_in[:, n]‖`` / ``‖W_gate[:, n]‖`` / ``‖W_out[n]‖``;
    ``out_kurtosis`` / ``out_top_share``: :func:`row_sparsity` of ``W_out[n]``."""

    def compute() -> dict[str, Tensor | None]:
        rows = []
        for layer in layers:  # one layer's weights at a time
            w_out = layer_weight(model, "W_out", layer).float().contiguous()  # [neuron, d_model]
            row = dict(zip(("out_kurtosis", "out_top_share"), row_sparsity(w_out, row_top_k)),
                       in_norm=layer_weight(model, "W_in", layer).float().norm(dim=0), out_norm=w_out.norm(dim=-1))
            with suppress(AttributeError):  # not a gated MLP
                row["gate_norm"] = layer_weight(model, "W_gate", layer).float().norm(dim=0)
            rows.append(row)
        names = ("in_norm", "gate_norm", "out_norm", "out_kurtosis", "out_top_share")
        return {k: torch.stack([r[k] for r in rows]) if rows and k in rows[0] else None for k in names}

    stats = weight_cached(model, ("mlp_weight_statistics", tuple(layers), row_top_k), compute)
    return {name: None if t is None else t.clone() for name, t in stats.items()}  # callers own their copies


def _massive(resid: Float[Tensor, "stream d_model"], threshold: float) -> Tensor:
    """``[stream, d_model]``: ``|resid[s, d]|`` exceeds ``threshold`` × the median ``|resid[s, :]|``."""
    a = resid.abs()
    return a / a.median(dim=-1, keepdim=True).values.clamp_min(_TINY) > threshold


def massive_dims_from_resid(resid: Float[Tensor, "stream d_model"], threshold: float, max_dims: int) -> tuple[list[int], int]:
    """(the ``max_dims`` dims massive at some stream, largest peak first; how many were massive)."""
    hit = _massive(resid, threshold).any(dim=0).nonzero().flatten()
    return hit[resid.abs().amax(dim=0)[hit].argsort(descending=True)][:max_dims].tolist(), int(hit.numel())


def dim_path(resid: Float[Tensor, "stream d_model"], attn: Float[Tensor, "block d_model"],
             mlp: Float[Tensor, "block d_model"], dim: int, *, erase_fraction: float = 0.5,
             path_share: float = SuperNeuronSettings.path_share,
             dim_threshold: float = SuperNeuronSettings.dim_threshold) -> MassiveDimPath:
    """Peak, writer and eraser blocks of one dimension (:class:`MassiveDimPath`, ``top_neurons`` left empty)."""
    values = resid[:, dim]
    peak = int(values.abs().argmax())
    peak_value = float(values[peak])
    sign = 1.0 if peak_value >= 0 else -1.0
    delta = attn[:, dim] + mlp[:, dim]
    steps = [BlockStep(block, d, a, m, abs(a) / max(abs(a) + abs(m), _TINY), sign * d / max(abs(peak_value), _TINY))
             for block, (d, a, m) in enumerate(zip(delta.tolist(), attn[:, dim].tolist(), mlp[:, dim].tolist()))]
    w = steps[int((sign * delta).argmax())]  # the block stepping furthest towards the peak
    low = min(steps[w.block + 1 :], key=lambda step: sign * step.delta, default=None)
    erase = low if low is not None and sign * low.delta < -erase_fraction * abs(peak_value) else None
    first = _massive(resid, dim_threshold)[:, dim].nonzero().flatten()
    return MassiveDimPath(dim, peak, peak_value, w.block, w.delta, w.attn, w.mlp, w.attn_share,
                          None if erase is None else erase.block, None if erase is None else erase.delta,
                          writers=[step for step in steps if step.share >= path_share],
                          erasers=[step for step in steps if step.share <= -path_share],
                          first_massive_stream=int(first[0]) if first.numel() else None)


class SuperNeuronReducer(Reducer[SuperNeurons]):
    """Streams ``mlp.hook_post`` (all positions) and the residual, ``hook_attn_out``, ``hook_mlp_out`` and head
    outputs (sink only) into per-neuron and per-layer sums for :class:`SuperNeurons`."""

    statistics = ("sink_sum", "sink_scaled_sum", "inv_scale_sum", "head_sum", "attn_inv_scale_sum", "other_sq", "other_max",
                  "resid", "attn", "mlp", "n_sequences", "n_other")
    maxima = ("other_max",)

    def __init__(self, model: Any, *, layers: int | Sequence[int] | None = None,
                 settings: SuperNeuronSettings | None = None, **settings_kwargs: Any):
        d = model_dims(model)
        settings = settings_from(SuperNeuronSettings, settings, settings_kwargs, "SuperNeuronReducer")
        check_fits_model(d.d_model, settings.row_top_k, settings.dims or ())
        if d.d_mlp <= 0:
            raise InvalidArgumentError("This model has no MLP (attention-only: cfg.attn_only, or cfg.d_mlp 0): there are no "
                                       "neurons to analyse.")
        check_neuron_mlp(model)
        self.model, self.settings, self.sink, self.device = model, settings, settings.sink_position, model_device(model)
        self.n_layers, self.d_model, self.d_mlp, self.n_heads = d.n_layers, d.d_model, d.d_mlp, d.n_heads
        self.layers = resolve_layers(layers, d.n_layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.maps = [post_norm_map(model, block, "mlp") for block in range(d.n_layers)]
        self.post_norm_blocks = [b for b, pm in enumerate(self.maps) if not pm.is_identity]
        self.attn_maps = [post_norm_map(model, block, "attn") for block in range(d.n_layers)]
        self.reset()

    def reset(self) -> None:
        zeros = partial(torch.zeros, device=self.device, dtype=torch.float64)
        n, blocks, d = len(self.layers), self.n_layers, self.d_model
        self.sink_sum, self.sink_scaled_sum, self.other_sq = (zeros(n, self.d_mlp) for _ in range(3))
        self.other_max = zeros(n, self.d_mlp, dtype=torch.float32)
        self.inv_scale_sum, self.attn_inv_scale_sum = zeros(blocks), zeros(blocks)  # Σ 1 / scale
        self.head_sum = zeros(blocks, self.n_heads, d)  # Σ z_h W_O (/ post-norm scale)
        self.resid, self.attn, self.mlp = zeros(blocks + 1, d), zeros(blocks, d), zeros(blocks, d)
        self.n_sequences = self.n_other = 0

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

        def keep(key: str):  # hook_scale [batch, pos, 1], or a copy of hook_z at the sink
            def fold(act: Tensor, block: int) -> None:
                state[key][block] = act[:, s].clone().float() if key == "z" else act[:, s].reshape(-1).double()
            return fold

        streams = resolve_streams(None, self.n_layers)
        blocks = range(self.n_layers)
        mlp_pn, attn_pn = self.post_norm_blocks, [b for b in blocks if not self.attn_maps[b].is_identity]
        hooks = per_layer_hooks(MLP_POST, self.layers, fold_post)
        hooks += bound_hooks([stream_hook(i, self.n_layers) for i in streams], streams, at_sink(self.resid))
        hooks += per_layer_hooks(ATTN_OUT, blocks, at_sink(self.attn))
        hooks += per_layer_hooks(MLP_OUT, blocks, at_sink(self.mlp))
        hooks += bound_hooks([self.maps[b].scale_hook for b in mlp_pn], mlp_pn, keep("scale"))
        hooks += per_layer_hooks(head_output_site(self.model), blocks, keep("z"))
        hooks += bound_hooks([self.attn_maps[b].scale_hook for b in attn_pn], attn_pn, keep("attn_scale"))
        return BatchFold(hooks, state)

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        for block, scale in fold.state["scale"].items():
            inv = 1.0 / scale
            self.inv_scale_sum[block] += inv.sum()
            if block in fold.state["post"]:
                self.sink_scaled_sum[self.row[block]] += (fold.state["post"][block] * inv[:, None]).sum(0)
        for block, z in fold.state["z"].items():
            w_o = layer_weight(self.model, "W_O", block).float().to(z.device)  # [head, d_head, d]
            write = torch.einsum("bhk,hkd->bhd", z, w_o).double()
            if (scale := fold.state["attn_scale"].get(block)) is not None:
                inv = 1.0 / scale
                self.attn_inv_scale_sum[block] += inv.sum()
                write = write * inv[:, None, None]
            self.head_sum[block] += write.sum(0)
        self.n_sequences += batch.valid.shape[0]
        self.n_other += int(other_positions(batch, self.sink).sum())

    def result(self) -> SuperNeurons:
        if self.n_sequences == 0:
            raise InvalidArgumentError("No batches were streamed; nothing to summarise.")
        cfg, n_seq = self.settings, self.n_sequences
        sink_act = (self.sink_sum / n_seq).float()
        other_rms = (self.other_sq / max(self.n_other, 1)).sqrt().float()
        position_ratio = sink_act.abs() / other_rms.clamp_min(_TINY)
        neuron_ratio = sink_act.abs() / sink_act.abs().median(dim=-1, keepdim=True).values.clamp_min(_TINY)
        is_outlier = (position_ratio >= cfg.position_threshold) & (neuron_ratio >= cfg.neuron_threshold)
        resid, attn, mlp = (t.float() / n_seq for t in (self.resid, self.attn, self.mlp))
        dims, n_massive = (list(cfg.dims), None) if cfg.dims is not None else massive_dims_from_resid(
            resid, cfg.dim_threshold, cfg.max_dims)
        dev = sink_act.device
        # Residual units: act × W_out without a post norm; mean(act / scale) × gain ⊙ C(W_out) through one.
        res_act = sink_act.clone()
        offset = self._offsets(self.maps, mlp_out_bias, self.inv_scale_sum, dev)
        for block in self.row.keys() & set(self.post_norm_blocks):
            res_act[self.row[block]] = (self.sink_scaled_sum[self.row[block]] / n_seq).float()
        rebuilt, w_dims = [], []  # one layer's W_out at a time: no stacked copy
        one = torch.ones(1, device=dev)
        for i, layer in enumerate(self.layers):
            w_out = layer_weight(self.model, "W_out", layer).float().to(dev)  # [neuron, d_model]
            w_res = self.maps[layer].linear(w_out, one)
            rebuilt.append(res_act[i] @ w_res)
            w_dims.append(w_res[:, dims])
        self._warn_if_off(torch.stack(rebuilt) + offset[self.layers], mlp[self.layers], "Neuron",
                          "hook_mlp_out", "this model's MLP output is not act × W_out + b_out "
                          "through its post norm, so contributions are approximate.")
        heads = (self.head_sum / n_seq).float()
        heads = torch.stack([pm.linear(h, one) for pm, h in zip(self.attn_maps, heads)])
        attn_offset = self._offsets(self.attn_maps, attn_out_bias, self.attn_inv_scale_sum, dev)
        self._warn_if_off(heads.sum(1) + attn_offset, attn, "Head", "hook_attn_out",
                          "they are approximate for this model.")
        contribution = res_act[:, :, None] * torch.stack(w_dims)
        peaks = resid[:, dims].abs().amax(dim=0) if dims else resid.new_zeros(0)
        is_super = (contribution.abs() >= cfg.super_share * peaks.clamp_min(_TINY)).any(dim=-1)
        stats = mlp_weight_statistics(self.model, self.layers, cfg.row_top_k)
        result = SuperNeurons(
            layers=list(self.layers), settings=cfg, dims=list(dims),
            sink_act=sink_act.cpu(), other_rms=other_rms.cpu(), other_max_abs=self.other_max.cpu(),
            position_ratio=position_ratio.cpu(), neuron_ratio=neuron_ratio.cpu(), is_super=is_super.cpu(),
            contribution=contribution.cpu(), row_kurtosis=stats["out_kurtosis"].cpu(),
            row_top_share=stats["out_top_share"].cpu(),
            resid_sink=resid.cpu(), attn_out_sink=attn.cpu(), mlp_out_sink=mlp.cpu(),
            paths=[], n_sequences=n_seq, is_outlier=is_outlier.cpu(), mlp_offset_sink=offset.cpu(),
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

    def _offsets(self, maps: Sequence[Any], bias: Any, inv_scale_sum: Tensor, dev: Any) -> Tensor:
        """``[block, d_model]``: each block's output bias through its post norm, at the mean ``1 / scale``."""
        out = torch.stack([bias(self.model, b).float().to(dev) for b in range(self.n_layers)])
        for block, pm in enumerate(maps):
            if not pm.is_identity:
                inv = float(inv_scale_sum[block]) / self.n_sequences
                out[block] = pm(out[block], torch.tensor([1.0 / inv], device=dev))
        return out

    def _warn_if_off(self, rebuilt: Tensor, target: Tensor, who: str, hook: str, tail: str) -> None:
        """Warn when ``rebuilt`` misses the mean ``hook`` by more than rounding (8 dtype eps, >= 1e-3, relative)."""
        err, size = (float(t.abs().max()) if target.numel() else 0.0 for t in (rebuilt - target, target))
        if err > max(1e-3, 8 * torch.finfo(model_dtype(self.model)).eps) * size + 1e-5:
            warnings.warn(f"{who} contributions at the sink do not add up to {hook} (max error {err:.3g} vs "
                          f"max |{hook}| {size:.3g}): {tail}", RuntimeWarning, stacklevel=3)


def add_total_effects(model: Any, batches: Sequence[TokenBatch], neurons: SuperNeurons, *,
                      options: RunOptions = RunOptions()) -> SuperNeurons:
    """Fill ``neurons.total_effect`` (and each path's) by attribution patching; return ``neurons``.

    ``total_effect[l, n, j]``: mean over sequences of ``act × ∂resid[peak, s, dims[j]] / ∂act`` (``act``: the
    neuron's ``mlp.hook_post`` at the sink), the first-order estimate of what zeroing it at the sink removes from
    the dim at its peak stream. ``batches``: those ``neurons`` was computed on."""
    s, dims, layers = neurons.sink_position, neurons.dims, neurons.layers
    n_layers = model_dims(model).n_layers
    peaks = [neurons.path(d).peak_layer for d in dims]
    total = torch.zeros(len(layers), neurons.contribution.shape[1], len(dims), device=model_device(model), dtype=torch.float64)
    batches = batches if dims else []
    prefix = not is_encoder(model) and not options.extra_hooks
    n_seq, acts, leaves, streams = 0, {}, {}, {}

    def post(act: Tensor, layer: int) -> Tensor:
        acts[layer], leaves[layer] = act[:, s].detach(), torch.zeros_like(act, requires_grad=True)
        return act + leaves[layer]

    def read(act: Tensor, stream: int) -> None:
        streams[stream] = act

    hooks = list(options.extra_hooks) + per_layer_hooks(MLP_POST, layers, post)
    hooks += bound_hooks([stream_hook(p, n_layers) for p in set(peaks)], list(set(peaks)), read)
    with eval_mode(model), torch.enable_grad():
        for batch in batches:
            batch = right_align(batch)  # then the first s + 1 tokens of every row are real (checked by the reducer)
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


def find_super_neurons(model: Any, inputs: Inputs | None = None, *,
                       layers: int | Sequence[int] | None = None,
                       settings: SuperNeuronSettings | None = None,
                       options: RunOptions = RunOptions(), **settings_kwargs: Any) -> SuperNeurons:
    """Find super neurons at the sink and the blocks/neurons that write each massive dimension, ranked by direct
    contribution and by total effect (:func:`add_total_effects`). ``layers``: whose neurons are analysed (None:
    all); ``settings`` / ``**settings_kwargs``: a :class:`SuperNeuronSettings` / fields replacing its own.

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
