"""Sink metrics tracked during training: one :func:`sinklens.streaming.stream` pass over held-out batches runs
the sink, first-token norm and variance reducers; :func:`evaluate` adds the validation loss."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.analysis._common import method_for_hooks
from sinklens.analysis.qk_attention import qk_plan
from sinklens.analysis.sinks import SinkReducer, SinkSettings
from sinklens.analysis.variance import VarianceReducer
from sinklens.display import CompactRepr
from sinklens.hooks import RESID_POST, eval_mode, model_device, model_dims
from sinklens.inputs import TokenBatch
from sinklens.options import SINK_THRESHOLD, HookFn, RunOptions
from sinklens.streaming import BatchFold, Reducer, per_layer_hooks, stream
from sinklens.sinklm.functional import next_token_loss


class FirstTokenNormReducer(Reducer[Float[Tensor, " layer"]]):
    """``norm_ratio[l]``: mean ``‖resid_post[l, 0]‖`` over sequences, divided by the mean over sequences and valid
    positions ``t >= 1`` of ``‖resid_post[l, t]‖`` (``blocks.{l}.hook_resid_post``); ≫ 1 with massive activations."""

    statistics = ("sums", "counts")

    def __init__(self, model: Any):
        self.n_layers = model_dims(model).n_layers
        self.device = model_device(model)
        self.reset()

    def reset(self) -> None:
        self.sums = torch.zeros(2, self.n_layers, dtype=torch.float64, device=self.device)  # first, later
        self.counts = torch.zeros(2, dtype=torch.float64, device=self.device)  # sequences, later positions

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        later = batch.valid[:, 1:].to(torch.float64)  # (B, T-1): the positions t >= 1 that count

        def fold(act: Tensor, layer: int) -> None:  # act: [batch, pos, d_model]
            norms = act.float().norm(dim=-1).double()
            self.sums[0, layer] += norms[:, 0].sum()
            self.sums[1, layer] += (norms[:, 1:] * later).sum()

        return BatchFold(per_layer_hooks(RESID_POST, range(self.n_layers), fold), state=later)

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        self.counts[0] += batch.tokens.shape[0]
        self.counts[1] += fold.state.sum()

    def result(self) -> Float[Tensor, " layer"]:
        return ((self.sums[0] / self.counts[0]) / (self.sums[1] / self.counts[1])).float().cpu()


@dataclass(repr=False, eq=False)
class SinkMetrics(CompactRepr):
    """Sink metrics of one evaluation.

    Attributes:
        val_loss: mean next-token cross-entropy over the evaluation batches (nats).
        attention_to_first: ``[layer, head]`` mean attention on key 0 over the queries ``q >= 1`` that see it.
        sink_rate: Gu et al. (2024)'s sink rate as their code computes it (``SinkResult.sink_rate(method="gu")``,
            query 0 included): share of (sequence, layer, head) over ε (:func:`evaluate`'s ``threshold``).
        sinklens_sink_rate: the same over the queries ``q >= 1`` (``method="sinklens"``).
        norm_ratio: ``[layer]`` first-token norm ratio of ``hook_resid_post`` (:class:`FirstTokenNormReducer`).
        variance_ratio: ``[layer, head]`` variance of ``hook_z`` at position 0 over the mean at ``t >= 1``.
        attn_out_variance_ratio: ``[layer]`` the same for ``hook_attn_out`` (after the variant and ``W_O``).
        attention_path: where the sink statistics read attention: ``"qk"`` (queries and keys) or ``"pattern"``."""

    val_loss: float
    attention_to_first: Float[Tensor, "layer head"]
    sink_rate: float
    sinklens_sink_rate: float
    norm_ratio: Float[Tensor, " layer"]
    variance_ratio: Float[Tensor, "layer head"]
    attn_out_variance_ratio: Float[Tensor, " layer"]
    attention_path: str = "pattern"

    def scalars(self) -> dict[str, float]:
        """Flat numbers for a metrics line: ``attn_to_first`` and ``variance_ratio`` are means over
        layers and heads, ``first_token_norm_ratio`` and ``attn_out_variance_ratio`` maxima over layers."""
        return {
            "val_loss": self.val_loss,
            "sink_rate": self.sink_rate,
            "sinklens_sink_rate": self.sinklens_sink_rate,
            "attn_to_first": float(self.attention_to_first.mean()),
            "first_token_norm_ratio": float(self.norm_ratio.max()),
            "variance_ratio": float(self.variance_ratio.mean()),
            "attn_out_variance_ratio": float(self.attn_out_variance_ratio.max()),
        }


def evaluate(
    model: Any,
    batches: Sequence[TokenBatch],
    targets: Sequence[Tensor],
    *,
    threshold: float = SINK_THRESHOLD,
    extra_hooks: Sequence[tuple[str, HookFn]] = (),
) -> SinkMetrics:
    """:class:`SinkMetrics` of ``model`` on fixed ``batches`` and next-token ``targets``, with ``extra_hooks`` (the
    training-time interventions) attached; attention is read from queries and keys where the hooks allow."""
    method = method_for_hooks("auto", extra_hooks)
    if method == "auto":
        method = "qk" if qk_plan(model, range(model_dims(model).n_layers), "auto").sites is not None else "pattern"
    with eval_mode(model):
        with torch.inference_mode(), model.hooks(fwd_hooks=list(extra_hooks)):
            losses = [next_token_loss(model(batch.tokens, return_type="logits"), target)
                      for batch, target in zip(batches, targets)]
        reducers = [SinkReducer(model, settings=SinkSettings(threshold, min_query=1, top_k=0, method=method)),
                    FirstTokenNormReducer(model), VarianceReducer(model, method=method)]
        sinks, norms, variance = stream(model, batches, reducers,
                                        options=RunOptions(progress=False, extra_hooks=tuple(extra_hooks)))
    return SinkMetrics(
        val_loss=float(torch.stack(losses).mean()),
        attention_to_first=sinks.received[:, :, 0],
        sink_rate=sinks.sink_rate(position=0, method="gu"),
        sinklens_sink_rate=sinks.sink_rate(position=0, method="sinklens"),
        norm_ratio=norms,
        variance_ratio=variance.discrepancy(0, of="z"),
        attn_out_variance_ratio=variance.discrepancy(0, of="attn_out"),
        attention_path=sinks.attention_path,
    )
