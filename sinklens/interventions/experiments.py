"""What an intervention does to the sinks: attention received by a target and by the original sink,
residuals there and the next-token loss, without and with the intervention's hooks."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import partial
from inspect import signature
from typing import Any, Union

import numpy as np
import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from sinklens.analysis.attention import AttentionReceivedReducer
from sinklens.display import CompactRepr
from sinklens.errors import InvalidArgumentError, UnsupportedArchitectureError
from sinklens.hooks import RESID_POST, model_device, model_dims
from sinklens.export import to_json
from sinklens.inputs import Inputs, TokenBatch, is_encoder, padded_to, right_align
from sinklens.interventions import registry
from sinklens.interventions.masks import Hooks, IndexLike, IntLike, NumberLike, layers_arg
from sinklens.options import RunOptions, checked_options
from sinklens.streaming import BatchFold, Reducer, batches_for, eval_mode, forward, per_layer_hooks, stream
from sinklens.validate import as_bool, index, index_list

#: What :func:`measure_intervention` accepts: hooks, a registry spec string, or a callable ``model -> hooks``.
Intervention = Union[Hooks, str, Callable[..., Any]]
WHEN = ("before", "after")


class PositionResidualReducer(Reducer[tuple[Tensor, Tensor]]):
    """Mean residual vector and norm at ``positions`` per layer (``hook_resid_post``), over sequences where all
    are real tokens; float64 sums. Result: ``(mean [layer, position, d_model], mean norm [layer, position])``."""

    statistics = ("vec", "norm", "count")

    def __init__(self, model: Any, positions: Sequence[int]):
        dims = model_dims(model)
        self.layers = list(range(dims.n_layers))
        self.positions = [index(p, dims.n_ctx, what="position", allow_negative=False) for p in positions]
        self.d_model, self.device = dims.d_model, model_device(model)
        self.reset()

    def reset(self) -> None:
        zeros = partial(torch.zeros, dtype=torch.float64, device=self.device)
        n = (len(self.layers), len(self.positions))
        self.vec, self.norm, self.count = zeros(*n, self.d_model), zeros(*n), zeros(())

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        seq_ok = (batch.valid[:, self.positions].all(dim=1) if max(self.positions) < batch.tokens.shape[1]
                  else torch.zeros(batch.tokens.shape[0], dtype=torch.bool, device=batch.valid.device))  # [batch]

        def fold(act: Tensor, layer: int) -> None:  # act: [batch, pos, d_model]; sequences not ok weigh 0
            x = torch.where(seq_ok[:, None, None], act[:, self.positions].double(), 0.0)  # [batch, position, d_model]
            self.vec[layer] += x.sum(dim=0)
            self.norm[layer] += x.norm(dim=-1).sum(dim=0)

        return BatchFold(per_layer_hooks(RESID_POST, self.layers, fold), state=seq_ok)

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        self.count += fold.state.sum()

    def result(self) -> tuple[Tensor, Tensor]:
        count = float(self.count)
        if count == 0:
            raise InvalidArgumentError(f"No sequence is long enough to contain positions {self.positions}.")
        return (self.vec / count).float().cpu(), (self.norm / count).float().cpu()


@dataclass(repr=False, eq=False)
class RunStats(CompactRepr):
    """Sink statistics of one (possibly intervened) run; see :class:`InterventionResult`."""

    received: Float[Tensor, "layer head"]
    sink_received: Float[Tensor, "layer head"]
    resid_mean: Float[Tensor, "layer 2 d_model"]
    resid_norm: Float[Tensor, "layer 2"]
    loss: float


def wants_next_token_loss(model: Any, loss: bool | None) -> bool:
    """Whether to compute the next-token loss (None: where defined, i.e. not on an encoder nor where
    ``cfg.d_vocab_out < d_vocab``; ``loss=True`` there raises UnsupportedArchitectureError)."""
    dims = model_dims(model)
    if loss is None:
        return not is_encoder(model) and dims.d_vocab_out >= dims.d_vocab
    loss = as_bool(loss, what="loss")
    if loss and is_encoder(model):
        raise UnsupportedArchitectureError(
            "loss=True on an encoder: every position sees the token it would predict, so there is no next-token loss.")
    if loss and dims.d_vocab_out < dims.d_vocab:
        raise UnsupportedArchitectureError(f"loss=True on a model that reads {dims.d_vocab} tokens but predicts "
                                           f"{dims.d_vocab_out} (cfg.d_vocab_out): the next-token loss is not defined.")
    return loss


def _next_token_loss(model: Any, batches: Sequence[TokenBatch], hooks: Hooks) -> float:
    """Mean next-token cross-entropy (nats) over predictions whose next token is real, with ``hooks`` attached."""
    total, count = 0.0, 0
    with torch.inference_mode(), eval_mode(model), model.hooks(fwd_hooks=list(hooks)):  # no dropout, as in stream
        for b in map(right_align, batches):
            logits = forward(model, b, return_type="logits")[:, :-1]  # [batch, pos - 1, d_vocab], padding masked
            nll = F.cross_entropy(logits.flatten(0, 1).float(), b.tokens[:, 1:].flatten(), reduction="none")
            real = b.valid[:, 1:].flatten()
            total, count = total + float(nll[real].double().sum()), count + int(real.sum())
    return total / count if count else float("nan")


def run_stats(
    model: Any, batches: Sequence[TokenBatch], hooks: Hooks, *, target: int, sink: int = 0, loss: bool | None = None,
    options: RunOptions = RunOptions(progress=False),
) -> RunStats:
    """Attention to ``target`` and ``sink`` (queries after ``target``), residuals at both, and the loss (NaN when
    :func:`wants_next_token_loss` says no); ``hooks`` run after ``options.extra_hooks`` in every forward."""
    loss = wants_next_token_loss(model, loss)
    longest = max((int(b.valid.sum(dim=1).max()) for b in batches), default=0)
    if target >= longest - 1:
        raise InvalidArgumentError(f"No query after position {target}: use sequences longer than {target + 1} tokens "
                                   f"(the longest has {longest}).")
    if sink >= longest:
        raise InvalidArgumentError(f"sink position {sink} is beyond the longest sequence ({longest} tokens).")
    # pad short batches so an intervention at the target or the sink finds those positions
    batches = [padded_to(b, max(target, sink) + 1) for b in batches]
    att = AttentionReceivedReducer(model, min_query=target + 1)
    res = PositionResidualReducer(model, [target, sink])
    all_hooks = [*options.extra_hooks, *hooks]
    received, (vec, norm) = stream(model, batches, [att, res],
                                   options=options.replace(extra_hooks=all_hooks, desc=options.desc or "intervene"))
    return RunStats(received.at(target), received.at(sink), vec, norm,
                    _next_token_loss(model, batches, all_hooks) if loss else float("nan"))


@dataclass(repr=False, eq=False)
class InterventionResult(CompactRepr):
    """What an intervention did to the sinks, per layer (rows: ``layers``).

    ``received_*`` / ``sink_*``: ``[layer, head]`` mean ``hook_pattern`` attention to ``target`` / the original
    ``sink`` from the queries after ``target``, averaged over sequences; ``resid_norm_*``: ``[layer]`` mean L2
    norm of the target's ``hook_resid_post``; ``dims`` (default: the clean sink's 3 largest ``|x|``) and
    ``dims_*`` / ``sink_dims``: those residual coordinates; ``loss_*``: mean next-token cross-entropy (nats);
    ``options``: every option the intervention and inputs ran with, as plain JSON."""

    method: str
    target: int
    sink: int
    layers: list[int]
    received_before: Float[Tensor, "layer head"]
    received_after: Float[Tensor, "layer head"]
    sink_before: Float[Tensor, "layer head"]
    sink_after: Float[Tensor, "layer head"]
    resid_norm_before: Float[Tensor, " layer"]
    resid_norm_after: Float[Tensor, " layer"]
    dims: list[int]
    dims_before: Float[Tensor, "layer dim"]
    dims_after: Float[Tensor, "layer dim"]
    sink_dims: Float[Tensor, "layer dim"]
    loss_before: float
    loss_after: float
    options: dict = field(default_factory=dict)

    @property
    def received_layer_before(self) -> Float[Tensor, " layer"]:
        return self.received_before.mean(dim=1)

    @property
    def received_layer_after(self) -> Float[Tensor, " layer"]:
        return self.received_after.mean(dim=1)

    def rows(self) -> list[dict]:
        """One tidy row per layer (head-averaged numbers)."""
        out = []
        for i, layer in enumerate(self.layers):
            row = {"method": self.method, "target": self.target, "layer": layer}
            for name in ("received", "sink", "resid_norm"):
                row.update({f"{name}_{when}": float(getattr(self, f"{name}_{when}")[i].mean()) for when in WHEN})
            for j, d in enumerate(self.dims):
                row.update({f"dim{d}_{when}": float(getattr(self, f"dims_{when}")[i, j]) for when in WHEN})
            out.append(row)
        return out

    def to_dict(self) -> dict:
        """Every field, JSON-ready at full precision (NaN loss as None), ``sink_*`` head-averaged;
        ``before`` / ``after``: head-averaged attention to the target."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data |= {"sink_before": self.sink_before.mean(1), "sink_after": self.sink_after.mean(1),
                 "options": plain_options(self.options), "before": self.received_layer_before,
                 "after": self.received_layer_after}
        return to_json(data, digits=None)

def plain_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Each recorded option as plain JSON, or a short description (large tensors, non-JSON objects)."""

    def plain(value: Any) -> Any:
        size = value.numel() if isinstance(value, Tensor) else value.size if isinstance(value, np.ndarray) else 0
        if size > 64:
            return f"tensor of shape {list(value.shape)} ({value.dtype})"
        try:
            return to_json(value, digits=None)
        except TypeError:
            return f"{type(value).__name__} {getattr(value, '__name__', '')}".strip()

    return {str(k): plain(v) for k, v in options.items()}


def compare_runs(
    before: RunStats, after: RunStats, *, method: str, target: int, sink: int,
    dims: IndexLike | None = None, options: dict[str, Any] | None = None,
) -> InterventionResult:
    """Combine a clean and an intervened :class:`RunStats`; ``dims`` checked (None: the clean sink's 3
    largest ``|x|`` in the layer where it peaks)."""
    if dims is None:
        sink_vec = before.resid_mean[:, 1].abs()  # [layer, d_model]
        peak = sink_vec[int(sink_vec.max(dim=1).values.argmax())]
        dims = peak.topk(min(3, peak.numel())).indices.tolist()
    return InterventionResult(
        method=method, target=target, sink=sink, layers=list(range(before.received.shape[0])),
        received_before=before.received, received_after=after.received,
        sink_before=before.sink_received, sink_after=after.sink_received,
        resid_norm_before=before.resid_norm[:, 0], resid_norm_after=after.resid_norm[:, 0],
        dims=dims, dims_before=before.resid_mean[:, 0, dims], dims_after=after.resid_mean[:, 0, dims],
        sink_dims=before.resid_mean[:, 1, dims], loss_before=before.loss, loss_after=after.loss,
        options=dict(options or {}),
    )


def _check_dims(model: Any, dims: Any) -> list[int] | None:
    return None if dims is None else index_list(dims, model_dims(model).d_model, what="dims", allow_negative=False)


def measure_intervention(
    model: Any, tokens: Inputs, intervention: Intervention, *, target: IntLike, sink: IntLike = 0,
    method: str | None = None, dims: IndexLike | None = None, loss: bool | None = None,
    options: RunOptions = RunOptions(progress=False),
) -> InterventionResult:
    """The statistics of :class:`InterventionResult` without and with ``intervention``: ``(hook, fn)`` pairs, a
    registry spec (``"restart:positions=5"``) or a callable ``model -> hooks``. ``dims`` default: the sink's 3
    largest; ``loss`` None: where defined (:func:`wants_next_token_loss`); ``options.extra_hooks`` run in both."""
    options = checked_options(options, "measure_intervention")
    n_ctx = model_dims(model).n_ctx
    target = index(target, n_ctx, what="target position", allow_negative=False)  # before the hooks are built
    sink = index(sink, n_ctx, what="sink position", allow_negative=False)
    _check_dims(model, dims)
    recorded: dict[str, Any] = {}
    if isinstance(intervention, str):
        name, spec_kwargs = registry.parse_spec(intervention)
        method = method or name
        recorded = registry.get(name).effective_options(spec_kwargs)
        if "positions" in spec_kwargs:
            recorded["positions"] = spec_kwargs["positions"]
    hooks = registry.build(model, intervention) if isinstance(intervention, str) or callable(intervention) else list(intervention)
    return _measure(model, tokens, hooks, target=target, sink=sink, method=method, dims=dims, loss=loss,
                    options=options, recorded=recorded)


def _measure(
    model: Any, tokens: Inputs, hooks: Hooks, *, target: IntLike, sink: IntLike, method: str | None,
    dims: IndexLike | None, loss: bool | None, options: RunOptions, recorded: Mapping[str, Any],
) -> InterventionResult:
    """:func:`measure_intervention` on built hooks (``target`` and ``sink`` checked by the caller);
    ``recorded`` and the inputs' ``prepend_bos``, ``special_tokens``, ``max_length`` go to ``options``."""
    dims = _check_dims(model, dims)
    batches = batches_for(model, tokens, options)
    before = run_stats(model, batches, [], target=target, sink=sink, loss=loss, options=options)
    after = run_stats(model, batches, hooks, target=target, sink=sink, loss=loss, options=options)
    inputs = {"prepend_bos": bool(batches[0].prepend_bos), "special_tokens": list(batches[0].special_tokens),
              "max_length": options.max_length}  # batches[0]: run_stats has refused empty inputs
    return compare_runs(before, after, method=method or "custom", target=target, sink=sink, dims=dims,
                        options={**plain_options(recorded), **inputs})


def create_sink(
    model: Any, tokens: Inputs, position: IntLike, *, method: str = "self_only",
    layers: IndexLike | None = None, sink: IntLike = 0, dims: IndexLike | None = None,
    loss: bool | None = None, options: RunOptions = RunOptions(progress=False),
    **method_options: Any,
) -> InterventionResult:
    """Turn the token at ``position`` into a sink and measure the effect. ``method``: a ``create`` entry of the
    registry (``"self_only"``, ``"restart"``, ``"amplify"``, ``"transplant_dims"``); ``method_options`` go to
    its factory, and ``dims`` (tracked dimensions) also to a factory that needs ``dims``."""
    options = checked_options(options, "create_sink")
    n_ctx = model_dims(model).n_ctx
    position = index(position, n_ctx, what="position", allow_negative=False)
    sink = index(sink, n_ctx, what="sink position", allow_negative=False)
    if position == sink:
        raise InvalidArgumentError(f"position={position} is the sink itself (sink={sink}): pass another position to "
                                   "create_sink (or use remove_sink).")
    name, hooks, recorded = _hooks_for(model, method, "create", position, layers, sink, dims, method_options)
    return _measure(model, tokens, hooks, target=position, sink=sink, method=name, dims=dims, loss=loss,
                    options=options, recorded=recorded)


def _hooks_for(model: Any, method: str, role: registry.Role, positions: int, layers: Any, sink: int, dims: Any,
               method_options: dict[str, Any]) -> tuple[str, Hooks, dict[str, Any]]:
    """``(name, hooks, recorded options)`` of a registered ``method``: its ``sink_defaults`` under
    ``method_options``, ``dims`` as the factory's ``dims`` and ``sink`` as its ``sink_option`` unless given."""
    entry = registry.get(method, role=role)
    opts = {**entry.sink_defaults, **method_options}  # e.g. variance_calibration's mode="attenuate"
    if "dims" in entry.requires and "dims" not in opts and dims is not None:
        opts["dims"] = dims
    if entry.sink_option and entry.sink_option not in opts:
        opts[entry.sink_option] = sink
    hooks = entry(model, positions=positions, layers=layers, **opts)
    return entry.name, hooks, {**entry.effective_options(opts), "layers": layers}


def remove_sink(
    model: Any, tokens: Inputs, *, sink: IntLike = 0, method: str = "block_keys",
    layers: IndexLike | None = None, dims: IndexLike | None = None, loss: bool | None = None,
    options: RunOptions = RunOptions(progress=False), **method_options: Any,
) -> InterventionResult:
    """Remove the sink at ``sink`` and measure the effect (the target is the sink itself). ``method``: a
    ``remove`` entry of the registry (``"block_keys"``, ``"calibrate"``, ``"clamp_dims"``, ...)."""
    options = checked_options(options, "remove_sink")
    sink = index(sink, model_dims(model).n_ctx, what="sink position", allow_negative=False)
    name, hooks, recorded = _hooks_for(model, method, "remove", sink, layers, sink, dims, method_options)
    return _measure(model, tokens, hooks, target=sink, sink=sink, method=name, dims=dims, loss=loss,
                    options=options, recorded=recorded)


def sweep(
    model: Any, tokens: Inputs, *, method: str = "self_only", positions: IndexLike,
    layer_sets: Sequence[Any] = (None,), alphas: Sequence[NumberLike | None] = (None,),
    sink: IntLike = 0, dims: IndexLike | None = None, loss: bool = False,
    options: RunOptions = RunOptions(progress=False), **method_options: Any,
) -> list[dict]:
    """:func:`create_sink` over positions × layer sets × α (None: the method's default), the clean run once per
    position; one row per (config, layer): ``position``, ``layers``, ``alpha`` and :meth:`InterventionResult.rows`.
    Other keywords go to the method's factory."""
    options = checked_options(options, "sweep")
    dims_m = model_dims(model)
    positions = index_list(positions, dims_m.n_ctx, what="position", allow_negative=False)
    sink = index(sink, dims_m.n_ctx, what="sink position", allow_negative=False)
    if not len(layer_sets) or not len(alphas):
        raise InvalidArgumentError("layer_sets and alphas need at least one entry each (use (None,) for the default).")
    layer_sets = [None if ls is None else layers_arg(ls, dims_m.n_layers) for ls in layer_sets]
    entry = registry.get(method, role="create")
    if any(a is not None for a in alphas) and "alpha" not in entry.options():
        raise InvalidArgumentError(f"alphas= only applies to methods with an alpha option, not {entry.name!r}.")
    dims = _check_dims(model, dims)
    batches = batches_for(model, tokens, options)
    quiet = options.replace(progress=False)
    rows: list[dict] = []
    clean: dict[int, RunStats] = {}
    configs = list(itertools.product(positions, layer_sets, alphas))
    for position, layer_set, alpha in tqdm(configs, desc="sweep", disable=not options.progress):
        extra = dict(method_options) if alpha is None else {**method_options, "alpha": alpha}
        try:
            name, hooks, _ = _hooks_for(model, entry.name, "create", position, layer_set, sink, dims, extra)
        except InvalidArgumentError as err:
            unknown = [k for k in method_options if k not in entry.options() and repr(k) in str(err)]
            if not unknown:
                raise
            raise InvalidArgumentError(
                f"sweep has no option {unknown[0]!r}: its keywords are {list(signature(sweep).parameters)[2:-1]} "
                f"(alphas=[...]: the values of α for methods with an alpha option, such as amplify); other keywords go "
                f"to the method {entry.name!r}, which does not take it either: {err}") from None
        if position not in clean:
            clean[position] = run_stats(model, batches, [], target=position, sink=sink, loss=loss, options=quiet)
        after = run_stats(model, batches, hooks, target=position, sink=sink, loss=loss, options=quiet)
        res = compare_runs(clean[position], after, method=name, target=position, sink=sink, dims=dims)
        for row in res.rows():
            row.update(position=position, layers=layer_set, alpha=alpha)
            if loss:
                row.update(loss_before=res.loss_before, loss_after=res.loss_after)
            rows.append(row)
    return rows

