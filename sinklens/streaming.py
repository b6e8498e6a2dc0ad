"""The one streaming loop: run hooks over batches and fold activations into small statistics.

Every analyzer is a :class:`Reducer`. :func:`stream` runs a single forward pass per batch with the
hooks of *all* reducers attached, so several analyzers share one forward, and no activation outlives
the hook (or the batch) that reduced it: memory is flat in the number of prompts. :func:`run` does
the same from any accepted input (strings, token tensors, batches) and a :class:`RunOptions`.

Writing a reducer:

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
    >>> (norms,) = run(tiny_model(), ["t1 t2 t3"], MeanResidNorm(tiny_model()), options=RunOptions(progress=False))
    >>> norms.shape
    torch.Size([2])
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from tqdm.auto import tqdm

from sinklens.errors import PatternNotExposedError, UnsupportedArchitectureError
from torch import Tensor

from sinklens.hooks import check_hook_names, hook_name
from sinklens.inputs import Inputs, TokenBatch, as_batches, is_encoder, right_align
from sinklens.options import HookFn, RunOptions


R = TypeVar("R")


@dataclass
class BatchFold:
    """What a reducer attaches to one forward pass.

    Attributes:
        hooks: ``(hook_name, fn)`` pairs; each ``fn(act, hook)`` folds what it needs and returns
            ``None`` (it must not modify ``act``).
        state: anything the reducer computed for this batch and wants back in
            :meth:`Reducer.end_batch` (e.g. per-batch query weights); per-batch state lives here,
            never on the reducer instance.
    """

    hooks: list[tuple[str, HookFn]]
    state: Any = None


class Reducer(ABC, Generic[R]):
    """A streaming analyzer: folds activations into running statistics, then builds a result ``R``.

    The contract:

    * ``reset()`` zeroes the running statistics; a reducer can be reused for a new pass.
    * ``fwd_hooks(batch)`` returns the :class:`BatchFold` for that batch.
    * ``end_batch(batch, fold)`` runs after the forward with the same fold, for folds that combine
      several hooks (optional).
    * ``result()`` turns the statistics into the analyzer's result object, without changing them.

    Reducers compose by holding other reducers and forwarding these calls, not by subclassing.
    """

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


def bound_hooks(names: Sequence[str], keys: Sequence[Any], fold: Callable[[Tensor, Any], Any]) -> list[tuple[str, HookFn]]:
    """The one way to bind a hook to what it measures: ``fold(act, key)`` on hook ``names[i]`` with ``keys[i]``.

    The key is bound when the hook is built, never read back from ``hook.name`` (a TransformerBridge
    reports aliased hooks under their canonical names).

    Examples:
        >>> [(name, fn(None, None)) for name, fn in bound_hooks(["a", "b"], [0, 1], lambda act, key: key)]
        [('a', 0), ('b', 1)]
    """

    def bind(key: Any) -> HookFn:
        def hook_fn(act: Any, hook: Any) -> Any:
            return fold(act, key)

        return hook_fn

    return [(name, bind(key)) for name, key in zip(names, keys, strict=True)]


def per_layer_hooks(site: str, layers: Sequence[int], fold: Callable[[Tensor, int], Any]) -> list[tuple[str, HookFn]]:
    """Bind ``fold(act, layer)`` to ``blocks.{layer}.{site}`` for every layer (see :func:`bound_hooks`).

    Examples:
        >>> [name for name, _ in per_layer_hooks("attn.hook_pattern", [0, 2], lambda act, layer: None)]
        ['blocks.0.attn.hook_pattern', 'blocks.2.attn.hook_pattern']
    """
    return bound_hooks([hook_name(layer, site) for layer in layers], list(layers), fold)


class _HookTable:
    """One trampoline per hook name, attached once; each batch swaps in that batch's functions.

    Registering hundreds of TransformerLens hooks costs real time (a handle per hook), so
    :func:`stream` attaches one trampoline per name for as long as the set of names stays the same
    and only replaces the per-batch function lists. A trampoline runs its functions in order, each
    receiving the previous one's output when it returns one, exactly like stacked TransformerLens hooks.
    """

    def __init__(self) -> None:
        self.fns: dict[str, list[HookFn]] = {}
        self.fired: set[str] = set()

    def set(self, hooks: Sequence[tuple[str, HookFn]]) -> None:
        self.fns = {}
        for name, fn in hooks:
            self.fns.setdefault(name, []).append(fn)

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
    """True if ``model(tokens, attention_mask=...)`` is accepted (TransformerLens 3.x ``HookedTransformer`` and
    4.x ``TransformerBridge`` both are; sinklens' own :class:`~sinklens.train.model.SinkLM` is not)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "attention_mask" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def forward(model: Any, batch: TokenBatch, **kwargs: Any) -> Any:
    """Run ``model`` on one batch the way every analyzer does: a padded batch is right-aligned
    (:func:`~sinklens.inputs.right_align`) and passes ``attention_mask=batch.valid`` so no real token
    attends to padding (decoders and encoders alike), and no real token's activations depend on the batch
    size or the padding side. A model without an ``attention_mask`` argument runs a right-padded batch as
    it is when it is causal (pads come after every real token, so they change nothing); a padded batch on a
    bidirectional model without one is refused (:class:`~sinklens.errors.UnsupportedArchitectureError`).
    """
    batch = right_align(batch)
    if not batch.padded:
        return model(batch.tokens, **kwargs)
    if accepts_attention_mask(model):
        return model(batch.tokens, attention_mask=batch.valid.long(), **kwargs)
    if is_encoder(model):
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} takes no attention_mask, so a padded batch cannot run on this bidirectional "
            "model without real tokens attending to padding; use batch_size=1 or equal-length inputs."
        )
    return model(batch.tokens, **kwargs)


def stream(
    model: Any,
    batches: Sequence[TokenBatch],
    reducers: Sequence[Reducer[Any]],
    *,
    options: RunOptions = RunOptions(),
) -> list[Any]:
    """Run every reducer over every batch with one forward pass per batch; return their results.

    ``options.extra_hooks`` run before the reducers' own hooks on every forward (e.g. an
    intervention from :mod:`sinklens.interventions`, so analyzers measure the intervened model);
    ``options.progress`` shows a tqdm bar over batches. The other fields of ``options`` concern
    tokenization and are used by :func:`run`. Left-padded batches are right-aligned first and padded
    batches run with an attention mask (:func:`forward`).

    Hooks are attached through ``model.hooks(...)`` (one trampoline per hook name, kept across
    batches), so they are removed even if a hook raises.
    Raises :class:`~sinklens.errors.PatternNotExposedError` if a hook the reducers asked for never
    ran (typically ``hook_pattern`` on a model using a fused attention kernel).
    """
    requested: set[str] = set()
    table = _HookTable()
    with torch.inference_mode(), ExitStack() as attached:
        names: list[str] | None = None
        for batch in tqdm(batches, desc=options.desc, disable=not options.progress, leave=False):
            batch = right_align(batch)
            hooks = list(options.extra_hooks)
            folds = [reducer.fwd_hooks(batch) for reducer in reducers]
            for fold in folds:
                for name, fn in fold.hooks:
                    requested.add(name)
                    hooks.append((name, fn))
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
    fired = table.fired
    missing = sorted(requested - fired)
    if missing:
        raise PatternNotExposedError(
            f"Hooks {missing[:4]}{'...' if len(missing) > 4 else ''} never ran during the forward pass. "
            "The model's attention implementation probably bypasses them (e.g. a fused SDPA/flash kernel "
            "hides hook_pattern). Load the model with eager attention (sinklens.load_model does) "
            "or use TransformerBridge.boot_transformers, which forces it."
        )
    return [reducer.result() for reducer in reducers]


def run(model: Any, inputs: Inputs | None, *reducers: Reducer[Any], options: RunOptions = RunOptions()) -> list[Any]:
    """Tokenize ``inputs`` by ``options`` and :func:`stream` every reducer over them; return their results.

    ``inputs`` is anything :func:`~sinklens.inputs.as_batches` accepts (None = the built-in prompts).
    """
    batches = as_batches(
        model, inputs, batch_size=options.batch_size, prepend_bos=options.prepend_bos, max_length=options.max_length
    )
    return stream(model, batches, list(reducers), options=options)
