"""Activation patching on a sink metric (the mean attention ``target`` receives from later queries): each component's
clean activation goes into the intervened run, one forward each, as in TransformerLens' ``generic_activation_patch``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from sinklens.analysis.attention import AttentionReceivedReducer
from sinklens.display import CompactRepr
from sinklens.errors import InvalidArgumentError, UnsupportedArchitectureError
from sinklens.export import to_json
from sinklens.hooks import (ATTN_OUT, MLP_OUT, PATTERN, RESID_MID, RESID_PRE, Z, check_hook_names, exclusive_use, hook_name,
                            model_dims, model_dtype)
from sinklens.inputs import Inputs, as_batches
from sinklens.interventions.masks import Hooks, IndexLike, IntLike, heads_arg, layers_arg, positions_arg
from sinklens.options import RunOptions, checked_options, hook_pairs
from sinklens.residual_sites import has_resid_mid, on_the_residual_stream
from sinklens.residual_units import no_mlp_reason, post_ln_reason
from sinklens.streaming import eval_mode
from sinklens.validate import choice, index

PatchSite = Literal["resid_pre", "resid_mid", "attn_out", "mlp_out", "z", "z_pos"]

#: site -> (hook site, axes after "layer"); activations are ``[batch, pos, ...]`` or ``[batch, pos, head, d]``
_SITES: dict[str, tuple[str, tuple[str, ...]]] = {
    "resid_pre": (RESID_PRE, ("pos",)), "resid_mid": (RESID_MID, ("pos",)), "attn_out": (ATTN_OUT, ("pos",)),
    "mlp_out": (MLP_OUT, ("pos",)), "z": (Z, ("head",)), "z_pos": (Z, ("pos", "head")),
}


def patch_hook_names(model: Any, site: str, layers: Sequence[int]) -> dict[int, str]:
    """The hook carrying ``site`` per layer: ``blocks.{l}.hook_{site}``, except ``"attn_out"`` on a post-LN block,
    patched at ``attn.hook_z``; ``"resid_mid"`` and ``"mlp_out"`` are refused where the model has no such hook."""
    if site == "attn_out" and post_ln_reason(model) is not None:
        return {layer: hook_name(layer, Z) for layer in layers}
    names = {layer: hook_name(layer, _SITES[site][0]) for layer in layers}
    if site in ("resid_mid", "mlp_out") and no_mlp_reason(model) is not None:
        raise UnsupportedArchitectureError(
            f"site {site!r}: this model has no MLP (attention-only: cfg.attn_only, or cfg.d_mlp 0), so no MLP output "
            "nor residual between attention and MLP. Patch 'attn_out', 'resid_pre', 'z' or 'z_pos' instead.")
    if site == "resid_mid" and not has_resid_mid(model, layers):
        raise UnsupportedArchitectureError(
            f"site 'resid_mid': {names[layers[0]]} is missing or never runs: in a parallel block (GPT-NeoX/Pythia, "
            "GPT-J) attention and MLP both read hook_resid_pre. Patch 'attn_out', 'mlp_out' or 'resid_pre' instead.")
    return names


@dataclass(repr=False, eq=False)
class SinkPatchResult(CompactRepr):
    """The metric after patching each component: ``values`` (float64, axes ``axes`` with layer / position /
    head ``coords``), and unpatched ``clean`` and ``intervened``, averaged over heads, ``metric_layers`` and
    the batch; ``pattern_dtype`` sets :attr:`gap_tolerance`."""

    site: str
    axes: tuple[str, ...]
    coords: dict[str, list[int]]
    values: Float[Tensor, "..."]
    clean: float
    intervened: float
    target: int
    metric_layers: list[int]
    pattern_dtype: str = "float32"

    @property
    def gap_tolerance(self) -> float:
        """The largest ``|clean − intervened|`` that is rounding: ``eps(pattern_dtype) · max(|clean|, |intervened|)``."""
        return torch.finfo(getattr(torch, self.pattern_dtype)).eps * max(abs(self.clean), abs(self.intervened))

    @property
    def has_effect(self) -> bool:
        """True when the intervention moved the metric beyond :attr:`gap_tolerance` (else :attr:`restored` raises)."""
        return abs(self.clean - self.intervened) > self.gap_tolerance

    @property
    def restored(self) -> Float[Tensor, "..."]:
        """``(patched − intervened) / (clean − intervened)``: the fraction of the sink each patch restores (1:
        that component alone brings it back)."""
        gap = self.clean - self.intervened
        if not self.has_effect:
            raise InvalidArgumentError(
                f"The intervention did not change the metric beyond {self.pattern_dtype} rounding: clean "
                f"{self.clean:.9g} − intervened {self.intervened:.9g} = {gap:.3g}, within {self.gap_tolerance:.3g}; "
                "nothing to restore.")
        return (self.values - self.intervened) / gap

    def to_rows(self) -> list[dict]:
        """One plain row per component: its coordinates, the patched metric and ``restored`` (None without effect)."""
        gap = self.clean - self.intervened
        rows = []
        for idx in itertools.product(*(range(len(self.coords[a])) for a in self.axes)):
            value = float(self.values[idx])
            restored = (value - self.intervened) / gap if self.has_effect else None
            rows.append({**{a: self.coords[a][i] for a, i in zip(self.axes, idx)}, "value": value, "restored": restored})
        return rows

    def to_dict(self) -> dict[str, Any]:
        """Every field, ``has_effect``, ``gap_tolerance`` and ``restored`` (None without effect), strict-JSON-ready."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        return to_json({**data, "has_effect": self.has_effect, "gap_tolerance": self.gap_tolerance,
                        "restored": self.restored if self.has_effect else None}, digits=None)

    def top(self, n: int = 5) -> list[tuple[dict[str, int], float]]:
        """The ``n`` components that restore the most, as ``({axis: index}, restored)``."""
        flat = self.restored.flatten()
        order = flat.argsort(descending=True)[:n]
        out = []
        for idx in order.tolist():
            multi = torch.unravel_index(torch.tensor(idx), self.values.shape)
            out.append(({a: self.coords[a][int(i)] for a, i in zip(self.axes, multi)}, float(flat[idx])))
        return out

def patch_sink(
    model: Any, tokens: Inputs, hooks: Hooks, *, target: IntLike = 0, site: PatchSite = "resid_pre",
    layers: IndexLike | None = None, positions: IndexLike | None = None,
    heads: IndexLike | None = None, metric_layers: IndexLike | None = None,
    options: RunOptions = RunOptions(progress=False),
) -> SinkPatchResult:
    """Patch clean activations into the intervened run (``hooks``), one component at a time, and measure the
    sink. ``tokens``: one batch of equal length; ``site``: ``"resid_pre"``/``"resid_mid"``/``"attn_out"``/
    ``"mlp_out"`` (layer × position), ``"z"`` (layer × head) or ``"z_pos"`` (layer × position × head);
    ``layers``, ``positions``, ``heads`` restrict the components (one forward each)."""
    options = checked_options(options, "patch_sink")
    site = choice(site, sorted(_SITES), what="site")
    hooks = list(hook_pairs(hooks, what="hooks"))
    axes = _SITES[site][1]
    dims = model_dims(model)
    (batch,) = as_batches(model, tokens, batch_size=10**9, prepend_bos=options.prepend_bos,
                          max_length=options.max_length)
    if not bool(batch.valid.all()):
        raise InvalidArgumentError("patch_sink needs sequences of equal length (no padding): pass a [batch, pos] "
                                   "tensor or equal-length texts.")
    n_pos = batch.tokens.shape[1]
    target = index(target, dims.n_ctx, what="target position", allow_negative=False)
    if target >= n_pos - 1:
        raise InvalidArgumentError(
            f"Target {target} needs later queries: use sequences longer than {target + 1} tokens (got {n_pos}).")
    coords: dict[str, list[int]] = {"layer": layers_arg(layers, dims.n_layers)}
    if "pos" in axes:
        coords["pos"] = list(range(n_pos)) if positions is None else positions_arg(positions, n_pos)
    if "head" in axes:
        coords["head"] = list(range(dims.n_heads)) if heads is None else heads_arg(heads, dims.n_heads)
    metric_layers = layers_arg(metric_layers, dims.n_layers)
    patch_names = patch_hook_names(model, site, coords["layer"])
    names = sorted(set(patch_names.values()))
    check_hook_names(model, names + [name for name, _ in hooks])

    reducer = AttentionReceivedReducer(model, layers=metric_layers, min_query=target + 1)
    fold = reducer.fwd_hooks(batch)

    def run(fwd_hooks: Hooks) -> float:
        """The metric of one forward with ``fwd_hooks``; then a fresh reducer."""
        with model.hooks(fwd_hooks=fwd_hooks + fold.hooks):
            model(batch.tokens, return_type=None)
        reducer.end_batch(batch, fold)
        value = float(reducer.result().at(target).double().mean())
        reducer.reset()
        return value

    clean_acts: dict[str, Tensor] = {}
    pattern_dtype: list[torch.dtype] = []

    def keep(act: Tensor, hook: Any, name: str) -> None:
        clean_acts[name] = act.detach().clone()

    keep_hooks = [(n, lambda act, hook, n=n: keep(act, hook, n)) for n in names]
    keep_hooks.append((hook_name(metric_layers[0], PATTERN), lambda pat, hook: pattern_dtype.append(pat.dtype)))
    values = torch.zeros([len(v) for v in coords.values()], dtype=torch.float64)
    with torch.inference_mode(), exclusive_use(model), eval_mode(model):  # no dropout, as streaming runs
        clean = run(keep_hooks)
        hooks = on_the_residual_stream(model, hooks)
        intervened = run(hooks)
        grid = list(itertools.product(*(range(len(v)) for v in coords.values())))
        for cell in tqdm(grid, desc="patch", disable=not options.progress, leave=False):
            name = patch_names[coords["layer"][cell[0]]]
            at = dict(zip(axes, (coords[a][i] for a, i in zip(axes, cell[1:]))))
            idx = (slice(None), at.get("pos", slice(None)), *([at["head"]] if "head" in at else []))

            def patch(act: Tensor, hook: Any, name: str = name, idx: tuple = idx) -> Tensor:
                out = act.clone()
                out[idx] = clean_acts[name][idx]
                return out

            values[cell] = run(hooks + on_the_residual_stream(model, [(name, patch)]))
    return SinkPatchResult(
        site=site, axes=("layer", *axes), coords=coords, values=values, clean=clean, intervened=intervened,
        target=target, metric_layers=metric_layers,
        pattern_dtype=str(pattern_dtype[0] if pattern_dtype else model_dtype(model)).removeprefix("torch."),
    )
