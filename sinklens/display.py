"""Short reprs for result objects: what a notebook shows when a cell ends with ``find_sinks(...)``.

A dataclass's own ``repr`` prints every tensor's values, which for a ``[layer, head, key_pos]``
result is hundreds of lines of numbers. Results instead mix in :class:`CompactRepr` (and are
declared ``@dataclass(repr=False)`` so the dataclass does not replace it): one field a line,
tensors as their shape and dtype, long lists and dicts as their length, small settings objects and
scalars as they are. The values stay one attribute away (``result.received``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["CompactRepr", "compact_repr", "short_value"]

#: Lists, tuples and dicts of at most this many scalar items are shown whole.
MAX_SHOWN_ITEMS = 8
#: Strings longer than this are cut (with "...").
MAX_STRING = 60

_SCALARS = (bool, int, float, str, type(None))


def short_value(value: Any) -> str:
    """One line for one field value.

    Examples:
        >>> short_value(torch.zeros(2, 3))
        'Tensor[2, 3] float32'
        >>> short_value(torch.tensor(0.25))
        'Tensor[] float32 = 0.25'
        >>> short_value([0, 1, 2]), short_value(list(range(40)))
        ('[0, 1, 2]', 'list of 40 int')
    """
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        text = f"Tensor[{', '.join(str(n) for n in value.shape)}] {dtype}"
        if value.ndim == 0:
            text += f" = {value.item():.6g}" if value.is_floating_point() else f" = {value.item()}"
        return text
    if isinstance(value, str):
        return repr(value if len(value) <= MAX_STRING else value[: MAX_STRING - 3] + "...")
    if isinstance(value, _SCALARS):
        return repr(value)
    if isinstance(value, (list, tuple)):
        if len(value) <= MAX_SHOWN_ITEMS and all(isinstance(v, _SCALARS) for v in value):
            return repr(value)
        kinds = sorted({type(v).__name__ for v in value})
        return f"{type(value).__name__} of {len(value)} {'/'.join(kinds)}".rstrip()
    if isinstance(value, dict):
        if len(value) <= MAX_SHOWN_ITEMS and all(isinstance(v, _SCALARS) for v in value.values()):
            return repr(value)
        return f"dict of {len(value)} keys"
    if isinstance(value, CompactRepr):
        return f"{type(value).__name__}(...)"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        text = repr(value)  # a settings object: a short line of scalars
        return text if len(text) <= 4 * MAX_STRING else f"{type(value).__name__}(...)"
    return f"<{type(value).__name__}>"


def compact_repr(obj: Any) -> str:
    """``TypeName(`` one ``field=value`` line per dataclass field (see :func:`short_value`) ``)``."""
    lines = [f"    {f.name}={short_value(getattr(obj, f.name))}," for f in dataclasses.fields(obj) if f.repr]
    return f"{type(obj).__name__}(\n" + "\n".join(lines) + "\n)"


class CompactRepr:
    """Mixin for result dataclasses (declared ``@dataclass(repr=False)``): ``repr`` is :func:`compact_repr`."""

    def __repr__(self) -> str:
        return compact_repr(self)
