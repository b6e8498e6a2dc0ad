"""Run settings (:class:`RunOptions`), the shared defaults (no torch import: ``--help`` stays fast),
and :func:`settings_from`, which builds an analysis' settings from ``settings=`` and keywords."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from sinklens.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

S = TypeVar("S")

#: A head is a sink head when the mean attention its queries put on the sink exceeds this: the ε of
#: Gu et al. 2024, "When attention sink emerges".
SINK_THRESHOLD = 0.3
#: Sequences per forward pass (results do not depend on it).
BATCH_SIZE = 8
#: Tokens per random-token sequence and per training sequence; capped at the model's context.
SEQ_LEN = 64
#: What goes before a text: None does what the model's own tokenizer does (True when unreadable).
PREPEND_BOS: bool | None = None

HookFn = Callable[..., Any]
#: Where analyses read attention weights: ``hook_pattern``, queries and keys, or queries and keys above a length.
AttentionMethod = Literal["pattern", "qk", "auto"]
ATTENTION_METHODS: tuple[str, ...] = ("pattern", "qk", "auto")


@dataclass(frozen=True)
class RunOptions:
    """Settings of one streaming run, shared by every analyzer and experiment. ``prepend_bos``: add the model's
    special tokens to text prompts (None: as its own tokenizer does). ``max_length``: keep the first ``max_length``
    tokens (None: longer than ``n_ctx`` raises). ``extra_hooks``: ``(hook_name, fn)`` pairs run before the
    analyzers' own (e.g. an intervention). ``device``: checked against the model before the pass (None: no check).

    Examples:
        >>> RunOptions(batch_size=4).replace(max_length=32).max_length
        32
    """

    batch_size: int = BATCH_SIZE
    prepend_bos: bool | None = PREPEND_BOS
    max_length: int | None = None
    extra_hooks: Sequence[tuple[str, HookFn]] = field(default=(), compare=False)
    progress: bool = True
    device: str | torch.device | None = None
    desc: str = "sinklens"

    def __post_init__(self) -> None:
        from sinklens.validate import as_bool, optional_positive_int, positive_int
        from sinklens.validate import device as as_device
        object.__setattr__(self, "batch_size", positive_int(self.batch_size, what="batch_size"))
        object.__setattr__(self, "max_length", optional_positive_int(self.max_length, what="max_length"))
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
    """``hooks`` as a tuple of ``(hook_name, fn)`` pairs, or an error naming what is wrong."""
    if isinstance(hooks, dict):
        raise InvalidArgumentError(f"{what} must be a list of (hook_name, fn) pairs, got a dict; pass list(d.items()) "
                                   "for a dict of hook name -> fn.")
    if isinstance(hooks, (str, bytes)) or not isinstance(hooks, Sequence):
        raise InvalidArgumentError(f"{what} must be a list of (hook_name, fn) pairs, got {type(hooks).__name__}.")
    for i, pair in enumerate(hooks):
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise InvalidArgumentError(f"{what}[{i}] must be a (hook_name, fn) pair, got {pair!r}.")
        if not isinstance(pair[0], str) or not callable(pair[1]):
            raise InvalidArgumentError(f"{what}[{i}] must be a (hook_name, fn) pair with a string name and a callable fn, "
                                       f"got ({pair[0]!r}, {pair[1]!r}).")
    return tuple((name, fn) for name, fn in hooks)


def settings_from(cls: type[S], settings: S | None, kwargs: dict[str, Any], where: str, *,
                  defaults: dict[str, Any] | None = None, argument: str = "settings") -> S:
    """``settings`` (default ``cls(**defaults)``) with fields given as keywords popped from
    ``kwargs`` replacing them; other keywords raise ``TypeError`` like Python does."""
    names = [f.name for f in dataclasses.fields(cls)]
    if settings is not None and not isinstance(settings, cls):
        raise InvalidArgumentError(
            f"{where}: {argument}= must be a {cls.__name__}, got {type(settings).__name__} {settings!r}; "
            f"pass its fields as keywords instead (e.g. {names[0]}=...).")
    given = {name: kwargs.pop(name) for name in names if name in kwargs}
    if kwargs:
        from sinklens.validate import closest
        hints = [match for key in sorted(kwargs) if (match := closest(key, names)) is not None]
        hint = f" (did you mean {', '.join(map(repr, hints))}?)" if hints else ""
        raise TypeError(f"{where}() got unexpected keyword arguments {sorted(kwargs)}{hint}.")
    if settings is None:
        return cls(**((defaults or {}) | given))
    return dataclasses.replace(settings, **given) if given else settings


def checked_options(options: Any, where: str | None = None) -> RunOptions:
    """``options`` when it is a :class:`RunOptions`, else an error naming the fix."""
    if isinstance(options, RunOptions):
        return options
    build = f"RunOptions(**{options!r:.80})" if isinstance(options, dict) else "RunOptions(batch_size=..., progress=...)"
    raise InvalidArgumentError(f"{f'{where}(options=...)' if where else 'options='} takes a sinklens.RunOptions, got "
                               f"{type(options).__name__} {options!r:.80}; pass options={build}.")

