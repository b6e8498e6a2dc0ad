"""Experiments: what an intervention does to the sinks.

:func:`measure_intervention` runs a model twice over the same tokens — without and with a list of
intervention hooks — and reports, per layer (and head), the attention received by a target
position and by the original sink, the target's residual norm and massive dimensions, and the
next-token loss. :func:`create_sink` and :func:`remove_sink` build the hooks from a method name;
:func:`sweep` varies positions, layer sets and α and returns tidy rows.

Attention received is measured with
:class:`~sinklens.analysis.attention.AttentionReceivedReducer` through
:func:`sinklens.stream` (``extra_hooks`` = the intervention), averaged over the queries after the
target (``min_query = target + 1``) and over sequences; the residual statistics come from a second
small reducer on ``hook_resid_post`` in the same forward pass.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from sinklens.analysis.attention import AttentionReceivedReducer
from sinklens.hooks import RESID_POST, hook_name, layer_of, model_dims, resolve_layers
from sinklens.inputs import Inputs, TokenBatch, as_batches
from sinklens.interventions import masks, neurons, variance
from sinklens.interventions import neurons as neurons_mod
from sinklens.interventions.masks import Hooks, as_positions
from sinklens.options import RunOptions
from sinklens.streaming import BatchFold, HookFn, Reducer, per_layer_hooks, stream

# ----------------------------------------------------------------------------- method registry

#: ``name -> builder(model, target, sink, layers, **kw) -> hooks``; names use underscores.
CREATE_METHODS: dict[str, Callable[..., Hooks]] = {}
REMOVE_METHODS: dict[str, Callable[..., Hooks]] = {}


def register_method(kind: str, name: str, builder: Callable[..., Hooks]) -> None:
    """Register a ``create`` or ``remove`` method; raises on duplicates."""
    registry = {"create": CREATE_METHODS, "remove": REMOVE_METHODS}[kind]
    if name in registry:
        raise ValueError(f"A {kind} method named {name!r} is already registered.")
    registry[name] = builder


def _required(value: Any, method: str, what: str) -> Any:
    if value is None:
        raise ValueError(f"method={method!r} needs {what}.")
    return value


_DIMS = "dims=[...] (residual dimensions, e.g. 507 for SmolLM2)"
register_method("create", "self_only", lambda m, t, s, layers, **kw: masks.self_only(m, positions=t, layers=layers, **kw))
register_method("create", "restart", lambda m, t, s, layers, **kw: masks.restart(m, positions=t, layers=layers, **kw))
register_method(
    "create", "variance",
    lambda m, t, s, layers, alpha=8.0, **kw: variance.amplify(m, positions=t, alpha=alpha, layers=layers, **kw),
)
register_method(
    "create", "transplant",
    lambda m, t, s, layers, dims=None, **kw: neurons.transplant_dims(
        m, _required(dims, "transplant", _DIMS), positions=t, source=s, layers=layers, **kw
    ),
)
register_method("remove", "block", lambda m, t, s, layers, **kw: masks.block_keys(m, positions=s, layers=layers, **kw))
register_method("remove", "calibrate", lambda m, t, s, layers, **kw: variance.calibrate(m, positions=s, layers=layers, **kw))
register_method(
    "remove", "clamp",
    lambda m, t, s, layers, dims=None, **kw: neurons.clamp_dims(
        m, _required(dims, "clamp", _DIMS), positions=s, layers=layers, **kw
    ),
)
register_method(
    "remove", "ablate_neurons",
    lambda m, t, s, layers, neurons=None, **kw: neurons_mod.edit_neurons(
        m, _required(neurons, "ablate_neurons", "neurons=[...] (FFN neuron indices)"), positions=s, layers=layers, **kw
    ),
)


def _normalise_method(method: str) -> str:
    return method.replace("-", "_")


def build_hooks(model: Any, kind: str, method: str, *, target: int, sink: int = 0, layers=None, **kw: Any) -> Hooks:
    """The hooks of a registered ``create``/``remove`` method (names accept ``-`` or ``_``)."""
    registry = {"create": CREATE_METHODS, "remove": REMOVE_METHODS}[kind]
    name = _normalise_method(method)
    if name not in registry:
        raise ValueError(f"Unknown {kind} method {method!r}; expected one of {sorted(registry)}.")
    return registry[name](model, target, sink, layers, **kw)


# ----------------------------------------------------------------------------- measurement


class PositionResidualReducer(Reducer):
    """Mean residual vector and mean residual norm at a few positions, per layer (``hook_resid_post``).

    Averages over the sequences in which every requested position is a real token.
    """

    def __init__(self, model: Any, positions: Sequence[int], *, site: str = RESID_POST, layers=None):
        dims = model_dims(model)
        self.layers = resolve_layers(layers, dims.n_layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.positions = list(positions)
        self.site = site
        self.d_model = dims.d_model
        self.reset()

    def reset(self) -> None:
        self.vec = torch.zeros(len(self.layers), len(self.positions), self.d_model, dtype=torch.float64)
        self.norm = torch.zeros(len(self.layers), len(self.positions), dtype=torch.float64)
        self.count = 0

    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        seq_ok = batch.valid[:, self.positions].all(dim=1)

        def fold(act: Tensor, layer: int) -> None:  # act: [batch, pos, d_model]
            x = act[seq_ok][:, self.positions].double()
            i = self.row[layer]
            self.vec[i] += x.sum(dim=0).cpu()
            self.norm[i] += x.norm(dim=-1).sum(dim=0).cpu()

        return BatchFold(per_layer_hooks(self.site, self.layers, fold), state=int(seq_ok.sum()))

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:
        self.count += fold.state

    def result(self) -> tuple[Tensor, Tensor]:
        if self.count == 0:
            raise ValueError(f"No sequence is long enough to contain positions {self.positions}.")
        return (self.vec / self.count).float(), (self.norm / self.count).float()


@dataclass
class RunStats:
    """Sink statistics of one (possibly intervened) run; see :class:`InterventionResult`."""

    received: Float[Tensor, "layer head"]
    sink_received: Float[Tensor, "layer head"]
    resid_mean: Float[Tensor, "layer 2 d_model"]
    resid_norm: Float[Tensor, "layer 2"]
    loss: float


def _next_token_loss(model: Any, batches: Sequence[TokenBatch], hooks: Hooks) -> float:
    """Mean next-token cross-entropy over real (non-padded) predicted tokens, with ``hooks`` attached."""
    total, count = 0.0, 0
    with torch.inference_mode(), model.hooks(fwd_hooks=list(hooks)):
        for batch in batches:
            logits = model(batch.tokens, return_type="logits")  # [batch, pos, d_vocab]
            per_token = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), batch.tokens[:, 1:].flatten(), reduction="none"
            ).view(batch.tokens.shape[0], -1)  # [batch, pos - 1]
            mask = batch.valid[:, 1:]
            total += float(per_token[mask].double().sum())
            count += int(mask.sum())
    return total / max(count, 1)


def run_stats(
    model: Any,
    batches: Sequence[TokenBatch],
    hooks: Hooks,
    *,
    target: int,
    sink: int = 0,
    layers=None,
    loss: bool = True,
    progress: bool = False,
) -> RunStats:
    """Attention to ``target`` and ``sink`` (queries after ``target``), residuals at both, and the loss."""
    att = AttentionReceivedReducer(model, layers=layers, min_query=target + 1)
    res = PositionResidualReducer(model, [target, sink], layers=layers)
    received, (vec, norm) = stream(model, batches, [att, res],
                                   options=RunOptions(extra_hooks=hooks, progress=progress, desc="intervene"))
    if received.received.shape[-1] <= max(target, sink):
        raise ValueError(f"No query after position {target}: use sequences longer than {target + 1} tokens.")
    return RunStats(
        received=received.at(target),
        sink_received=received.at(sink),
        resid_mean=vec,
        resid_norm=norm,
        loss=_next_token_loss(model, batches, hooks) if loss else float("nan"),
    )


@dataclass
class InterventionResult:
    """What an intervention did to the sinks, per layer (and head).

    Attributes:
        method: the intervention's name.
        target: the position whose sink-ness is measured (the new sink for ``create_sink``, the
            original sink for ``remove_sink``).
        sink: the original sink position (0 unless told otherwise).
        layers: the model layer of each row.
        received_before/after: ``[layer, head]`` mean attention that ``target`` receives from the
            queries after it (``hook_pattern``, averaged over those queries and over sequences).
        sink_before/after: the same for the original sink, over the same queries.
        resid_norm_before/after: ``[layer]`` mean L2 norm of the target's ``hook_resid_post``.
        dims: tracked residual dimensions (default: the 3 largest ``|x|`` of the sink's mean
            ``hook_resid_post`` in the clean run, taken at the layer where the sink is largest).
        dims_before/after: ``[layer, dim]`` the target's mean ``hook_resid_post`` in those dims.
        sink_dims: ``[layer, dim]`` the sink's values in the clean run, for comparison.
        loss_before/after: mean next-token cross-entropy over all real tokens (nats).
    """

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
        """Attention received by the target per layer, averaged over heads (before)."""
        return self.received_before.mean(dim=1)

    @property
    def received_layer_after(self) -> Float[Tensor, " layer"]:
        """Attention received by the target per layer, averaged over heads (after)."""
        return self.received_after.mean(dim=1)

    def rows(self) -> list[dict]:
        """One tidy row per layer (head-averaged numbers)."""
        out = []
        for i, layer in enumerate(self.layers):
            row = {
                "method": self.method, "target": self.target, "layer": layer,
                "received_before": float(self.received_before[i].mean()),
                "received_after": float(self.received_after[i].mean()),
                "sink_before": float(self.sink_before[i].mean()),
                "sink_after": float(self.sink_after[i].mean()),
                "resid_norm_before": float(self.resid_norm_before[i]),
                "resid_norm_after": float(self.resid_norm_after[i]),
            }
            for j, d in enumerate(self.dims):
                row[f"dim{d}_before"] = float(self.dims_before[i, j])
                row[f"dim{d}_after"] = float(self.dims_after[i, j])
            out.append(row)
        return out

    def to_dict(self) -> dict:
        """JSON-ready: ``layers``, ``before``/``after`` (head-averaged attention to the target), and the rest."""
        return {
            "method": self.method, "target": self.target, "sink": self.sink, "layers": list(self.layers),
            "before": self.received_layer_before.tolist(), "after": self.received_layer_after.tolist(),
            "received_before": self.received_before.tolist(), "received_after": self.received_after.tolist(),
            "sink_before": self.sink_before.mean(dim=1).tolist(), "sink_after": self.sink_after.mean(dim=1).tolist(),
            "resid_norm_before": self.resid_norm_before.tolist(), "resid_norm_after": self.resid_norm_after.tolist(),
            "dims": list(self.dims), "dims_before": self.dims_before.tolist(), "dims_after": self.dims_after.tolist(),
            "sink_dims": self.sink_dims.tolist(), "loss_before": self.loss_before, "loss_after": self.loss_after,
            "options": {k: v for k, v in self.options.items() if isinstance(v, (int, float, str, bool, list, type(None)))},
        }

    def plot(self, path: Any = None) -> Any:
        """Attention to target and sink and the target's residual norm, before vs after (see plotting.interventions)."""
        from sinklens.plotting.interventions import plot_intervention

        return plot_intervention(self, path=path)


def _default_dims(before: RunStats, n: int = 3) -> list[int]:
    sink_vec = before.resid_mean[:, 1].abs()  # [layer, d_model]
    layer = int(sink_vec.max(dim=1).values.argmax())
    return sink_vec[layer].topk(n).indices.tolist()


def compare_runs(
    before: RunStats, after: RunStats, *, method: str, target: int, sink: int, layers: list[int], dims=None, options=None
) -> InterventionResult:
    """Combine a clean and an intervened :class:`RunStats` into an :class:`InterventionResult`."""
    dims = _default_dims(before) if dims is None else ([dims] if isinstance(dims, int) else list(dims))
    return InterventionResult(
        method=method, target=target, sink=sink, layers=layers,
        received_before=before.received, received_after=after.received,
        sink_before=before.sink_received, sink_after=after.sink_received,
        resid_norm_before=before.resid_norm[:, 0], resid_norm_after=after.resid_norm[:, 0],
        dims=dims, dims_before=before.resid_mean[:, 0, dims], dims_after=after.resid_mean[:, 0, dims],
        sink_dims=before.resid_mean[:, 1, dims], loss_before=before.loss, loss_after=after.loss,
        options=dict(options or {}),
    )


def measure_intervention(
    model: Any,
    tokens: Inputs,
    hooks: Hooks,
    *,
    target: int,
    sink: int = 0,
    method: str = "custom",
    dims: int | Sequence[int] | None = None,
    loss: bool = True,
    batch_size: int = 8,
    prepend_bos: bool = True,
    progress: bool = False,
) -> InterventionResult:
    """Measure any list of intervention hooks: the same statistics before and after.

    Args:
        tokens: strings, a token tensor ``[batch, pos]`` or TokenBatch es (see :func:`sinklens.as_batches`).
        target: position whose received attention / residual is reported.
        sink: the original sink position.
        dims: residual dimensions to track (default: the sink's 3 largest, see :class:`InterventionResult`).
        loss: also compute the next-token loss (one extra forward per batch and run).
    """
    dims_m = model_dims(model)
    (target,) = as_positions(target, dims_m.n_ctx, what="target position")
    (sink,) = as_positions(sink, dims_m.n_ctx, what="sink position")
    batches = as_batches(model, tokens, batch_size=batch_size, prepend_bos=prepend_bos)
    layers = list(range(dims_m.n_layers))
    before = run_stats(model, batches, [], target=target, sink=sink, loss=loss, progress=progress)
    after = run_stats(model, batches, list(hooks), target=target, sink=sink, loss=loss, progress=progress)
    return compare_runs(before, after, method=method, target=target, sink=sink, layers=layers, dims=dims)


def create_sink(
    model: Any,
    tokens: Inputs,
    position: int,
    *,
    method: str = "self_only",
    layers=None,
    sink: int = 0,
    dims: int | Sequence[int] | None = None,
    loss: bool = True,
    batch_size: int = 8,
    prepend_bos: bool = True,
    **kw: Any,
) -> InterventionResult:
    """Turn the token at ``position`` into a sink and measure the effect.

    Methods (``-`` or ``_``): ``"self_only"`` (it attends only to itself), ``"restart"`` (it becomes
    a new first token), ``"variance"`` (:func:`~sinklens.interventions.variance.amplify` with
    ``alpha=8`` by default at ``site="attn.hook_z"``), ``"transplant"`` (copy the sink's residual
    ``dims=`` onto it). Extra keywords go to the hook factory (``alpha``, ``site``, ``heads``...).

    Examples:
        >>> from sinklens.testing import tiny_model
        >>> model = tiny_model()
        >>> res = create_sink(model, torch.randint(2, 64, (2, 12)), 5, method="self-only")
        >>> res.received_before.shape, len(res.to_dict()["after"])
        (torch.Size([2, 4]), 2)
    """
    if _normalise_method(method) == "transplant":
        kw["dims"] = dims
    hooks = build_hooks(model, "create", method, target=position, sink=sink, layers=layers, **kw)
    return measure_intervention(
        model, tokens, hooks, target=position, sink=sink, method=_normalise_method(method), dims=dims,
        loss=loss, batch_size=batch_size, prepend_bos=prepend_bos,
    )


def remove_sink(
    model: Any,
    tokens: Inputs,
    *,
    sink: int = 0,
    method: str = "block",
    layers=None,
    dims: int | Sequence[int] | None = None,
    loss: bool = True,
    batch_size: int = 8,
    prepend_bos: bool = True,
    **kw: Any,
) -> InterventionResult:
    """Remove the sink at ``sink`` and measure the effect (the target is the sink itself).

    Methods: ``"block"`` (hide it from every later query), ``"calibrate"``
    (:func:`~sinklens.interventions.variance.calibrate` its head outputs), ``"clamp"`` (set its
    residual ``dims=`` to ``value=0``), ``"ablate_neurons"`` (zero ``neurons=`` at the sink).
    """
    name = _normalise_method(method)
    build_kw = dict(kw)
    if name == "clamp":
        build_kw["dims"] = dims
    hooks = build_hooks(model, "remove", method, target=sink, sink=sink, layers=layers, **build_kw)
    return measure_intervention(
        model, tokens, hooks, target=sink, sink=sink, method=name, dims=dims,
        loss=loss, batch_size=batch_size, prepend_bos=prepend_bos,
    )


def sweep(
    model: Any,
    tokens: Inputs,
    *,
    method: str = "self_only",
    positions: Sequence[int],
    layer_sets: Sequence[Sequence[int] | None] = (None,),
    alphas: Sequence[float | None] = (None,),
    sink: int = 0,
    loss: bool = False,
    progress: bool = True,
    **kw: Any,
) -> list[dict]:
    """Run :func:`create_sink` over positions × layer sets × α; one tidy row per (config, layer).

    The clean run of each position is computed once. ``alphas`` only matters for ``"variance"``
    (``None`` = the method's default). Rows carry ``position``, ``layers`` (the intervened set as
    a list, ``None`` = all), ``alpha`` and the per-layer numbers of :meth:`InterventionResult.rows`.
    """
    batches = as_batches(model, tokens)
    n_layers = model_dims(model).n_layers
    rows: list[dict] = []
    clean: dict[int, RunStats] = {}
    configs = list(itertools.product(positions, layer_sets, alphas))
    for position, layer_set, alpha in tqdm(configs, desc="sweep", disable=not progress):
        extra = dict(kw)
        if alpha is not None:
            extra["alpha"] = alpha
        hooks = build_hooks(model, "create", method, target=position, sink=sink, layers=layer_set, **extra)
        if position not in clean:
            clean[position] = run_stats(model, batches, [], target=position, sink=sink, loss=loss)
        after = run_stats(model, batches, hooks, target=position, sink=sink, loss=loss)
        res = compare_runs(
            clean[position], after, method=_normalise_method(method), target=position, sink=sink,
            layers=list(range(n_layers)), dims=kw.get("dims"),
        )
        for row in res.rows():
            row.update(position=position, layers=None if layer_set is None else list(layer_set), alpha=alpha)
            if loss:
                row.update(loss_before=res.loss_before, loss_after=res.loss_after)
            rows.append(row)
    return rows


__all__ = [
    "InterventionResult", "RunStats", "PositionResidualReducer", "create_sink", "remove_sink", "sweep",
    "measure_intervention", "run_stats", "compare_runs", "build_hooks", "register_method",
    "CREATE_METHODS", "REMOVE_METHODS",
]
