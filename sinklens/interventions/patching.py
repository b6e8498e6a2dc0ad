"""Activation patching on sink metrics: which components carry a sink?

The recipe of attribution/activation-patching tutorials, with a sink metric instead of a logit
difference. Two runs on the same tokens: *clean* (no hooks) and *intervened* (the given hooks, e.g.
:func:`~sinklens.interventions.masks.block_keys` that removes the sink, or an amplification that
creates one). For each component (a layer × position of the residual stream, a layer × head of
``attn.hook_z``, …) the clean activation is patched into the intervened run and the metric —
the mean attention received by ``target`` from the queries after it, averaged over heads, the
``metric_layers`` and the batch — is recomputed.

``restored = (patched − intervened) / (clean − intervened)``: 1 means that component alone brings
the clean sink back, 0 that it does nothing.

The patching loop itself is TransformerLens' ``transformer_lens.patching.generic_activation_patch``
with its patch setters (the same code on TransformerLens 3.x and 4.x); sinklens supplies the index
set, keeps the intervention hooks attached around it through ``model.hooks`` and measures the metric
with :class:`~sinklens.analysis.attention.AttentionReceivedReducer` hooks attached the same way.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.analysis.attention import AttentionReceivedReducer
from sinklens.hooks import ATTN_OUT, MLP_OUT, RESID_MID, RESID_PRE, Z, check_hook_names, hook_name, model_dims, resolve_layers
from sinklens.inputs import Inputs, as_batches
from sinklens.interventions.masks import Hooks, as_positions

PatchSite = Literal["resid_pre", "resid_mid", "attn_out", "mlp_out", "z", "z_pos"]

#: site -> (TransformerLens activation name, hook site, TL patch setter name, axes)
_SITES: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "resid_pre": ("resid_pre", RESID_PRE, "layer_pos_patch_setter", ("layer", "pos")),
    "resid_mid": ("resid_mid", RESID_MID, "layer_pos_patch_setter", ("layer", "pos")),
    "attn_out": ("attn_out", ATTN_OUT, "layer_pos_patch_setter", ("layer", "pos")),
    "mlp_out": ("mlp_out", MLP_OUT, "layer_pos_patch_setter", ("layer", "pos")),
    "z": ("z", Z, "layer_head_vector_patch_setter", ("layer", "head_index")),
    "z_pos": ("z", Z, "layer_pos_head_vector_patch_setter", ("layer", "pos", "head_index")),
}


@dataclass
class SinkPatchResult:
    """Sink metric after patching each component; see the module docstring.

    Attributes:
        site: what was patched (``"resid_pre"``, ``"z"`` …).
        axes: names of the axes of ``values`` (``("layer", "pos")``, ``("layer", "head")``, …).
        coords: the layer / position / head of each index along each axis.
        values: the metric of the patched intervened run, one entry per component.
        clean: the metric without intervention.
        intervened: the metric with the intervention and no patch.
        target: the position whose received attention is the metric.
        metric_layers: layers the metric averages over.
    """

    site: str
    axes: tuple[str, ...]
    coords: dict[str, list[int]]
    values: Float[Tensor, "..."]
    clean: float
    intervened: float
    target: int
    metric_layers: list[int]

    @property
    def restored(self) -> Float[Tensor, "..."]:
        """``(patched − intervened) / (clean − intervened)``: the fraction of the sink each patch restores."""
        gap = self.clean - self.intervened
        if abs(gap) < 1e-12:
            raise ValueError("The intervention did not change the metric (clean == intervened); nothing to restore.")
        return (self.values - self.intervened) / gap

    def top(self, n: int = 5) -> list[tuple[dict[str, int], float]]:
        """The ``n`` components that restore the most, as ``({axis: index}, restored)``."""
        flat = self.restored.flatten()
        order = flat.argsort(descending=True)[:n]
        out = []
        for idx in order.tolist():
            multi = torch.unravel_index(torch.tensor(idx), self.values.shape)
            out.append(({a: self.coords[a][int(i)] for a, i in zip(self.axes, multi)}, float(flat[idx])))
        return out

    def plot(self, path: Any = None) -> Any:
        """Heat map of :attr:`restored` (2-D sites; ``z_pos`` is summed over positions)."""
        from sinklens.plotting.interventions import plot_patching

        return plot_patching(self, path=path)


def patch_sink(
    model: Any,
    tokens: Inputs,
    hooks: Hooks,
    *,
    target: int = 0,
    site: PatchSite = "resid_pre",
    layers=None,
    positions: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    metric_layers=None,
    prepend_bos: bool = True,
) -> SinkPatchResult:
    """Patch clean activations into the intervened run, one component at a time, and measure the sink.

    Args:
        tokens: one batch of inputs (strings or ``[batch, pos]`` ids); all sequences must have the same length.
        hooks: the intervention (any ``(hook_name, fn)`` list).
        target: the position whose received attention is measured.
        site: ``"resid_pre"``/``"resid_mid"``/``"attn_out"``/``"mlp_out"`` (by layer × position),
            ``"z"`` (by layer × head, all positions) or ``"z_pos"`` (layer × position × head).
        layers, positions, heads: restrict the components patched (default all) — each patch is
            one forward pass, so restrict on large models.
        metric_layers: layers the metric averages over (default all).
    """
    if site not in _SITES:
        raise ValueError(f"Unknown patch site {site!r}; expected one of {sorted(_SITES)}.")
    from transformer_lens import patching as tl_patching

    import pandas as pd

    act_name, hook_site, setter_name, axes = _SITES[site]
    dims = model_dims(model)
    batches = as_batches(model, tokens, batch_size=10**9, prepend_bos=prepend_bos)
    (batch,) = batches
    if not bool(batch.valid.all()):
        raise ValueError("patch_sink needs sequences of equal length (no padding): pass a [batch, pos] tensor or equal-length texts.")
    n_pos = batch.tokens.shape[1]
    (target,) = as_positions(target, dims.n_ctx, what="target position")
    if target >= n_pos - 1:
        raise ValueError(f"Target {target} needs later queries: use sequences longer than {target + 1} tokens (got {n_pos}).")
    layer_list = resolve_layers(layers, dims.n_layers)
    coords: dict[str, list[int]] = {"layer": layer_list}
    if "pos" in axes:
        coords["pos"] = list(range(n_pos)) if positions is None else as_positions(positions, n_pos)
    if "head_index" in axes:
        head_list = list(range(dims.n_heads)) if heads is None else ([heads] if isinstance(heads, int) else list(heads))
        for h in head_list:
            if not 0 <= h < dims.n_heads:
                raise ValueError(f"Head {h} is out of range (0..{dims.n_heads - 1}).")
        coords["head_index"] = head_list
    names = [hook_name(layer, hook_site) for layer in layer_list]
    check_hook_names(model, names + [name for name, _ in hooks])

    reducer = AttentionReceivedReducer(model, layers=metric_layers, min_query=target + 1)
    fold = reducer.fwd_hooks(batch)
    recorder = fold.hooks

    def metric(_logits: Any) -> Tensor:
        reducer.end_batch(batch, fold)
        value = reducer.result().at(target).mean()
        reducer.reset()
        return value

    tokens_t = batch.tokens
    with torch.inference_mode():
        with model.hooks(fwd_hooks=recorder):
            _, clean_cache = model.run_with_cache(tokens_t, names_filter=lambda n: n in set(names))
            clean = float(metric(None))
        with model.hooks(fwd_hooks=list(hooks) + recorder):
            model(tokens_t, return_type=None)
            intervened = float(metric(None))
            index_df = pd.DataFrame(list(itertools.product(*coords.values())), columns=list(coords))
            flat = tl_patching.generic_activation_patch(
                model, tokens_t, clean_cache, metric, getattr(tl_patching, setter_name), act_name, index_df=index_df,
            )
    values = flat.detach().float().cpu().reshape([len(v) for v in coords.values()])
    axes_out = tuple("head" if a == "head_index" else a for a in coords)
    coords_out = {("head" if a == "head_index" else a): v for a, v in coords.items()}
    return SinkPatchResult(
        site=site, axes=axes_out, coords=coords_out, values=values, clean=clean, intervened=intervened,
        target=target, metric_layers=reducer.layers,
    )
