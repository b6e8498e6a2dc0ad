"""The one streaming loop: run hooks over batches and fold activations into small statistics.

Every analyzer is a :class:`Reducer`. :func:`stream` runs a single forward pass per batch with the
hooks of *all* reducers attached, so several analyzers share one forward, and no activation outlives
the hook (or the batch) that reduced it: memory is flat in the number of prompts.

Writing a reducer::

    class MeanResidNorm(Reducer):
        def __init__(self, model):
            self.total = torch.zeros(model_dims(model).n_layers)
            self.count = 0

        def fwd_hooks(self, batch):
            def fold(act, hook):          # act: [batch, pos, d_model]
                norms = act.norm(dim=-1)[batch.valid]
                self.total[layer_of(hook.name)] += norms.sum()
            return [(hook_name(l, RESID_PRE), fold) for l in range(n_layers)]

        def end_batch(self, batch):
            self.count += int(batch.valid.sum())

        def result(self):
            return self.total / self.count
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from tqdm.auto import tqdm

from sinklens.errors import PatternNotExposedError
from sinklens.hooks import check_hook_names
from sinklens.inputs import TokenBatch

HookFn = Callable[..., Any]


class Reducer:
    """Base class of a streaming analyzer.

    ``fwd_hooks(batch)`` returns ``(hook_name, fn)`` pairs for that batch; each ``fn(act, hook)``
    folds what it needs into the reducer's running state and returns ``None`` (it must not modify
    ``act``). ``end_batch(batch)`` runs after the forward, for folds that combine several hooks.
    ``result()`` turns the state into the analyzer's result object.
    """

    def fwd_hooks(self, batch: TokenBatch) -> list[tuple[str, HookFn]]:
        raise NotImplementedError

    def end_batch(self, batch: TokenBatch) -> None:
        """Called once per batch after the forward pass."""

    def result(self) -> Any:
        raise NotImplementedError


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


def stream(
    model: Any,
    batches: Sequence[TokenBatch],
    reducers: Sequence[Reducer],
    *,
    extra_hooks: Sequence[tuple[str, HookFn]] = (),
    progress: bool = True,
    desc: str = "sinklens",
) -> list[Any]:
    """Run every reducer over every batch with one forward pass per batch; return their results.

    Args:
        extra_hooks: hooks added to every forward before the reducers' own, e.g. an intervention
            from :mod:`sinklens.interventions`, so analyzers measure the intervened model.
        progress: show a tqdm bar over batches.

    Hooks are attached through ``model.hooks(...)`` (one trampoline per hook name, kept across
    batches), so they are removed even if a hook raises.
    Raises :class:`~sinklens.errors.PatternNotExposedError` if a hook the reducers asked for never
    ran (typically ``hook_pattern`` on a model using a fused attention kernel).
    """
    requested: set[str] = set()
    table = _HookTable()
    with torch.inference_mode(), ExitStack() as attached:
        names: list[str] | None = None
        for batch in tqdm(batches, desc=desc, disable=not progress, leave=False):
            hooks = list(extra_hooks)
            for reducer in reducers:
                for name, fn in reducer.fwd_hooks(batch):
                    requested.add(name)
                    hooks.append((name, fn))
            batch_names = sorted({name for name, _ in hooks})
            if batch_names != names:  # (re)attach trampolines only when the set of hook names changes
                check_hook_names(model, batch_names)
                attached.close()
                attached.enter_context(model.hooks(fwd_hooks=[(n, table.trampoline(n)) for n in batch_names]))
                names = batch_names
            table.set(hooks)
            model(batch.tokens, return_type=None)
            for reducer in reducers:
                reducer.end_batch(batch)
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
