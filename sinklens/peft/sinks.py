"""How much of each head a prefix takes, against the input's length (the trade-off of arXiv 2506.13674): with
fixed scores, a query at position ``i`` puts ``Σ_p e^{s_p} / (Σ_p e^{s_p} + Σ_{j≤i} e^{s_j})`` on ``P`` prefix keys.
Per adapter, input length, layer and head, means over rows and queries from position 1:

* ``prefix_mass``: attention on the prefix keys (prefix-tuning; NaN for other methods);
* ``output_share``: ``|prefix part| / (|prefix part| + |input part|)`` of the head output at ``hook_z``; the
  prefix part is ``Σ_p A_p v_p`` (prefix-tuning) or ``φ(q)ᵀM`` (Prefix-Tuning+);
* ``pos0_mass`` (with the adapter) beside ``base_pos0_mass`` (without): a prefix that takes over the
  position-0 sink lowers the first."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.display import CompactRepr
from sinklens.errors import InvalidArgumentError
from sinklens.hooks import PATTERN, eval_mode, hook_name, layer_of, model_device, model_dims
from sinklens.peft.adapters import Adapter, PrefixTuning, adapted
from sinklens.validate import index_list


@dataclass(repr=False, eq=False)
class PrefixSinks(CompactRepr):
    """Prefix shares per adapter, input length, layer and head (module docstring); ``labels[a]`` names adapter
    ``a`` (``"prefix P=8"``, ``"prefix-plus"``)."""

    labels: list[str]
    input_lengths: list[int]
    prefix_mass: Float[Tensor, "adapter input layer head"]
    output_share: Float[Tensor, "adapter input layer head"]
    pos0_mass: Float[Tensor, "adapter input layer head"]
    base_pos0_mass: Float[Tensor, "input layer head"]

    def mean(self, name: str) -> Tensor:
        """The named field averaged over layers and heads."""
        return getattr(self, name).mean(dim=(-2, -1))

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    def summary(self) -> str:
        lines = [f"{'adapter':<16} {'n':>5} {'prefix mass':>12} {'output share':>13} {'pos0 mass':>10} {'base pos0':>10}"]
        pm, sh, p0, b0 = (self.mean(n) for n in ("prefix_mass", "output_share", "pos0_mass", "base_pos0_mass"))
        for a, label in enumerate(self.labels):
            for j, n in enumerate(self.input_lengths):
                mass = "-" if math.isnan(float(pm[a, j])) else f"{float(pm[a, j]):.3f}"
                lines.append(f"{label:<16} {n:>5} {mass:>12} {float(sh[a, j]):>13.3f} {float(p0[a, j]):>10.3f} {float(b0[j]):>10.3f}")
        return "\n".join(lines)


def _label(adapter: Adapter) -> str:
    return f"prefix P={adapter.n_prefix}" if isinstance(adapter, PrefixTuning) else adapter.method


@torch.no_grad()
def measure_prefix_sinks(model: Any, adapters: Sequence[Adapter], tokens: Tensor, *,
                         input_lengths: Sequence[int]) -> PrefixSinks:
    """Each adapter's shares on ``tokens[:, :n]`` for every ``n`` in ``input_lengths`` (adapters on all layers)."""
    dims = model_dims(model)
    if not adapters:
        raise InvalidArgumentError("measure_prefix_sinks needs at least one adapter.")
    for a in adapters:
        if a.layers != list(range(dims.n_layers)):
            raise InvalidArgumentError(f"adapter {_label(a)!r} covers layers {a.layers}; the measurement needs all "
                                       f"{dims.n_layers} layers.")
    lengths = sorted(set(index_list(input_lengths, tokens.shape[1] + 1, what="input length", allow_negative=False)))
    if not lengths or lengths[0] < 2:
        raise InvalidArgumentError(f"input lengths must be at least 2 tokens, got {list(input_lengths)}.")
    device, tokens = model_device(model), tokens.to(model_device(model))
    shape = (len(adapters), len(lengths), dims.n_layers, dims.n_heads)
    prefix_mass = torch.full(shape, float("nan"), device=device)
    output_share, pos0_mass = torch.zeros(shape, device=device), torch.zeros(shape, device=device)
    base_pos0 = torch.zeros(shape[1:], device=device)
    pos0: dict[int, Tensor] = {}

    def take_pos0(pattern: Tensor, hook: Any) -> None:  # [batch, head, query, key]: queries from 1 on
        pos0[layer_of(hook.name)] = pattern[:, :, 1:, 0].float().mean(dim=(0, 2))

    pattern_hooks = [(hook_name(layer, PATTERN), take_pos0) for layer in range(dims.n_layers)]
    with eval_mode(model):
        for j, n in enumerate(lengths):
            with model.hooks(fwd_hooks=pattern_hooks):
                model(tokens[:, :n])
            base_pos0[j] = torch.stack([pos0[layer] for layer in range(dims.n_layers)])
            for a, adapter in enumerate(adapters):
                adapter.record = {}
                try:
                    with model.hooks(fwd_hooks=pattern_hooks), adapted(model, adapter):
                        model(tokens[:, :n])
                    rec = adapter.record
                finally:
                    adapter.record = None
                for layer in range(dims.n_layers):
                    count = rec[layer, "n_queries"]
                    output_share[a, j, layer] = rec[layer, "output_share"] / count
                    if isinstance(adapter, PrefixTuning):
                        prefix_mass[a, j, layer] = rec[layer, "prefix_mass"] / count
                        pos0_mass[a, j, layer] = rec[layer, "pos0_mass"] / count
                    else:
                        pos0_mass[a, j, layer] = pos0[layer]
    return PrefixSinks([_label(a) for a in adapters], lengths, prefix_mass.cpu(), output_share.cpu(), pos0_mass.cpu(),
                       base_pos0.cpu())
