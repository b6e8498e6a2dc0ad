"""Short reprs (one field a line, tensors as shape and dtype) and structural equality for result objects."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["CompactRepr", "StructuralEq", "compact_repr", "neuron_name", "same_value", "short_value", "times_elsewhere"]

#: Lists, tuples and dicts of at most this many scalar items are shown whole.
MAX_SHOWN_ITEMS = 8
#: Strings longer than this are cut (with "...").
MAX_STRING = 60

_SCALARS = (bool, int, float, str, type(None))


def short_value(value: Any) -> str:
    """One line for one field value: a tensor as its shape and dtype, a long container as its length."""
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
    if isinstance(value, (list, tuple, dict)):
        items = list(value.values() if isinstance(value, dict) else value)
        if len(items) <= MAX_SHOWN_ITEMS and all(isinstance(v, _SCALARS) for v in items):
            return repr(value)
        if isinstance(value, dict):
            return f"dict of {len(value)} keys"
        kinds = "/".join(sorted({type(v).__name__ for v in items}))
        return f"{type(value).__name__} of {len(value)} {kinds}".rstrip()
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


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach(), b.detach().to(a.device)
    if a.is_complex():  # NaN compared part by part
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    same = a == b
    if a.is_floating_point():
        same |= a.isnan() & b.isnan()
    return bool(same.all())


def same_value(a: Any, b: Any) -> bool:
    """Structural equality: tensors and arrays in shape, dtype and values, numbers, containers item by item,
    dataclasses field by field; NaN equals NaN."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same_tensor(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape and a.dtype == b.dtype
                and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")))  # only float and complex hold NaN
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(same_value(getattr(a, f.name), getattr(b, f.name))
                                          for f in dataclasses.fields(a) if f.compare)
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        return (isinstance(a, Mapping) and isinstance(b, Mapping) and a.keys() == b.keys()
                and all(same_value(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (isinstance(a, list) == isinstance(b, list) and isinstance(a, tuple) == isinstance(b, tuple)
                and len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b)))
    try:
        return bool(a == b) or all(isinstance(x, numbers.Number) and x != x for x in (a, b))  # NaN == NaN
    except (TypeError, ValueError, RuntimeError):  # no single truth value
        return False


class StructuralEq:
    """Mixin for result dataclasses (``@dataclass(eq=False)``): ``==`` by :func:`same_value`; unhashable."""

    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:
        return same_value(self, other) if type(other) is type(self) else NotImplemented


class CompactRepr(StructuralEq):
    """Mixin for result dataclasses (``@dataclass(repr=False, eq=False)``): :func:`compact_repr`, structural ``==``."""

    def __repr__(self) -> str:
        return compact_repr(self)


def neuron_name(layer: int, neuron: int) -> str:
    """A neuron's one spelling in text and figures: ``L11N1229`` is MLP neuron 1229 of block 11."""
    return f"L{int(layer)}N{int(neuron)}"


#: Above this ratio the value elsewhere is called zero ("silent elsewhere"), not a number of times.
SILENT_RATIO = 1e4


def times_elsewhere(ratio: float) -> str:
    """``ratio`` (a value at the sink over its RMS elsewhere) in words; ``"silent elsewhere"`` above :data:`SILENT_RATIO`.

    Examples:
        >>> times_elsewhere(37.2), times_elsewhere(726154543104.0), times_elsewhere(float("nan"))
        ('37x its RMS elsewhere', 'silent elsewhere', 'no other position measured')
    """
    if math.isnan(ratio):
        return "no other position measured"
    return "silent elsewhere" if abs(ratio) > SILENT_RATIO else f"{ratio:.0f}x its RMS elsewhere"
