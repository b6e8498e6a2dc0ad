"""Dimension disparity after normalisation: does the sink's massive dimension survive the norm?

With ``m_d = mean_{j != d} |x_j|``, a ratio is ``mean |x_d| / mean m_d`` over the sink tokens (``ratio_sink``, as
the paper's code: Siquan-Li/Head-wise-RMSNorm@23793e0 ``attention_sink.ipynb`` cell 16) or the other valid tokens
(``ratio_other``); ``ratio_other_max``: the largest per-token ``|x_d| / m_d``. Read on the norm layer ``l``'s
attention reads, before its gain (``hook_normalized``) and after it (``*_after_gain``: ``gain ⊙ hook_normalized +
bias``, as the paper)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.analysis._common import TINY as _TINY
from sinklens.analysis._common import check_sink_position, once_per_forward, other_positions, row_index, run_analyzer, sink_position_arg
from sinklens.display import CompactRepr
from sinklens.errors import InvalidArgumentError
from sinklens.export import to_json
from sinklens.hooks import model_device, model_dims, resolve_layers
from sinklens.inputs import Inputs, TokenBatch
from sinklens.options import RunOptions
from sinklens.residual_units import input_norm
from sinklens.streaming import BatchFold, Reducer, bound_hooks


@dataclass(repr=False, eq=False)
class NormalizedDisparity(CompactRepr):
    """Dimension disparity of the attention's input norm, before and after its gain (module docstring); ``site``:
    ``"ln1.hook_normalized"``, or on a post-LN model which norm each layer reads (``norms``: their module paths)."""

    layers: list[int]
    sink_position: int
    site: str
    ratio_sink: Float[Tensor, "layer dim"]
    ratio_other: Float[Tensor, "layer dim"]
    ratio_other_max: Float[Tensor, "layer dim"]
    n_sequences: int
    ratio_sink_after_gain: Float[Tensor, "layer dim"]
    ratio_other_after_gain: Float[Tensor, "layer dim"]
    ratio_other_max_after_gain: Float[Tensor, "layer dim"]
    norms: list[str]

    #: Where each pair of numbers is read (shown in the JSON).
    SOURCES = {
        "before_gain": "sinklens: the attention's input norm's hook_normalized (normalised, before the learned gain)",
        "after_gain": "the paper's: that norm's output = gain * hook_normalized + bias (after the gain)",
    }

    def top_dim(self, layer: int) -> int:
        """The dimension with the largest sink ratio at ``layer``."""
        return int(self.ratio_sink[row_index(self.layers, layer)].argmax())

    def rows(self, dims: list[int] | None = None) -> list[dict[str, Any]]:
        """Per layer (× dim; default the layer's top sink dim): the ratios and sink/other contrasts."""
        out = []
        for i, layer in enumerate(self.layers):
            for d in dims if dims is not None else [self.top_dim(layer)]:
                row = {"layer": layer, "dim": d}
                for sfx in ("", "_after_gain"):
                    sink, other, top = (float(getattr(self, f"ratio_{k}{sfx}")[i, d]) for k in ("sink", "other", "other_max"))
                    row |= {f"ratio_sink{sfx}": sink, f"ratio_other{sfx}": other, f"ratio_other_max{sfx}": top,
                            f"contrast{sfx}": sink / other if other > 0 else float("inf")}
                out.append(row)
        return out

    def to_dict(self, dims: list[int] | None = None) -> dict[str, Any]:
        return to_json({"layers": self.layers, "sink_position": self.sink_position, "site": self.site, "norms": self.norms,
                        "sources": self.SOURCES, "n_sequences": self.n_sequences, "rows": self.rows(dims)})


class NormalizedDisparityReducer(Reducer[NormalizedDisparity]):
    """Streams each layer's attention input norm's ``hook_normalized`` into ``[before/after gain, layer, dim]`` sums
    of ``|x_d|`` and ``m_d`` and a running max of ``|x_d| / m_d``."""

    statistics = ("sink_abs", "sink_rest", "other_abs", "other_rest", "other_max", "n_sequences", "n_other")
    maxima = ("other_max",)

    def __init__(self, model: Any, *, sink_position: int = 0, layers: int | Sequence[int] | None = None):
        d = model_dims(model)
        self.layers = resolve_layers(layers, d.n_layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.sink, self.d_model, self.device = sink_position_arg(sink_position), d.d_model, model_device(model)
        self.maps = {layer: input_norm(model, layer, "attn") for layer in self.layers}
        pre_norm = all(m.path == f"blocks.{m.layer}.ln1" for m in self.maps.values())
        self.site = "ln1.hook_normalized" if pre_norm else "post-LN: " + ", ".join(
            f"layer {layer} reads {m.path}" for layer, m in self.maps.items())
        self.reset()

    def reset(self) -> None:
        n, dev = len(self.layers), self.device
        self.sink_abs, self.sink_rest, self.other_abs, self.other_rest = (
            torch.zeros(2, n, self.d_model, device=dev, dtype=torch.float64) for _ in range(4))
        self.other_max = torch.zeros(2, n, self.d_model, device=dev, dtype=torch.float32)
        self.n_sequences = self.n_other = 0

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        check_sink_position(batch, self.sink)
        other = other_positions(batch, self.sink)

        def fold(act: Tensor, layer: int) -> None:  # [batch, pos, d_model]
            if act.ndim == 4:  # TL 3.x use_split_qkv_input: [batch, pos, head, d_model], one equal copy per head
                act = act[:, :, 0]
            i, x, pm = self.row[layer], act.float(), self.maps[layer]
            a = torch.stack((x, x * pm.gain.float().to(x.device) + pm.offset(x))).abs_()  # [before/after gain, ...]
            n_rest = a.shape[-1] - 1
            total = a.sum(-1, keepdim=True)  # Σ_j |x_j| per token
            rest = (total - a) / n_rest  # m_d
            self.sink_abs[:, i] += a[:, :, self.sink].sum(1).double()
            self.sink_rest[:, i] += rest[:, :, self.sink].sum(1).double()
            weight = other.to(a.dtype)  # [batch, pos]: the other valid tokens
            abs_other = torch.einsum("kbpd,bp->kd", a, weight)  # Σ over those tokens of |x_d|
            total_other = torch.einsum("kbp,bp->k", total.squeeze(-1), weight)
            self.other_abs[:, i] += abs_other.double()
            self.other_rest[:, i] += ((total_other[:, None] - abs_other) / n_rest).double()  # Σ m_d, without m itself
            per_token = a.div_(rest.clamp_min_(_TINY)).mul_(weight[None, :, :, None])  # |x_d| / m_d, 0 off the others
            self.other_max[:, i] = torch.maximum(self.other_max[:, i], per_token.amax(dim=(1, 2)))

        # TL 3.x runs ln1.hook_normalized once per q/k/v input: fold the first call only.
        names = [f"{self.maps[layer].path}.hook_normalized" for layer in self.layers]
        return BatchFold(bound_hooks(names, self.layers, once_per_forward(fold)))

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        self.n_sequences += batch.valid.shape[0]
        self.n_other += int(other_positions(batch, self.sink).sum())

    def result(self) -> NormalizedDisparity:
        if self.n_sequences == 0:
            raise InvalidArgumentError("No batches were streamed; nothing to summarise.")
        sink = (self.sink_abs / self.sink_rest.clamp_min(_TINY)).float().cpu()
        other = (self.other_abs / self.other_rest.clamp_min(_TINY) if self.n_other
                 else torch.full_like(self.other_abs, float("nan"))).float().cpu()
        return NormalizedDisparity(
            list(self.layers), self.sink, self.site, sink[0], other[0], self.other_max[0].cpu(), self.n_sequences,
            ratio_sink_after_gain=sink[1], ratio_other_after_gain=other[1],
            ratio_other_max_after_gain=self.other_max[1].cpu(), norms=[self.maps[layer].path for layer in self.layers],
        )


def normalized_disparity(model: Any, inputs: Inputs | None = None, *, sink_position: int = 0,
                         layers: int | Sequence[int] | None = None,
                         options: RunOptions = RunOptions()) -> NormalizedDisparity:
    """Dimension disparity of each layer's attention input norm at the sink vs other tokens, before and after its
    gain; warns when the model's norms have no gain (``fold_ln``).

    Examples:
        >>> from sinklens.testing.planted import planted_model
        >>> model, spec = planted_model(n_layers=2, layer=0, dim=5)
        >>> nd = normalized_disparity(model, "t3 t4 t5 t6")
        >>> nd.top_dim(1), bool(nd.ratio_sink[1, 5] > 100), float(nd.ratio_other[1, 5])
        (5, True, 0.0)
    """
    if str(getattr(model.cfg, "normalization_type", "")).endswith("Pre"):
        warnings.warn(f"normalized_disparity: this model's norms have no gain (cfg.normalization_type="
                      f"{model.cfg.normalization_type!r}, fold_ln), so the after-gain ratios equal the before-gain ones; "
                      "load it without weight processing (sinklens.load_model) for the paper's numbers.",
                      RuntimeWarning, stacklevel=2)
    return run_analyzer(model, inputs, NormalizedDisparityReducer, where="normalized_disparity", options=options,
                        sink_position=sink_position, layers=layers)
