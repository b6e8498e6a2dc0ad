"""The one streaming loop: every analyzer is a :class:`Reducer`; :func:`stream` runs one forward per
batch with all reducers' hooks attached, and no activation outlives the hook that reduced it.

Examples:
    >>> import torch
    >>> from sinklens.hooks import RESID_PRE, model_dims
    >>> from sinklens.testing import tiny_model
    >>> class MeanResidNorm(Reducer[torch.Tensor]):
    ...     def __init__(self, model):
    ...         self.n_layers = model_dims(model).n_layers
    ...         self.reset()
    ...     def reset(self):
    ...         self.total = torch.zeros(self.n_layers, dtype=torch.float64)
    ...         self.count = 0
    ...     def fwd_hooks(self, batch):
    ...         def fold(act, layer):  # act: [batch, pos, d_model]
    ...             self.total[layer] += act.norm(dim=-1)[batch.valid].sum().double()
    ...         return BatchFold(per_layer_hooks(RESID_PRE, range(self.n_layers), fold))
    ...     def end_batch(self, batch, fold):
    ...         self.count += int(batch.valid.sum())
    ...     def result(self):
    ...         return self.total / self.count
    ...     statistics = ("total", "count")  # what merge() adds up across processes (sinklens.distributed)
    >>> (norms,) = run(tiny_model(), ["t1 t2 t3"], MeanResidNorm(tiny_model()), options=RunOptions(progress=False))
    >>> norms.shape
    torch.Size([2])
"""

from __future__ import annotations

import copy
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import torch
import torch.distributed as dist
from jaxtyping import Bool
from torch import Tensor
from tqdm.auto import tqdm

from sinklens import distributed
from sinklens.errors import UnsupportedArchitectureError
from sinklens.hooks import (
    check_hook_names, check_model_device, eval_mode, exclusive_use, hook_name, refuse_meta_model, running,
)
from sinklens.inputs import Inputs, TokenBatch, as_batches, is_encoder, right_align
from sinklens.options import HookFn, RunOptions, checked_options
from sinklens.validate import finite_weights


R = TypeVar("R")


@dataclass
class BatchFold:
    """What a reducer attaches to one forward pass: ``(hook_name, fn)`` pairs, each folding ``act``
    without modifying it, and per-batch ``state`` handed back to :meth:`Reducer.end_batch`."""

    hooks: list[tuple[str, HookFn]]
    state: Any = None


class Reducer(ABC, Generic[R]):
    """A streaming analyzer: folds activations into running statistics, then builds a result ``R``.
    Reducers compose by holding other reducers and forwarding these calls, not by subclassing."""

    @abstractmethod
    def reset(self) -> None:
        """Zero every running statistic."""

    @abstractmethod
    def fwd_hooks(self, batch: TokenBatch) -> BatchFold:
        """The hooks (and per-batch state) for one forward pass over ``batch``."""

    def end_batch(self, batch: TokenBatch, fold: BatchFold) -> None:  # noqa: B027 - optional hook
        """Called once per batch after the forward pass, with the fold ``fwd_hooks`` returned."""

    @abstractmethod
    def result(self) -> R:
        """The analyzer's result."""

    #: The attributes ``reset()`` zeroes: what :meth:`state_dict` sends and :meth:`merge` combines.
    statistics: ClassVar[tuple[str, ...]] = ()
    #: Those of :attr:`statistics` that combine by their elementwise maximum.
    maxima: ClassVar[tuple[str, ...]] = ()

    def merge(self, other: Reducer[R]) -> None:
        """Fold in ``other`` (the same reducer over later sequences), as if one pass had read both."""
        merge_statistics(self, other, self._declared_statistics())

    def state_dict(self) -> dict[str, Any]:
        """The running statistics named in :attr:`statistics`, every tensor copied to the CPU."""
        return {name: value.state_dict() if isinstance(value := getattr(self, name), Reducer)
                else _map_tensors(value, lambda t: t.detach().cpu()) for name in self._declared_statistics()}

    def _declared_statistics(self) -> tuple[str, ...]:
        if not self.statistics:
            raise NotImplementedError(f"{type(self).__name__} does not declare its statistics (the class attribute "
                                      "statistics = ('name', ...)); it cannot be merged.")
        return self.statistics

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the running statistics by ``state`` (from :meth:`state_dict`), on this reducer's device."""
        device = _statistics_device(self)
        for name in self.statistics:
            if isinstance(current := getattr(self, name), Reducer):
                current.load_state_dict(state[name])
            else:
                setattr(self, name, _map_tensors(state[name], lambda t: t.to(device)))

    def shallow_copy(self) -> Reducer[R]:
        """A shallow copy (nested reducers copied) whose statistics can be replaced alone."""
        clone = copy.copy(self)
        for name in self.statistics:
            if isinstance(value := getattr(clone, name), Reducer):
                setattr(clone, name, value.shallow_copy())
        return clone


def merge_sum(mine: Any, theirs: Any) -> Any:
    """``mine`` combined with ``theirs``: tensors (zero-padded to the larger shape) and numbers add,
    lists concatenate, sets unite, dicts merge key-wise, objects by ``merge``, flags take ``theirs``."""
    if isinstance(mine, Tensor):
        return torch.add(*_same_shape(mine, theirs, 0.0))
    if isinstance(mine, bool):
        return theirs
    if isinstance(mine, (int, float, list)):
        return mine + theirs
    if isinstance(mine, set):
        return mine | theirs
    if isinstance(mine, dict):
        return {k: merge_sum(mine[k], theirs[k]) if k in mine and k in theirs else mine.get(k, theirs.get(k))
                for k in {**mine, **theirs}}
    if hasattr(mine, "merge"):
        mine.merge(theirs)
        return mine
    raise TypeError(f"Cannot merge a statistic of type {type(mine).__name__}; override Reducer.merge.")


def merge_max(mine: Tensor, theirs: Tensor) -> Tensor:
    """Elementwise maximum of two statistics, padded to the larger shape with the dtype's lowest value."""
    dtype = mine.dtype
    lowest = False if dtype == torch.bool else (torch.finfo if dtype.is_floating_point else torch.iinfo)(dtype).min
    return torch.maximum(*_same_shape(mine, theirs, lowest))


def merge_statistics(reducer: Reducer[Any], other: Reducer[Any], names: Sequence[str]) -> None:
    """Combine each attribute ``names`` of ``reducer`` with ``other``'s (``maxima`` by maximum)."""
    for name in names:
        combine = merge_max if name in reducer.maxima else merge_sum
        setattr(reducer, name, combine(getattr(reducer, name), getattr(other, name)))


def grow(t: Tensor, dim: int, size: int, fill: float | int | bool = 0.0) -> Tensor:
    """Pad ``t`` along ``dim`` with ``fill`` up to ``size`` (no-op if already that large)."""
    if t.shape[dim] >= size:
        return t
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, torch.full(shape, fill, dtype=t.dtype, device=t.device)], dim=dim)


def _same_shape(mine: Tensor, theirs: Tensor, fill: float | int | bool) -> tuple[Tensor, Tensor]:
    """Both padded with ``fill`` to the larger shape, ``theirs`` on ``mine``'s device."""
    theirs = theirs.to(mine.device)
    for dim, (a, b) in enumerate(zip(mine.shape, theirs.shape, strict=True)):
        mine, theirs = grow(mine, dim, max(a, b), fill), grow(theirs, dim, max(a, b), fill)
    return mine, theirs


def _map_tensors(value: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``value`` with ``fn`` applied to every tensor inside it (lists, tuples, dicts, helper objects)."""
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    if hasattr(value, "__dict__") and not isinstance(value, type):
        clone = copy.copy(value)
        clone.__dict__.update({k: _map_tensors(v, fn) for k, v in vars(value).items()})
        return clone
    return value


def _statistics_device(reducer: Reducer[Any]) -> torch.device:
    """The device of the reducer's first tensor statistic (CPU if none yet)."""
    for name in reducer.statistics:
        if isinstance(value := getattr(reducer, name), Reducer):
            return _statistics_device(value)
        found: list[Tensor] = []
        _map_tensors(value, lambda t: found.append(t) or t)
        if found:
            return found[0].device
    return torch.device("cpu")


def bound_hooks(names: Sequence[str], keys: Sequence[Any], fold: Callable[[Tensor, Any], Any]) -> list[tuple[str, HookFn]]:
    """``fold(act, keys[i])`` on hook ``names[i]``: the key is bound here, never read back from
    ``hook.name`` (a TransformerBridge reports aliased hooks under their canonical names)."""
    def bind(key: Any) -> HookFn:
        return lambda act, hook: fold(act, key)
    return [(name, bind(key)) for name, key in zip(names, keys, strict=True)]


def per_layer_hooks(site: str, layers: Sequence[int], fold: Callable[[Tensor, int], Any]) -> list[tuple[str, HookFn]]:
    """Bind ``fold(act, layer)`` to ``blocks.{layer}.{site}`` for every layer."""
    return bound_hooks([hook_name(layer, site) for layer in layers], list(layers), fold)


class _HookTable:
    """One trampoline per hook name, attached while the set of names stays the same (registering
    hooks is slow); each batch swaps in its functions, run in order like stacked hooks."""

    def __init__(self) -> None:
        self.fns: dict[str, list[HookFn]] = {}
        self.fired: set[str] = set()

    def set(self, hooks: Sequence[tuple[str, HookFn]]) -> None:
        self.fns = {name: [fn for n, fn in hooks if n == name] for name, _ in hooks}

    def trampoline(self, name: str) -> HookFn:
        def run(act: Any, hook: Any) -> Any:
            self.fired.add(name)
            for fn in self.fns[name]:
                out = fn(act, hook=hook)
                if out is not None:
                    act = out
            return act
        return run


def accepts_attention_mask(model: Any) -> bool:
    """True if ``model(tokens, attention_mask=...)`` is accepted (not by SinkLM)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "attention_mask" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


#: The real-token mask of the padded batch :func:`forward` is running (None outside one).
_RUNNING_MASK: ContextVar[Tensor | None] = ContextVar("sinklens_real_tokens", default=None)


def real_tokens(n_batch: int, n_pos: int) -> Bool[Tensor, "batch pos"] | None:
    """The real-token mask of the padded ``n_batch × n_pos`` batch :func:`forward` is running, for
    hooks that reduce over positions; None when no padded batch of that shape is running."""
    mask = _RUNNING_MASK.get()
    return mask if mask is not None and tuple(mask.shape) == (n_batch, n_pos) else None


def forward(model: Any, batch: TokenBatch, **kwargs: Any) -> Any:
    """Run ``model`` on one right-aligned batch: a causal model needs no mask (pads come after every
    real token), an encoder gets ``attention_mask``; hooks read the mask by :func:`real_tokens`."""
    batch = right_align(batch)
    if batch.padded and is_encoder(model):
        if not accepts_attention_mask(model):
            raise UnsupportedArchitectureError(
                f"{type(model).__name__} takes no attention_mask, so a padded batch cannot run on this bidirectional "
                "model without real tokens attending to padding; use batch_size=1 or equal-length inputs.")
        kwargs["attention_mask"] = batch.valid.long()
    mask = _RUNNING_MASK.set(batch.valid if batch.padded else None)
    try:
        with running(model):
            return model(batch.tokens, **kwargs)
    finally:
        _RUNNING_MASK.reset(mask)


def stream(model: Any, batches: Sequence[TokenBatch], reducers: Sequence[Reducer[Any]], *,
           options: RunOptions = RunOptions()) -> list[Any]:
    """Run every reducer over every batch (one forward each, in eval mode, ``options.extra_hooks``
    first) and return their results; under :func:`sinklens.distributed.session` each process streams
    its share, merged in rank order. A requested hook that never ran is an ``UnsupportedArchitectureError``."""
    options = checked_options(options, "stream")
    check_model_device(model, options.device)
    refuse_meta_model(model)
    finite_weights(model)
    with exclusive_use(model), eval_mode(model):
        return _stream(model, batches, reducers, options)


def _stream(model: Any, batches: Sequence[TokenBatch], reducers: Sequence[Reducer[Any]], options: RunOptions) -> list[Any]:
    is_encoder(model)  # its one probe forward runs now, not inside the pass with the hooks attached
    batches = list(distributed.local_batches(batches))  # all of them, unless sharded over torchrun processes
    on_device = _stats_device_if_split(model)
    requested: set[str] = set()
    table = _HookTable()
    with torch.inference_mode(), ExitStack() as attached:
        names: list[str] | None = None
        progress = options.progress and distributed.is_main()
        for batch in tqdm(batches, desc=options.desc, disable=not progress, leave=False):
            batch = right_align(batch)
            folds = [reducer.fwd_hooks(batch) for reducer in reducers]
            own = [(name, fn if on_device is None else _moved_to(fn, on_device))
                   for fold in folds for name, fn in fold.hooks]
            requested.update(name for name, _ in own)
            hooks = [*options.extra_hooks, *own]
            batch_names = sorted({name for name, _ in hooks})
            if batch_names != names:  # (re)attach trampolines only when the set of hook names changes
                check_hook_names(model, batch_names)
                attached.close()
                attached.enter_context(model.hooks(fwd_hooks=[(n, table.trampoline(n)) for n in batch_names]))
                names = batch_names
            table.set(hooks)
            forward(model, batch, return_type=None)
            for reducer, fold in zip(reducers, folds):
                reducer.end_batch(batch, fold)
    if batches and (silent := sorted({name for name, _ in options.extra_hooks} - table.fired)):
        raise UnsupportedArchitectureError(
            f"extra_hooks on {silent[:4]}{'...' if len(silent) > 4 else ''} never ran during the forward pass, so they "
            "changed nothing (e.g. TransformerLens 3 runs attn.hook_result only after set_use_attn_result(True), "
            "a fused attention kernel skips hook_pattern). Hook a point that runs.")
    if missing := sorted(requested - table.fired):
        raise UnsupportedArchitectureError(
            f"Hooks {missing[:4]}{'...' if len(missing) > 4 else ''} never ran during the forward pass: the attention "
            "implementation probably bypasses them (a fused SDPA/flash kernel hides hook_pattern). Load the model "
            "with eager attention (sinklens.load_model and TransformerBridge.boot_transformers do).")
    combine_across_ranks(reducers, n_local_batches=len(batches))
    return [reducer.result() for reducer in reducers]


def _stats_device_if_split(model: Any) -> torch.device | None:
    """Where reducers keep statistics on a model split over devices (its first parameter's); else None."""
    devices = [p.device for p in getattr(model, "parameters", lambda: ())()]
    return devices[0] if len(set(devices)) > 1 else None


def _moved_to(fn: HookFn, device: torch.device) -> HookFn:
    """A reducer hook that reads its activation on ``device``, whichever device the layer ran on."""
    return lambda act, hook: fn(act.to(device) if isinstance(act, Tensor) else act, hook=hook)


def combine_across_ranks(reducers: Sequence[Reducer[Any]], *, n_local_batches: int) -> None:
    """Give every process's ``reducers`` all processes' statistics (``all_gather_object`` of each
    :meth:`Reducer.state_dict`), merged in rank order, skipping ranks that streamed no batch."""
    if not distributed.active() or not reducers:
        return
    payload = (n_local_batches, [reducer.state_dict() for reducer in reducers])
    gathered: list[Any] = [None] * distributed.world_size()
    dist.all_gather_object(gathered, payload)
    states = [r_states for n, r_states in gathered if n > 0]
    if not states:
        return
    for i, reducer in enumerate(reducers):
        reducer.load_state_dict(states[0][i])
        for r_states in states[1:]:
            other = reducer.shallow_copy()
            other.load_state_dict(r_states[i])
            reducer.merge(other)


def run(model: Any, inputs: Inputs | None, *reducers: Reducer[Any], options: RunOptions = RunOptions()) -> list[Any]:
    """:func:`stream` every reducer over ``inputs`` (anything :func:`as_batches` takes)."""
    options = checked_options(options, "run")
    return stream(model, batches_for(model, inputs, options), list(reducers), options=options)


def batches_for(model: Any, inputs: Inputs | None, options: RunOptions) -> list[TokenBatch]:
    """``inputs`` as batches by ``options`` (:func:`~sinklens.inputs.as_batches`), the device checked."""
    check_model_device(model, options.device)
    refuse_meta_model(model)
    return as_batches(model, inputs, batch_size=options.batch_size, prepend_bos=options.prepend_bos,
                      max_length=options.max_length)
