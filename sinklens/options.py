"""The one object that carries run settings: how prompts become batches and how a pass is shown.

Every analyzer, experiment and :func:`sinklens.run` takes ``options=RunOptions(...)`` instead of
re-declaring these keyword arguments, so the defaults cannot drift between functions. Likewise each
analysis holds one frozen settings dataclass; :func:`settings_from` builds it from ``settings=`` and/or
its fields given as keywords.

Examples:
    >>> opts = RunOptions(batch_size=4, progress=False)
    >>> opts.replace(max_length=32).max_length
    32
    >>> RunOptions(batch_size=0)
    Traceback (most recent call last):
    ...
    sinklens.errors.InvalidArgumentError: batch_size must be an integer >= 1, got 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from sinklens.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

S = TypeVar("S")

# The defaults every entry point shares: the API, the trainer's metrics and each ``sinklens`` command take
# them from here (this module imports no torch, so ``--help`` can print them quickly).

#: A head is a sink head when the mean attention its queries put on the sink exceeds this: the ε of
#: Gu et al. 2024, "When attention sink emerges" (``find_sinks``, ``measure_value_drain``, training evals).
SINK_THRESHOLD = 0.3
#: Sequences per forward pass of an analysis (``RunOptions.batch_size``, every command's ``--batch-size``,
#: the trainer's evaluation batches). Results do not depend on it.
BATCH_SIZE = 8
#: Tokens per random-token sequence (``--random-tokens``, origins measures, ``compare --positional``, the
#: trainer's persistence metrics) and per training sequence (``data.seq_len``); capped at the model's context.
SEQ_LEN = 64

HookFn = Callable[..., Any]


@dataclass(frozen=True)
class RunOptions:
    """Settings of one streaming run, shared by every analyzer and experiment.

    Attributes:
        batch_size: prompts per forward pass (results do not depend on it, see
            :func:`sinklens.streaming.forward`).
        prepend_bos: add the model's own special tokens to each text prompt (a decoder's BOS, an encoder's
            ``[CLS] … [SEP]``, see :mod:`sinklens.inputs`); for token tensors the first column is taken to be
            BOS; None: as the model's own tokenizer does (:func:`sinklens.inputs.tokenizer_adds_bos`). Results
            record what position 0 was (``SinkResult.describe_start()``).
        max_length: keep the first ``max_length`` tokens of every sequence (BOS included; an encoder's text
            prompt keeps its final ``[SEP]``). None truncates nothing: a sequence longer than ``cfg.n_ctx``
            raises :class:`~sinklens.errors.SequenceTooLongError`.
        extra_hooks: ``(hook_name, fn)`` pairs added to every forward before the analyzers' own, e.g.
            an intervention, so the analyzers measure the intervened model.
        progress: show a tqdm bar over batches.
        device: the device the model must run on, checked before the pass (None: no check); batches and
            statistics live on the device of the model's first parameter.
        desc: label of the progress bar.
    """

    batch_size: int = BATCH_SIZE
    prepend_bos: bool | None = True
    max_length: int | None = None
    extra_hooks: Sequence[tuple[str, HookFn]] = field(default=(), compare=False)
    progress: bool = True
    device: str | torch.device | None = None
    desc: str = "sinklens"

    def __post_init__(self) -> None:
        from sinklens.validate import as_bool, positive_int
        from sinklens.validate import device as as_device

        object.__setattr__(self, "batch_size", positive_int(self.batch_size, what="batch_size"))
        if self.max_length is not None:
            object.__setattr__(self, "max_length", positive_int(self.max_length, what="max_length"))
        if self.prepend_bos is not None:
            object.__setattr__(self, "prepend_bos", as_bool(self.prepend_bos, what="RunOptions.prepend_bos"))
        object.__setattr__(self, "progress", as_bool(self.progress, what="RunOptions.progress"))
        object.__setattr__(self, "extra_hooks", hook_pairs(self.extra_hooks, what="RunOptions.extra_hooks"))
        if self.device is not None:
            object.__setattr__(self, "device", as_device(self.device))

    def replace(self, **changes: Any) -> RunOptions:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def hook_pairs(hooks: Any, *, what: str) -> tuple[tuple[str, HookFn], ...]:
    """``hooks`` as a tuple of ``(hook_name, fn)`` pairs, as ``run_with_hooks(fwd_hooks=...)`` takes them; anything
    else (a dict, a bare function, a 1-tuple, a name that is not a string, an ``fn`` that is not callable) raises
    :class:`~sinklens.errors.InvalidArgumentError` naming it, instead of failing inside the first forward pass.

    Examples:
        >>> hook_pairs([("blocks.0.hook_resid_pre", print)], what="extra_hooks")[0][0]
        'blocks.0.hook_resid_pre'
        >>> hook_pairs({"blocks.0.hook_resid_pre": print}, what="extra_hooks")
        Traceback (most recent call last):
        ...
        sinklens.errors.InvalidArgumentError: extra_hooks must be a list of (hook_name, fn) pairs, got a dict; pass list(d.items()) for a dict of hook name -> fn.
    """
    if isinstance(hooks, dict):
        raise InvalidArgumentError(f"{what} must be a list of (hook_name, fn) pairs, got a dict; pass list(d.items()) "
                                   "for a dict of hook name -> fn.")
    if isinstance(hooks, (str, bytes)) or not isinstance(hooks, Sequence):
        raise InvalidArgumentError(f"{what} must be a list of (hook_name, fn) pairs, got {type(hooks).__name__}.")
    pairs = []
    for i, pair in enumerate(hooks):
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise InvalidArgumentError(f"{what}[{i}] must be a (hook_name, fn) pair, got {pair!r}.")
        name, fn = pair
        if not isinstance(name, str) or not callable(fn):
            raise InvalidArgumentError(f"{what}[{i}] must be a (hook_name, fn) pair with a string name and a callable fn, "
                                       f"got ({name!r}, {fn!r}).")
        pairs.append((name, fn))
    return tuple(pairs)


def settings_from(
    cls: type[S], settings: S | None, kwargs: dict[str, Any], where: str, *,
    defaults: dict[str, Any] | None = None, argument: str = "settings",
) -> S:
    """The frozen settings of one analysis, from ``settings=`` and/or its fields given as keywords.

    The keywords in ``kwargs`` named after fields of the dataclass ``cls`` are popped and replace those
    of ``settings`` (``cls(**defaults)`` when None); any other keyword raises ``TypeError`` like Python
    does. A ``settings`` that is not a ``cls`` raises :class:`~sinklens.errors.InvalidArgumentError`
    naming ``argument``, the parameter it was passed as.

    Examples:
        >>> @dataclass(frozen=True)
        ... class Demo:
        ...     threshold: float = 0.3
        ...     top_k: int = 5
        >>> settings_from(Demo, None, {"top_k": 2}, "demo")
        Demo(threshold=0.3, top_k=2)
        >>> settings_from(Demo, Demo(0.5), {}, "demo", defaults={"top_k": 9})
        Demo(threshold=0.5, top_k=5)
        >>> settings_from(Demo, None, {"topk": 2}, "demo")
        Traceback (most recent call last):
        ...
        TypeError: demo() got unexpected keyword arguments ['topk'] (did you mean 'top_k'?).
    """
    names = [f.name for f in dataclasses.fields(cls)]
    if settings is not None and not isinstance(settings, cls):
        raise InvalidArgumentError(
            f"{where}: {argument}= must be a {cls.__name__}, got {type(settings).__name__} {settings!r}; "
            f"pass its fields as keywords instead (e.g. {names[0]}=...).")
    given = {name: kwargs.pop(name) for name in names if name in kwargs}
    no_unknown_kwargs(kwargs, where, known=names)
    if settings is None:
        return cls(**((defaults or {}) | given))
    return dataclasses.replace(settings, **given) if given else settings


def no_unknown_kwargs(kwargs: dict[str, Any], where: str, *, known: Sequence[str] = ()) -> None:
    """Raise ``TypeError`` like Python does if any keyword is left in ``kwargs``, suggesting the closest
    of ``known`` for a likely typo.

    Examples:
        >>> no_unknown_kwargs({"sink_treshold": 0.3}, "demo", known=["sink_threshold", "top_k"])
        Traceback (most recent call last):
        ...
        TypeError: demo() got unexpected keyword arguments ['sink_treshold'] (did you mean 'sink_threshold'?).
    """
    from sinklens.validate import closest

    if kwargs:
        hints = [match for key in sorted(kwargs) if (match := closest(key, known)) is not None]
        hint = f" (did you mean {', '.join(map(repr, hints))}?)" if hints else ""
        raise TypeError(f"{where}() got unexpected keyword arguments {sorted(kwargs)}{hint}.")


def checked_options(options: Any, where: str | None = None) -> RunOptions:
    """``options`` when it is a :class:`RunOptions`, else an :class:`~sinklens.errors.InvalidArgumentError`
    saying what was given and how to build one (a dict is the usual slip).

    Examples:
        >>> checked_options({"batch_size": 2}, "find_sinks")
        Traceback (most recent call last):
        ...
        sinklens.errors.InvalidArgumentError: find_sinks(options=...) takes a sinklens.RunOptions, got dict {'batch_size': 2}; pass options=RunOptions(**{'batch_size': 2}).
    """
    if isinstance(options, RunOptions):
        return options
    build = f"RunOptions(**{options!r:.80})" if isinstance(options, dict) else "RunOptions(batch_size=..., progress=...)"
    raise InvalidArgumentError(f"{f'{where}(options=...)' if where else 'options='} takes a sinklens.RunOptions, got "
                               f"{type(options).__name__} {options!r:.80}; pass options={build}.")

