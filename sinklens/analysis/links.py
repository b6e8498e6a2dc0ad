"""Mechanism links between super neurons, massive dimensions and the attention sink.

* **(b) Super neurons from weights** (:func:`super_neurons_from_weights`, no forward pass): each FFN neuron's
  read vectors (``W_in[l, :, n]``, ``W_gate[l, :, n]``) and write vector (``W_out[l, n, :]``) compared with its
  layer's typical neuron (norm / median norm), the channel sparsity of ``W_out`` rows, and — given a
  :class:`SinkInput` from one cheap forward — the cosine between the sink token's normalised MLP input
  (``ln2.hook_normalized``) and each read vector.
* **(c) Disparity after normalisation** (:func:`normalized_disparity`): in ``ln1.hook_normalized`` (what the
  next layer's queries, keys and values read), the ratio of each dimension's ``|x_d|`` to the mean ``|x_j|`` of
  the token's other dimensions, at the sink vs at other tokens.
* **(d) Query–key locking** (:func:`query_key_locking`): per layer × head, how well the sink token's key lines up
  with the queries of the other positions, and how often queries score the sink key positively compared with
  other keys.

``hook_normalized`` is the normalised vector *before* the norm's learned gain (and bias), on every
TransformerLens version.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.analysis._common import check_sink_position, once_per_forward, run_reducer, to_json
from sinklens.analysis.neurons import row_sparsity
from sinklens.hooks import (
    K,
    LN1_NORMALIZED,
    LN2_NORMALIZED,
    Q,
    SCORES,
    expand_kv_heads,
    hook_name,
    model_device,
    model_dims,
    resolve_layers,
    weight,
)
from sinklens.inputs import Inputs, TokenBatch
from sinklens.streaming import HookFn, Reducer

#: Rotary models expose the rotated queries/keys (what the scores are made of) under these sites.
ROT_Q = "attn.hook_rot_q"
ROT_K = "attn.hook_rot_k"
_TINY = 1e-12


def _check_sink(sink_position: int) -> None:
    if not isinstance(sink_position, int) or sink_position < 0:
        raise ValueError(f"sink_position must be an int >= 0, got {sink_position!r}.")


def _median_ratio(x: Float[Tensor, "layer neuron"]) -> Float[Tensor, "layer neuron"]:
    return x / x.median(dim=-1, keepdim=True).values.clamp_min(_TINY)


# ---------------------------------------------------------------------------------------------- (b) weights


@dataclass
class SinkInput:
    """Mean over sequences of a normalised hook (default ``ln2.hook_normalized``) at the sink position."""

    layers: list[int]
    sink_position: int
    site: str
    x: Float[Tensor, "layer d_model"]


class SinkInputReducer(Reducer):
    """Streams ``blocks.{l}.<site>`` at ``sink_position`` into a per-layer mean (:class:`SinkInput`)."""

    def __init__(self, model: Any, *, sink_position: int = 0, layers: int | list[int] | None = None, site: str = LN2_NORMALIZED):
        _check_sink(sink_position)
        dims = model_dims(model)
        self.layers = resolve_layers(layers, dims.n_layers)
        self.sink, self.site = sink_position, site
        self.sums = torch.zeros(len(self.layers), dims.d_model, device=model_device(model), dtype=torch.float64)
        self.n = 0

    def fwd_hooks(self, batch: TokenBatch) -> list[tuple[str, HookFn]]:
        check_sink_position(batch, self.sink)

        def fold(act: Tensor, hook: Any, i: int) -> None:  # [batch, pos, d_model]
            self.sums[i] += act[:, self.sink].double().sum(0)

        fold = once_per_forward(fold)  # TL 3.x runs ln1.hook_normalized once per q/k/v input
        return [(hook_name(layer, self.site), functools.partial(fold, i=i)) for i, layer in enumerate(self.layers)]

    def end_batch(self, batch: TokenBatch) -> None:
        self.n += batch.valid.shape[0]

    def result(self) -> SinkInput:
        if self.n == 0:
            raise ValueError("No batches were streamed; nothing to summarise.")
        return SinkInput(list(self.layers), self.sink, self.site, (self.sums / self.n).float().cpu())


def sink_inputs(
    model: Any,
    inputs: Inputs | None = None,
    *,
    sink_position: int = 0,
    layers: int | list[int] | None = None,
    batch_size: int = 8,
    prepend_bos: bool = True,
    max_length: int | None = None,
    progress: bool = False,
) -> SinkInput:
    """Mean ``ln2.hook_normalized`` at ``sink_position`` per layer (the input every FFN neuron reads there)."""
    reducer = SinkInputReducer(model, sink_position=sink_position, layers=layers)
    return run_reducer(model, inputs, reducer, batch_size=batch_size, prepend_bos=prepend_bos,
                       max_length=max_length, progress=progress)


@dataclass
class WeightNeurons:
    """Weight-only super-neuron statistics per layer × neuron (see the module docstring, (b)).

    Attributes:
        in_norm / gate_norm / out_norm: L2 norms of ``W_in[l, :, n]``, ``W_gate[l, :, n]`` (None without a gated
            MLP) and ``W_out[l, n, :]``; ``*_ratio``: the same divided by the layer's median neuron.
        out_kurtosis / out_top_share: channel sparsity of ``W_out[l, n, :]`` (kurtosis; share of its squared norm
            in the ``row_top_k`` largest entries).
        score: ``in_norm_ratio × gate_norm_ratio × out_norm_ratio`` (gate factor 1 when not gated): how much
            larger than typical the neuron's read and write vectors are. Ranking key of :meth:`top`.
        align_in / align_gate: cosine between the sink's mean ``ln2.hook_normalized`` and ``W_in[l, :, n]`` /
            ``W_gate[l, :, n]`` (None unless a :class:`SinkInput` was given).
        dims / out_dim_weight: ``W_out[l, n, d]`` for each requested dimension ``d``.
    """

    layers: list[int]
    in_norm: Float[Tensor, "layer neuron"]
    gate_norm: Float[Tensor, "layer neuron"] | None
    out_norm: Float[Tensor, "layer neuron"]
    in_norm_ratio: Float[Tensor, "layer neuron"]
    gate_norm_ratio: Float[Tensor, "layer neuron"] | None
    out_norm_ratio: Float[Tensor, "layer neuron"]
    out_kurtosis: Float[Tensor, "layer neuron"]
    out_top_share: Float[Tensor, "layer neuron"]
    row_top_k: int
    score: Float[Tensor, "layer neuron"]
    align_in: Float[Tensor, "layer neuron"] | None
    align_gate: Float[Tensor, "layer neuron"] | None
    dims: list[int]
    out_dim_weight: Float[Tensor, "layer neuron n_dims"]
    sink_position: int | None = None

    def top(self, k: int = 10) -> list[tuple[int, int, float]]:
        """``(layer, neuron, score)`` of the ``k`` highest-scoring neurons."""
        vals, idx = self.score.flatten().topk(min(k, self.score.numel()))
        n = self.score.shape[1]
        return [(self.layers[int(i) // n], int(i) % n, float(v)) for i, v in zip(idx, vals)]

    def neuron_row(self, layer: int, neuron: int) -> dict[str, Any]:
        """All statistics of one neuron as a dict."""
        if layer not in self.layers:
            raise ValueError(f"Layer {layer} was not analysed; analysed layers: {self.layers}.")
        r = self.layers.index(layer)
        row: dict[str, Any] = {"layer": layer, "neuron": neuron}
        for name in ("in_norm", "gate_norm", "out_norm", "in_norm_ratio", "gate_norm_ratio", "out_norm_ratio",
                     "out_kurtosis", "out_top_share", "score", "align_in", "align_gate"):
            t = getattr(self, name)
            row[name] = None if t is None else float(t[r, neuron])
        for j, d in enumerate(self.dims):
            row[f"out_weight_{d}"] = float(self.out_dim_weight[r, neuron, j])
        return row

    def rows(self, k: int = 20) -> list[dict[str, Any]]:
        """DataFrame-ready rows of the ``k`` top-scoring neurons, with their rank."""
        return [{"rank": i} | self.neuron_row(l, n) for i, (l, n, _) in enumerate(self.top(k))]

    def to_dict(self, k: int = 20) -> dict[str, Any]:
        return to_json({"layers": self.layers, "dims": self.dims, "row_top_k": self.row_top_k,
                        "sink_position": self.sink_position, "rows": self.rows(k)})


def _cosine_rows(x: Float[Tensor, "layer d"], w: Float[Tensor, "layer d neuron"]) -> Float[Tensor, "layer neuron"]:
    num = torch.einsum("ld,ldn->ln", x, w)
    return num / (x.norm(dim=-1, keepdim=True) * w.norm(dim=1)).clamp_min(_TINY)


def super_neurons_from_weights(
    model: Any,
    *,
    layers: int | list[int] | None = None,
    dims: list[int] | None = None,
    sink_input: SinkInput | None = None,
    row_top_k: int = 1,
    w_out_sparsity: tuple[Tensor, Tensor] | None = None,
) -> WeightNeurons:
    """Rank FFN neurons as super-neuron candidates from their weights alone (no forward pass).

    Args:
        layers: model layers to analyse (None = all).
        dims: residual dimensions whose ``W_out`` entries to report (e.g. the massive dims).
        sink_input: a :class:`SinkInput` (from :func:`sink_inputs`) to add the read-vector alignments.
        row_top_k: entries counted in ``out_top_share``.
        w_out_sparsity: ``(kurtosis, top-k share)`` of these layers' ``W_out`` rows, as
            :func:`sinklens.analysis.neurons.row_sparsity` gives them, if already computed.

    Examples:
        >>> from sinklens.testing.planted import planted_model
        >>> model, spec = planted_model(n_layers=2, layer=0, neuron=7, dim=5)
        >>> super_neurons_from_weights(model).top(1)[0][:2]
        (0, 7)
    """
    d = model_dims(model)
    layer_list = resolve_layers(layers, d.n_layers)
    if not 1 <= row_top_k <= d.d_model:
        raise ValueError(f"row_top_k must be in [1, {d.d_model}] (d_model), got {row_top_k}.")
    dims = [int(x) for x in (dims or [])]
    bad = [x for x in dims if not 0 <= x < d.d_model]
    if bad:
        raise ValueError(f"dims {bad} are out of range for d_model={d.d_model} (0..{d.d_model - 1}).")
    W_in = weight(model, "W_in")[layer_list].float().cpu()  # [layer, d_model, neuron]
    W_out = weight(model, "W_out")[layer_list].float().cpu()  # [layer, neuron, d_model]
    try:
        W_gate = weight(model, "W_gate")[layer_list].float().cpu()
    except AttributeError:
        W_gate = None
    in_norm, out_norm = W_in.norm(dim=1), W_out.norm(dim=-1)
    gate_norm = None if W_gate is None else W_gate.norm(dim=1)
    in_ratio, out_ratio = _median_ratio(in_norm), _median_ratio(out_norm)
    gate_ratio = None if gate_norm is None else _median_ratio(gate_norm)
    score = in_ratio * out_ratio * (gate_ratio if gate_ratio is not None else 1.0)
    # Reuse (kurtosis, top-k share) of these W_out rows when the caller already has them (analyze does).
    kurt, share = w_out_sparsity if w_out_sparsity is not None else row_sparsity(W_out, row_top_k)
    align_in = align_gate = None
    if sink_input is not None:
        missing = [l for l in layer_list if l not in sink_input.layers]
        if missing:
            raise ValueError(f"sink_input has no layers {missing}; it covers {sink_input.layers}.")
        x = sink_input.x[[sink_input.layers.index(l) for l in layer_list]].float()
        align_in = _cosine_rows(x, W_in)
        align_gate = None if W_gate is None else _cosine_rows(x, W_gate)
    return WeightNeurons(
        layers=layer_list, in_norm=in_norm, gate_norm=gate_norm, out_norm=out_norm, in_norm_ratio=in_ratio,
        gate_norm_ratio=gate_ratio, out_norm_ratio=out_ratio, out_kurtosis=kurt, out_top_share=share,
        row_top_k=row_top_k, score=score, align_in=align_in, align_gate=align_gate, dims=dims,
        out_dim_weight=W_out[:, :, dims], sink_position=None if sink_input is None else sink_input.sink_position,
    )


# --------------------------------------------------------------------------------- (c) normalised disparity


@dataclass
class NormalizedDisparity:
    """Dimension disparity in ``ln1.hook_normalized`` (see the module docstring, (c)).

    For a token's normalised vector ``x``, ``r_d = |x_d| / mean_{j != d} |x_j|``.

    Attributes:
        ratio_sink: mean over sequences of ``r_d`` at ``sink_position``.
        ratio_other: mean of ``r_d`` over all other valid tokens; ``ratio_other_max``: its maximum.
    """

    layers: list[int]
    sink_position: int
    site: str
    ratio_sink: Float[Tensor, "layer dim"]
    ratio_other: Float[Tensor, "layer dim"]
    ratio_other_max: Float[Tensor, "layer dim"]
    n_sequences: int

    def top_dim(self, layer: int) -> int:
        """The dimension with the largest sink ratio at ``layer``."""
        return int(self.ratio_sink[self._row(layer)].argmax())

    def _row(self, layer: int) -> int:
        if layer not in self.layers:
            raise ValueError(f"Layer {layer} was not analysed; analysed layers: {self.layers}.")
        return self.layers.index(layer)

    def rows(self, dims: list[int] | None = None) -> list[dict[str, Any]]:
        """Per layer (× dim; default the layer's top sink dim): ratio at the sink, at other tokens, and their quotient."""
        out = []
        for i, layer in enumerate(self.layers):
            for d in dims if dims is not None else [self.top_dim(layer)]:
                sink, other = float(self.ratio_sink[i, d]), float(self.ratio_other[i, d])
                out.append({"layer": layer, "dim": d, "ratio_sink": sink, "ratio_other": other,
                            "ratio_other_max": float(self.ratio_other_max[i, d]),
                            "contrast": sink / other if other > 0 else float("inf")})
        return out

    def to_dict(self, dims: list[int] | None = None) -> dict[str, Any]:
        return to_json({"layers": self.layers, "sink_position": self.sink_position, "site": self.site,
                        "n_sequences": self.n_sequences, "rows": self.rows(dims)})


class NormalizedDisparityReducer(Reducer):
    """Streams ``blocks.{l}.ln1.hook_normalized`` into :class:`NormalizedDisparity` (``[layer, dim]`` sums only)."""

    def __init__(self, model: Any, *, sink_position: int = 0, layers: int | list[int] | None = None, site: str = LN1_NORMALIZED):
        _check_sink(sink_position)
        d = model_dims(model)
        self.layers = resolve_layers(layers, d.n_layers)
        self.sink, self.site, self.d_model = sink_position, site, d.d_model
        dev = model_device(model)
        n = len(self.layers)
        self.sink_sum = torch.zeros(n, d.d_model, device=dev, dtype=torch.float64)
        self.other_sum = torch.zeros(n, d.d_model, device=dev, dtype=torch.float64)
        self.other_max = torch.zeros(n, d.d_model, device=dev, dtype=torch.float32)
        self.n_sequences = 0
        self.n_other = 0

    def fwd_hooks(self, batch: TokenBatch) -> list[tuple[str, HookFn]]:
        check_sink_position(batch, self.sink)
        other = batch.valid.clone()
        other[:, self.sink] = False

        def fold(act: Tensor, hook: Any, i: int) -> None:  # [batch, pos, d_model]
            a = act.float().abs()
            rest = (a.sum(-1, keepdim=True) - a) / (a.shape[-1] - 1)
            r = a / rest.clamp_min(_TINY)
            self.sink_sum[i] += r[:, self.sink].double().sum(0)
            ro = r * other[..., None]
            self.other_sum[i] += ro.double().sum(dim=(0, 1))
            self.other_max[i] = torch.maximum(self.other_max[i], ro.amax(dim=(0, 1)))

        fold = once_per_forward(fold)  # TL 3.x runs ln1.hook_normalized once per q/k/v input
        return [(hook_name(layer, self.site), functools.partial(fold, i=i)) for i, layer in enumerate(self.layers)]

    def end_batch(self, batch: TokenBatch) -> None:
        self.n_sequences += batch.valid.shape[0]
        self.n_other += int(batch.valid.sum()) - int(batch.valid[:, self.sink].sum())

    def result(self) -> NormalizedDisparity:
        if self.n_sequences == 0:
            raise ValueError("No batches were streamed; nothing to summarise.")
        other = self.other_sum / self.n_other if self.n_other else torch.full_like(self.other_sum, float("nan"))
        return NormalizedDisparity(
            list(self.layers), self.sink, self.site, (self.sink_sum / self.n_sequences).float().cpu(),
            other.float().cpu(), self.other_max.cpu(), self.n_sequences,
        )


def normalized_disparity(
    model: Any,
    inputs: Inputs | None = None,
    *,
    sink_position: int = 0,
    layers: int | list[int] | None = None,
    batch_size: int = 8,
    prepend_bos: bool = True,
    max_length: int | None = None,
    progress: bool = False,
) -> NormalizedDisparity:
    """Dimension disparity after each layer's first normalisation, at the sink vs other tokens.

    Examples:
        >>> from sinklens.testing.planted import planted_model
        >>> model, spec = planted_model(n_layers=2, layer=0, dim=5)
        >>> nd = normalized_disparity(model, "t3 t4 t5 t6")
        >>> nd.top_dim(1), bool(nd.ratio_sink[1, 5] > 100), float(nd.ratio_other[1, 5])
        (5, True, 0.0)
    """
    reducer = NormalizedDisparityReducer(model, sink_position=sink_position, layers=layers)
    return run_reducer(model, inputs, reducer, batch_size=batch_size, prepend_bos=prepend_bos,
                       max_length=max_length, progress=progress)


# ---------------------------------------------------------------------------------- (d) query-key locking


@dataclass
class QKLocking:
    """Query–key locking per layer × head (see the module docstring, (d)).

    Queries are those of valid positions ``q > sink_position`` (the ones that can attend to the sink);
    queries/keys are the rotated ones (``hook_rot_q``/``hook_rot_k``) on rotary models, else ``hook_q``/``hook_k``,
    with grouped-query keys repeated per query head.

    Attributes:
        key_query_energy: ``Σ (q · k̂_sink)² / Σ ||q||²`` pooled over sequences and queries, ``k̂_sink`` the unit
            sink key of the same sequence: the share of query energy along the sink key (in [0, 1]).
        key_pc_cosine: norm of the projection of the unit mean sink key onto the top ``n_components``
            eigenvectors of the pooled query second-moment matrix ``Σ q qᵀ`` (the principal query directions,
            i.e. top right-singular vectors of the stacked queries); 1 = the key lies in that subspace.
        pc_energy: share of query energy in those top ``n_components`` directions.
        pos_share_sink / pos_share_other: share of positive pre-softmax scores (``hook_attn_scores``) of those
            queries against the sink key / against every other valid causal key.
        mean_score_sink / mean_score_other: the corresponding mean scores.
    """

    layers: list[int]
    sink_position: int
    n_components: int
    q_site: str
    k_site: str
    key_query_energy: Float[Tensor, "layer head"]
    key_pc_cosine: Float[Tensor, "layer head"]
    pc_energy: Float[Tensor, "layer head"]
    pos_share_sink: Float[Tensor, "layer head"]
    pos_share_other: Float[Tensor, "layer head"]
    mean_score_sink: Float[Tensor, "layer head"]
    mean_score_other: Float[Tensor, "layer head"]
    n_queries: int

    def rows(self) -> list[dict[str, Any]]:
        """One row per layer × head with every statistic (DataFrame-ready)."""
        out = []
        names = ("key_query_energy", "key_pc_cosine", "pc_energy", "pos_share_sink", "pos_share_other",
                 "mean_score_sink", "mean_score_other")
        for i, layer in enumerate(self.layers):
            for h in range(self.key_query_energy.shape[1]):
                out.append({"layer": layer, "head": h} | {n: float(getattr(self, n)[i, h]) for n in names})
        return out

    def to_dict(self) -> dict[str, Any]:
        return to_json({"layers": self.layers, "sink_position": self.sink_position, "n_components": self.n_components,
                        "q_site": self.q_site, "k_site": self.k_site, "n_queries": self.n_queries, "rows": self.rows()})


class QKLockingReducer(Reducer):
    """Streams queries, the sink key and the attention scores into :class:`QKLocking`.

    Keeps per layer × head the pooled query second-moment matrix ``[d_head, d_head]``, the summed sink key,
    the query energy along each sequence's sink key and counts/sums of scores. A sequence's query Gram
    matrices live only until its sink key has been seen in the same forward.
    """

    def __init__(self, model: Any, *, sink_position: int = 0, layers: int | list[int] | None = None, n_components: int = 1):
        _check_sink(sink_position)
        d = model_dims(model)
        if not 1 <= n_components <= d.d_head:
            raise ValueError(f"n_components must be in [1, {d.d_head}] (d_head), got {n_components}.")
        self.layers = resolve_layers(layers, d.n_layers)
        self.sink, self.n_components, self.n_heads = sink_position, n_components, d.n_heads
        rotary = hook_name(self.layers[0], ROT_Q) in model.hook_dict
        self.q_site, self.k_site = (ROT_Q, ROT_K) if rotary else (Q, K)
        dev, f64 = model_device(model), torch.float64
        n, H, dh = len(self.layers), d.n_heads, d.d_head
        self.gram = torch.zeros(n, H, dh, dh, device=dev, dtype=f64)
        self.key_sum = torch.zeros(n, H, dh, device=dev, dtype=f64)
        self.along = torch.zeros(n, H, device=dev, dtype=f64)
        self.total = torch.zeros(n, H, device=dev, dtype=f64)
        self.pos_sink = torch.zeros(n, H, device=dev, dtype=f64)
        self.pos_other = torch.zeros(n, H, device=dev, dtype=f64)
        self.sum_sink = torch.zeros(n, H, device=dev, dtype=f64)
        self.sum_other = torch.zeros(n, H, device=dev, dtype=f64)
        self.cnt_sink = 0.0
        self.cnt_other = 0.0
        self._pending: dict[tuple[int, str], Tensor] = {}
        self._batch_cnt: tuple[float, float] = (0.0, 0.0)

    def _pair(self, i: int, kind: str, value: Tensor) -> None:
        self._pending[(i, kind)] = value
        if (i, "q") in self._pending and (i, "k") in self._pending:
            gram, key = self._pending.pop((i, "q")), self._pending.pop((i, "k"))
            unit = key / key.norm(dim=-1, keepdim=True).clamp_min(_TINY)
            self.along[i] += torch.einsum("bhi,bhij,bhj->h", unit, gram, unit).double()

    def fwd_hooks(self, batch: TokenBatch) -> list[tuple[str, HookFn]]:
        check_sink_position(batch, self.sink)
        s, valid = self.sink, batch.valid
        n = valid.shape[1]
        pos = torch.arange(n, device=valid.device)
        qmask = valid & (pos > s)[None]  # [batch, query]
        causal = pos[:, None] >= pos[None, :]
        other_keys = qmask[:, :, None] & valid[:, None, :] & causal[None] & (pos != s)[None, None, :]  # [b, q, k]
        self._batch_cnt = (float(qmask.sum()), float(other_keys.sum()))

        def fold_q(act: Tensor, hook: Any, i: int) -> None:  # [batch, pos, head, d_head]
            q = act.float() * qmask[:, :, None, None]
            qt = q.permute(0, 2, 3, 1)  # [batch, head, d_head, pos]
            gram = qt @ qt.transpose(-1, -2)  # [batch, head, d_head, d_head]
            self.gram[i] += gram.sum(0).double()
            self.total[i] += gram.diagonal(dim1=-2, dim2=-1).sum(dim=(0, -1)).double()
            self._pair(i, "q", gram)

        def fold_k(act: Tensor, hook: Any, i: int) -> None:  # [batch, pos, kv_head, d_head]
            key = expand_kv_heads(act[:, s].float()[..., None], self.n_heads)[..., 0]  # [batch, head, d_head]
            self.key_sum[i] += key.sum(0).double()
            self._pair(i, "k", key)

        def fold_scores(act: Tensor, hook: Any, i: int) -> None:  # [batch, head, query, key]
            sc = act.float()
            at_sink = sc[:, :, :, s]
            m = qmask[:, None].float()
            self.pos_sink[i] += ((at_sink > 0).float() * m).sum(dim=(0, 2)).double()
            self.sum_sink[i] += (at_sink * m).sum(dim=(0, 2)).double()
            mo = other_keys[:, None]
            self.pos_other[i] += ((sc > 0) & mo).sum(dim=(0, 2, 3)).double()
            self.sum_other[i] += torch.where(mo, sc, 0.0).sum(dim=(0, 2, 3)).double()

        hooks: list[tuple[str, HookFn]] = []
        for i, layer in enumerate(self.layers):
            hooks.append((hook_name(layer, self.q_site), functools.partial(fold_q, i=i)))
            hooks.append((hook_name(layer, self.k_site), functools.partial(fold_k, i=i)))
            hooks.append((hook_name(layer, SCORES), functools.partial(fold_scores, i=i)))
        return hooks

    def end_batch(self, batch: TokenBatch) -> None:
        if self._pending:
            raise RuntimeError(f"Query/key hooks did not both run for {sorted(self._pending)} in this forward.")
        self.cnt_sink += self._batch_cnt[0]
        self.cnt_other += self._batch_cnt[1]

    def result(self) -> QKLocking:
        # Many small eigenproblems: one thread is ~10x faster than several on CPU (thread start-up dominates).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            evals, evecs = torch.linalg.eigh(self.gram)  # ascending; [layer, head, dh], [layer, head, dh, dh]
        finally:
            torch.set_num_threads(threads)
        top = evecs[..., -self.n_components :]  # [layer, head, dh, r]
        key = self.key_sum / self.key_sum.norm(dim=-1, keepdim=True).clamp_min(_TINY)
        cos = torch.einsum("lhi,lhir->lhr", key, top).norm(dim=-1)
        pc_energy = evals[..., -self.n_components :].sum(-1) / evals.sum(-1).clamp_min(_TINY)
        nan = float("nan")
        cs, co = self.cnt_sink or nan, self.cnt_other or nan
        return QKLocking(
            layers=list(self.layers), sink_position=self.sink, n_components=self.n_components,
            q_site=self.q_site, k_site=self.k_site,
            key_query_energy=(self.along / self.total.clamp_min(_TINY)).float().cpu(),
            key_pc_cosine=cos.float().cpu(), pc_energy=pc_energy.float().cpu(),
            pos_share_sink=(self.pos_sink / cs).float().cpu(), pos_share_other=(self.pos_other / co).float().cpu(),
            mean_score_sink=(self.sum_sink / cs).float().cpu(), mean_score_other=(self.sum_other / co).float().cpu(),
            n_queries=int(self.cnt_sink),
        )


def query_key_locking(
    model: Any,
    inputs: Inputs | None = None,
    *,
    sink_position: int = 0,
    layers: int | list[int] | None = None,
    n_components: int = 1,
    batch_size: int = 8,
    prepend_bos: bool = True,
    max_length: int | None = None,
    progress: bool = False,
) -> QKLocking:
    """Measure query–key locking on the sink key per layer × head (see :class:`QKLocking`).

    Examples:
        >>> from sinklens.testing.planted import planted_model
        >>> model, spec = planted_model(n_layers=2, layer=0, qk_layer=1, qk_head=1)
        >>> lock = query_key_locking(model, "t3 t4 t5 t6 t7 t8")
        >>> float(lock.pos_share_sink[1, 1]), bool(lock.key_pc_cosine[1, 1] > 0.9)
        (1.0, True)
    """
    reducer = QKLockingReducer(model, sink_position=sink_position, layers=layers, n_components=n_components)
    return run_reducer(model, inputs, reducer, batch_size=batch_size, prepend_bos=prepend_bos,
                       max_length=max_length, progress=progress)
