"""Shared validators for user input: every public function checks its arguments here, once.

Each validator returns the normalised value or raises :class:`~sinklens.errors.InvalidArgumentError`
(a ``ValueError``) whose message names the argument, the bad value and what is accepted. Integers
may be Python ints, numpy integers or 0-d integer tensors; booleans are never integers.

Examples:
    >>> index_list([0, -1], 4, what="layer")
    [0, 3]
    >>> index_list([], 4, what="layer")
    Traceback (most recent call last):
    ...
    sinklens.errors.InvalidArgumentError: layer: an empty list was given; pass at least one layer in 0..3 (or None for all).
    >>> finite_number(float("nan"), what="alpha")
    Traceback (most recent call last):
    ...
    sinklens.errors.InvalidArgumentError: alpha must be a finite number, got nan.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from sinklens.errors import InvalidArgumentError


def as_int(value: Any, *, what: str) -> int:
    """``value`` as a Python int: ints, numpy integers and 0-d integer tensors are accepted, bools are not."""
    if isinstance(value, torch.Tensor):
        if value.ndim != 0 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise InvalidArgumentError(f"{what} must be an integer, got a tensor of shape {tuple(value.shape)} and dtype {value.dtype}.")
        return int(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(f"{what} must be an integer, got {value!r} ({type(value).__name__}).")
    return int(value)


def as_float(value: Any, *, what: str) -> float:
    """``value`` as a Python float (ints, numpy scalars and 0-d tensors accepted; bools and strings not)."""
    if isinstance(value, torch.Tensor):
        if value.ndim != 0 or value.dtype == torch.bool:
            raise InvalidArgumentError(f"{what} must be a number, got a tensor of shape {tuple(value.shape)}.")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{what} must be a number, got {value!r} ({type(value).__name__}).")
    return float(value)


def finite_number(value: Any, *, what: str, low: float | None = None, high: float | None = None,
                  low_open: bool = False, high_open: bool = False) -> float:
    """A finite float, optionally inside ``[low, high]`` (``low_open``/``high_open`` exclude the ends)."""
    x = as_float(value, what=what)
    if not math.isfinite(x):
        raise InvalidArgumentError(f"{what} must be a finite number, got {x}.")
    too_low = low is not None and (x <= low if low_open else x < low)
    too_high = high is not None and (x >= high if high_open else x > high)
    if too_low or too_high:
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        raise InvalidArgumentError(f"{what} must be in {left}{lo}, {hi}{right}, got {x:g}.")
    return x


def positive_int(value: Any, *, what: str, minimum: int = 1) -> int:
    """An int ``>= minimum`` (default 1)."""
    n = as_int(value, what=what)
    if n < minimum:
        raise InvalidArgumentError(f"{what} must be an integer >= {minimum}, got {n}.")
    return n


def index_list(values: Any, size: int, *, what: str, allow_negative: bool = True) -> list[int]:
    """Normalise an int-or-sequence index argument into a list of indices in ``0..size-1``.

    Negative indices count from the end when ``allow_negative``. An empty sequence is an error (use
    ``None`` upstream for "all"). Duplicates are kept in order of first appearance only.
    """
    if isinstance(values, torch.Tensor) and values.ndim == 1:
        values = values.tolist()
    elif type(values).__module__ == "numpy" and getattr(values, "ndim", 0) == 1:  # a 1-D numpy array
        values = values.tolist()
    raw = list(values) if isinstance(values, Sequence) and not isinstance(values, str) else [values]
    if not raw:
        raise InvalidArgumentError(f"{what}: an empty list was given; pass at least one {what} in 0..{size - 1} (or None for all).")
    out: list[int] = []
    for value in raw:
        idx = as_int(value, what=what)
        if idx < 0 and allow_negative:
            idx += size
        if not 0 <= idx < size:
            lo = -size if allow_negative else 0
            raise InvalidArgumentError(f"{what} {value!r} is out of range: expected an integer in {lo}..{size - 1}.")
        if idx not in out:
            out.append(idx)
    return out


def index(value: Any, size: int, *, what: str, allow_negative: bool = True) -> int:
    """One index in ``0..size-1`` (an int, numpy integer or 0-d tensor; negatives count from the end).

    Examples:
        >>> index(-1, 4, what="layer")
        3
    """
    idx = as_int(value, what=what)
    lo = -size if allow_negative else 0
    if not lo <= idx < size:
        raise InvalidArgumentError(f"{what} {value!r} is out of range: expected an integer in {lo}..{size - 1}.")
    return idx + size if idx < 0 else idx


def optional_index_list(values: Any, size: int, *, what: str, allow_negative: bool = True) -> list[int]:
    """:func:`index_list`, with ``None`` meaning all of ``0..size-1``."""
    if values is None:
        return list(range(size))
    return index_list(values, size, what=what, allow_negative=allow_negative)


def choice(value: Any, options: Sequence[str], *, what: str) -> str:
    """One of ``options`` (a ``Literal`` mode), with a did-you-mean hint."""
    if value in options:
        return value
    import difflib

    close = difflib.get_close_matches(str(value), list(options), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise InvalidArgumentError(f"{what} must be one of {list(options)}, got {value!r}.{hint}")


def writable_dir(path: Any, *, what: str) -> Path:
    """A folder that exists or can be created, and that we can write into; checked before any work.

    Creates the folder (and parents) if needed. Raises :class:`~sinklens.errors.OutputNotWritableError`
    naming the path otherwise. ``''`` is rejected rather than read as the current directory.
    """
    import os


    from sinklens.errors import OutputNotWritableError

    if path is None or str(path).strip() == "":
        raise OutputNotWritableError(f"{what} is empty; give a folder path (use '.' for the current folder).")
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise OutputNotWritableError(f"{what} {str(folder)!r} exists and is not a folder.")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputNotWritableError(f"{what} {str(folder)!r} cannot be created: {err.strerror or err}.") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputNotWritableError(f"{what} {str(folder)!r} is not writable.")
    return folder


def writable_file(path: Any, *, what: str) -> Path:
    """A file path whose folder exists (or can be created) and is writable, and that is not a folder."""


    from sinklens.errors import OutputNotWritableError

    if path is None or str(path).strip() == "":
        raise OutputNotWritableError(f"{what} is empty; give a file path.")
    file = Path(path).expanduser()
    if file.is_dir():
        raise OutputNotWritableError(f"{what} {str(file)!r} is a folder; give a file path.")
    writable_dir(file.parent if str(file.parent) else ".", what=f"the folder of {what}")
    if file.exists():
        import os

        if not os.access(file, os.W_OK):
            raise OutputNotWritableError(f"{what} {str(file)!r} exists and is not writable.")
    return file
