"""Validators for user input where it enters: each returns the normalised value or raises an error naming the
argument, the bad value and what is accepted. Integers may be numpy integers or 0-d tensors, never bools."""

from __future__ import annotations

import difflib
import math
import numbers
import os
import weakref
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch

from sinklens.errors import InvalidArgumentError, OutputExistsError, OutputNotWritableError

#: A count or length argument: a Python int, a numpy integer or a 0-d integer tensor (see :func:`as_int`).
IntLike = Union[int, numbers.Integral, torch.Tensor]


def as_int(value: Any, *, what: str) -> int:
    """``value`` as a Python int: ints, numpy integers and 0-d integer tensors are accepted, bools are not."""
    if isinstance(value, torch.Tensor):
        if value.ndim != 0 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise InvalidArgumentError(f"{what} must be an integer, got a tensor of shape {tuple(value.shape)} and dtype {value.dtype}.")
        return int(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(f"{what} must be an integer, got {value!r} ({type(value).__name__}).")
    return int(value)


def as_seed(value: Any, *, what: str = "seed") -> int:
    """``value`` as a seed in ``0 .. 2**64 - 1`` (``torch.manual_seed``'s range; a negative one is refused)."""
    seed = as_int(value, what=what)
    if not 0 <= seed <= 2**64 - 1:
        raise InvalidArgumentError(f"{what} must be an integer from 0 to 2**64 - 1, got {seed}.")
    return seed


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
        lo, hi = "-inf" if low is None else f"{low:g}", "inf" if high is None else f"{high:g}"
        interval = f"{'(' if low_open else '['}{lo}, {hi}{')' if high_open else ']'}"
        raise InvalidArgumentError(f"{what} must be in {interval}, got {x:g}.")
    return x


def positive_int(value: Any, *, what: str, minimum: int = 1) -> int:
    """An int ``>= minimum`` (default 1)."""
    n = as_int(value, what=what)
    if n < minimum:
        raise InvalidArgumentError(f"{what} must be an integer >= {minimum}, got {n}.")
    return n


def index_list(values: Any, size: int, *, what: str, allow_negative: bool = True) -> list[int]:
    """An int or a sequence of them (1-D tensors and arrays too) as distinct :func:`index` values, in order."""
    if getattr(values, "ndim", 0) == 1 and hasattr(values, "tolist"):  # a 1-D tensor or numpy array
        values = values.tolist()
    raw = list(values) if isinstance(values, Sequence) and not isinstance(values, str) else [values]
    if not raw:
        raise InvalidArgumentError(f"{what}: an empty list was given; pass at least one {what} in 0..{size - 1} (or None for all).")
    return list(dict.fromkeys(index(value, size, what=what, allow_negative=allow_negative) for value in raw))


def index(value: Any, size: int, *, what: str, allow_negative: bool = True) -> int:
    """One index in ``0..size-1`` (an int, numpy integer or 0-d tensor; negatives count from the end)."""
    idx = as_int(value, what=what)
    lo = -size if allow_negative else 0
    if not lo <= idx < size:
        raise InvalidArgumentError(f"{what} {value!r} is out of range: expected an integer in {lo}..{size - 1}.")
    return idx + size if idx < 0 else idx


def optional_index_list(values: Any, size: int, *, what: str, allow_negative: bool = True) -> list[int]:
    """:func:`index_list`, with ``None`` meaning all of ``0..size-1``."""
    return list(range(size)) if values is None else index_list(values, size, what=what, allow_negative=allow_negative)


def closest(value: Any, known: Iterable[str]) -> str | None:
    """The entry of ``known`` closest to ``value`` (``difflib``'s ratio of at least 0.6), or None."""
    return next(iter(difflib.get_close_matches(str(value), list(known), n=1)), None)


def did_you_mean(value: Any, known: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the :func:`closest` entry of ``known``, or ``""`` when none is close."""
    return f" (did you mean {match!r}?)" if (match := closest(value, known)) is not None else ""


def choice(value: Any, options: Sequence[str], *, what: str) -> str:
    """One of ``options`` (a ``Literal`` mode), with a did-you-mean hint."""
    if value in options:
        return value
    hint = f" Did you mean {close!r}?" if (close := closest(value, options)) is not None else ""
    raise InvalidArgumentError(f"{what} must be one of {list(options)}, got {value!r}.{hint}")


def writable_dir(path: Any, *, what: str, create: bool = True) -> Path:
    """A writable folder, created with its parents (``create=False``: only checked that it could be, from its
    nearest existing ancestor); else :class:`~sinklens.errors.OutputNotWritableError` naming the path."""
    if path is None or str(path).strip() == "":
        raise OutputNotWritableError(f"{what} is empty; give a folder path (use '.' for the current folder).")
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise OutputNotWritableError(f"{what} {str(folder)!r} exists and is not a folder.")
    if create:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise OutputNotWritableError(f"{what} {str(folder)!r} cannot be created: {err.strerror or err}.") from None
    existing = next(p for p in (folder.absolute(), *folder.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise OutputNotWritableError(f"{what} {str(folder)!r} cannot be created: {str(existing)!r} is not a folder.")
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "is not writable" if existing == folder.absolute() else f"cannot be created: {str(existing)!r} is not writable"
        raise OutputNotWritableError(f"{what} {str(folder)!r} {why}.")
    return folder


def writable_file(path: Any, *, what: str) -> Path:
    """A file path, not a folder, whose folder is or could be made writable; nothing is created."""
    if path is None or str(path).strip() == "":
        raise OutputNotWritableError(f"{what} is empty; give a file path.")
    file = Path(path).expanduser()
    if file.is_dir():
        raise OutputNotWritableError(f"{what} {str(file)!r} is a folder; give a file path.")
    writable_dir(file.parent, what=f"the folder of {what}", create=False)
    if file.exists() and not os.access(file, os.W_OK):
        raise OutputNotWritableError(f"{what} {str(file)!r} exists and is not writable.")
    return file


def no_finished_output(paths: Sequence[Path], *, overwrite: bool, flag: str) -> None:
    """Unless ``overwrite``, refuse the first of ``paths`` that exists (:class:`OutputExistsError`), saying when."""
    for path in () if overwrite else paths:
        if path.exists():
            when = datetime.fromtimestamp(path.stat().st_mtime, tz=timezone.utc).strftime("%Y-%m-%d %H:%M")
            raise OutputExistsError(f"{flag} would replace {str(path)!r} (written {when} UTC), a finished result; "
                                    f"pass --overwrite to replace it, or another {flag}.")


def optional_positive_int(value: Any, *, what: str, minimum: int = 1) -> int | None:
    """:func:`positive_int`, with ``None`` passed through (e.g. ``max_length=None``: no truncation)."""
    return None if value is None else positive_int(value, what=what, minimum=minimum)


def as_bool(value: Any, *, what: str) -> bool:
    """A real boolean (``True``/``False``, numpy bools and 0-d bool tensors); ``1``, ``"yes"`` ... are refused."""
    if isinstance(value, (bool, np.bool_)) or (
            isinstance(value, torch.Tensor) and value.ndim == 0 and value.dtype == torch.bool):
        return bool(value)
    raise InvalidArgumentError(f"{what} must be True or False, got {value!r} ({type(value).__name__}).")


def prompt_list(prompts: Any, *, what: str = "prompts") -> list[str]:
    """A string or a non-empty sequence of strings, as a list; mixed lists name the first odd element."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence):
        raise InvalidArgumentError(f"{what} must be a string or a list of strings, got {type(prompts).__name__}.")
    items = list(prompts)
    if not items:
        raise InvalidArgumentError(f"{what} is empty; pass at least one string.")
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise InvalidArgumentError(
                f"{what}[{i}] must be a string like the others, got {item!r} ({type(item).__name__}).")
    return items


def token_ids(tokens: Any, d_vocab: int, *, what: str = "token ids") -> torch.Tensor:
    """An integer tensor ``[batch, pos]`` (a 1-D one gains a batch axis) with every id in ``0..d_vocab-1``,
    checked before any forward pass (on CUDA a bad id is a device-side assert that breaks the process)."""
    if not isinstance(tokens, torch.Tensor):
        raise InvalidArgumentError(f"{what} must be an integer tensor [batch, pos], got {type(tokens).__name__}.")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise InvalidArgumentError(f"{what} must be an integer tensor [batch, pos], got dtype {tokens.dtype}.")
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2:
        raise InvalidArgumentError(f"{what} must be a tensor [batch, pos], got shape {tuple(tokens.shape)}.")
    if tokens.numel() == 0:
        raise InvalidArgumentError(f"{what} is empty (shape {tuple(tokens.shape)}); pass at least one token.")
    check_vocab(tokens, d_vocab, what=what)
    return tokens.long()


def check_vocab(tokens: torch.Tensor, d_vocab: int, *, what: str = "token ids") -> None:
    """Raise unless every id in ``tokens`` lies in ``0..d_vocab-1`` (names the first bad id and where)."""
    bad = (tokens < 0) | (tokens >= d_vocab)
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        value = int(tokens[tuple(where)].item())
        raise InvalidArgumentError(
            f"{what} must be in 0..{d_vocab - 1} (the model's d_vocab is {d_vocab}), got {value} at {where}.")


_FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")


def dtype(value: Any, *, what: str = "dtype") -> torch.dtype:
    """A floating ``torch.dtype`` from a dtype or its name (``"bfloat16"``, ``"torch.float16"``, ``"fp16"``)."""
    resolved = value if isinstance(value, torch.dtype) else None
    if isinstance(value, str):
        name = value.strip().lower().replace("torch.", "")
        name = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16", "float": "float32",
                "fp64": "float64", "double": "float64"}.get(name, name)
        resolved = getattr(torch, name, None) if name else None
    if not isinstance(resolved, torch.dtype):
        raise InvalidArgumentError(f"Unknown {what} {value!r}; use one of {list(_FLOAT_DTYPES)}.")
    if not resolved.is_floating_point:
        raise InvalidArgumentError(f"{what} must be a floating dtype for model weights ({list(_FLOAT_DTYPES)}), got {resolved}.")
    return resolved


def device(value: Any, *, what: str = "device") -> torch.device:
    """A ``torch.device`` that this machine has: ``cuda``/``cuda:N`` need that GPU, ``mps`` needs Apple's backend."""
    if not isinstance(value, torch.device) and (not isinstance(value, str) or not value.strip()):
        raise InvalidArgumentError(f"{what} must be a device name like 'cpu' or 'cuda', got {value!r}.")
    try:
        dev = value if isinstance(value, torch.device) else torch.device(value.strip().lower())
    except (RuntimeError, ValueError):
        raise InvalidArgumentError(f"Unknown {what} {value!r}; use 'cpu', 'cuda', 'cuda:N' or 'mps'.") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise InvalidArgumentError(f"{what} {str(value)!r} needs a CUDA GPU, and this machine has none; use 'cpu'.")
        if dev.index is not None and dev.index >= n:
            raise InvalidArgumentError(f"{what} {str(value)!r}: this machine has {n} CUDA GPU(s), cuda:0..cuda:{n - 1}.")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise InvalidArgumentError(f"{what} {str(value)!r} needs Apple's MPS backend, which is not available here; use 'cpu'.")
    elif dev.type not in ("cpu", "mps"):
        raise InvalidArgumentError(f"Unknown {what} {value!r}; use 'cpu', 'cuda', 'cuda:N' or 'mps'.")
    return dev


def refuse_binary(file: Path, head: bytes, *, what: str, give: str = "a UTF-8 text file") -> None:
    """Refuse ``file`` as binary when ``head`` (its first bytes) holds a NUL byte in its first 8 KiB."""
    if b"\x00" in head[:8192]:
        raise InvalidArgumentError(f"{what} file {str(file)!r} is a binary file (it holds NUL bytes); give {give}.")


def text_lines(path: Any, *, what: str) -> list[str]:
    """The non-empty, stripped lines of a UTF-8 text file; anything else raises naming the path."""
    if path is None or str(path).strip() == "":
        raise InvalidArgumentError(f"{what} is empty; give the path of a text file with one prompt per line.")
    file = Path(path).expanduser()
    if not file.exists():
        raise InvalidArgumentError(f"{what} file {str(file)!r} does not exist.")
    if not file.is_file():  # a pipe would block, a device like /dev/urandom never ends
        kind = "is a folder" if file.is_dir() else "is not a regular file (a pipe or a device)"
        raise InvalidArgumentError(f"{what} {str(file)!r} {kind}; give a text file with one prompt per line.")
    try:
        raw = file.read_bytes()
    except OSError as err:
        raise InvalidArgumentError(f"{what} file {str(file)!r} cannot be read: {err.strerror or err}.") from None
    refuse_binary(file, raw, what=what)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidArgumentError(f"{what} file {str(file)!r} is not UTF-8 text "
                                   f"(byte {raw[err.start]:#04x} at offset {err.start}).") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise InvalidArgumentError(f"{what} file {str(file)!r} has no non-empty lines.")
    return lines


def seq_len_within_context(seq_len: int | None, n_ctx: int, *, what: str = "--seq-len",
                           context: str = "the model's context", note: str = "cfg.n_ctx") -> None:
    """Refuse a sequence length (a CLI flag, ``what``) longer than a context of ``n_ctx`` tokens; None passes."""
    if seq_len is not None and seq_len > n_ctx:
        raise InvalidArgumentError(f"{what} {seq_len} is longer than {context} of {n_ctx} tokens ({note}); "
                                   f"pass a shorter {what}.")


#: Per model, the (parameter, version) key of its last all-finite :func:`finite_weights` pass.
_FINITE_AT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def finite_weights(model: Any, *, what: str = "The model", error: type[Exception] = InvalidArgumentError) -> None:
    """Raise ``error`` naming (up to 5) floating parameters that hold NaN or inf: one ``isfinite`` pass on
    their devices, one host sync; skipped while no parameter changed since this model last passed."""
    named = [(n, p) for n, p in model.named_parameters() if p.is_floating_point() and p.device.type != "meta"]
    key = tuple((id(p), 0 if p.is_inference() else p._version) for _, p in named)
    if not named or _FINITE_AT.get(model) == key:
        return
    device = named[0][1].device
    finite = torch.stack([p.isfinite().all().to(device) for _, p in named]).tolist()
    bad = [n.replace("._original_component", "") for (n, _), ok in zip(named, finite) if not ok]
    if bad:
        raise error(f"{what} holds NaN or inf in {len(bad)} weight tensor(s): {', '.join(bad[:5])}"
                    f"{', ...' if len(bad) > 5 else ''}. Nothing measured on it would mean anything.")
    _FINITE_AT[model] = key
