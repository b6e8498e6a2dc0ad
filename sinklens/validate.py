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
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Union

import torch

from sinklens.errors import (
    InvalidArgumentError,
    OutputExistsError,
    OutputNotWritableError,
)

#: What a count or length argument accepts: a Python int, a numpy integer or a 0-d integer tensor
#: (checked and converted by :func:`as_int` / :func:`positive_int`).
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


#: The largest seed :func:`as_seed` accepts: ``torch.manual_seed``'s unsigned 64-bit range.
MAX_SEED = 2**64 - 1


def as_seed(value: Any, *, what: str = "seed") -> int:
    """``value`` as a random seed: an integer in ``0 .. 2**64 - 1``, the range ``torch.manual_seed`` takes as is.

    A negative seed is refused rather than remapped (torch would silently use ``2**64 + seed``, numpy refuses it).

    Examples:
        >>> as_seed(3)
        3
        >>> as_seed(-1, what="--seed")
        Traceback (most recent call last):
        ...
        sinklens.errors.InvalidArgumentError: --seed must be an integer from 0 to 2**64 - 1, got -1.
    """
    seed = as_int(value, what=what)
    if not 0 <= seed <= MAX_SEED:
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


def closest(value: Any, known: Iterable[str]) -> str | None:
    """The entry of ``known`` closest to ``value`` (``difflib``'s ratio of at least 0.6), or None: a typo's fix.

    Examples:
        >>> closest("n_layerz", ["n_layers", "d_model"]), closest("zzz", ["n_layers"])
        ('n_layers', None)
    """
    import difflib

    close = difflib.get_close_matches(str(value), list(known), n=1)
    return close[0] if close else None


def did_you_mean(value: Any, known: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the :func:`closest` entry of ``known``, or ``""`` when none is close."""
    match = closest(value, known)
    return f" (did you mean {match!r}?)" if match is not None else ""


def choice(value: Any, options: Sequence[str], *, what: str) -> str:
    """One of ``options`` (a ``Literal`` mode), with a did-you-mean hint."""
    if value in options:
        return value
    close = closest(value, options)
    hint = f" Did you mean {close!r}?" if close is not None else ""
    raise InvalidArgumentError(f"{what} must be one of {list(options)}, got {value!r}.{hint}")


def writable_dir(path: Any, *, what: str, create: bool = True) -> Path:
    """A folder that exists or can be created, and that we can write into; checked before any work.

    Creates the folder (and parents) if needed; with ``create=False`` only checks that it could be (its
    nearest existing ancestor is a writable folder), so a command refused later leaves no empty folder
    behind (the writers create it). Raises :class:`~sinklens.errors.OutputNotWritableError` naming the
    path otherwise. ``''`` is rejected rather than read as the current directory.
    """
    import os

    if path is None or str(path).strip() == "":
        raise OutputNotWritableError(f"{what} is empty; give a folder path (use '.' for the current folder).")
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise OutputNotWritableError(f"{what} {str(folder)!r} exists and is not a folder.")
    if not create:
        existing = next(p for p in (folder.absolute(), *folder.absolute().parents) if p.exists())
        if not existing.is_dir():
            raise OutputNotWritableError(f"{what} {str(folder)!r} cannot be created: {str(existing)!r} is not a folder.")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise OutputNotWritableError(f"{what} {str(folder)!r} " + (
                "is not writable." if existing == folder.absolute() else f"cannot be created: {str(existing)!r} is not writable."))
        return folder
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputNotWritableError(f"{what} {str(folder)!r} cannot be created: {err.strerror or err}.") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputNotWritableError(f"{what} {str(folder)!r} is not writable.")
    return folder


def writable_file(path: Any, *, what: str) -> Path:
    """A file path whose folder exists (or can be created) and is writable, and that is not a folder;
    nothing is created (the writer creates the folder)."""
    if path is None or str(path).strip() == "":
        raise OutputNotWritableError(f"{what} is empty; give a file path.")
    file = Path(path).expanduser()
    if file.is_dir():
        raise OutputNotWritableError(f"{what} {str(file)!r} is a folder; give a file path.")
    writable_dir(file.parent if str(file.parent) else ".", what=f"the folder of {what}", create=False)
    if file.exists():
        import os

        if not os.access(file, os.W_OK):
            raise OutputNotWritableError(f"{what} {str(file)!r} exists and is not writable.")
    return file


def no_finished_output(paths: Sequence[Path], *, overwrite: bool, flag: str) -> None:
    """Refuse to replace a finished result: raise :class:`~sinklens.errors.OutputExistsError` naming the
    first of ``paths`` that exists and when it was written, unless ``overwrite`` (the command's ``--overwrite``).

    Examples:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> no_finished_output([folder / "report.json"], overwrite=False, flag="--out")  # nothing there yet
        >>> _ = (folder / "report.json").write_text("{}")
        >>> no_finished_output([folder / "report.json"], overwrite=True, flag="--out")
        >>> no_finished_output([folder / "report.json"], overwrite=False, flag="--out")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        sinklens.errors.OutputExistsError: --out would replace ... (written ... UTC), a finished result; pass --overwrite to replace it, or another --out.
    """
    from datetime import datetime, timezone

    if overwrite:
        return
    for path in paths:
        if path.exists():
            when = datetime.fromtimestamp(path.stat().st_mtime, tz=timezone.utc).strftime("%Y-%m-%d %H:%M")
            raise OutputExistsError(f"{flag} would replace {str(path)!r} (written {when} UTC), a finished result; "
                                    f"pass --overwrite to replace it, or another {flag}.")


# --- inputs, devices and dtypes: checked once, at the boundary ----------------------------------------


def optional_positive_int(value: Any, *, what: str, minimum: int = 1) -> int | None:
    """:func:`positive_int`, with ``None`` passed through (e.g. ``max_length=None``: no truncation)."""
    return None if value is None else positive_int(value, what=what, minimum=minimum)


def as_bool(value: Any, *, what: str) -> bool:
    """A real boolean (``True``/``False``, numpy bools and 0-d bool tensors); ``1``, ``"yes"`` ... are refused."""
    if isinstance(value, torch.Tensor) and value.ndim == 0 and value.dtype == torch.bool:
        return bool(value.item())
    import numpy as np

    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise InvalidArgumentError(f"{what} must be True or False, got {value!r} ({type(value).__name__}).")


def prompt_list(prompts: Any, *, what: str = "prompts") -> list[str]:
    """A string or a non-empty sequence of strings, as a list; mixed lists name the first odd element.

    Examples:
        >>> prompt_list("one prompt")
        ['one prompt']
        >>> prompt_list(["a", 3])
        Traceback (most recent call last):
        ...
        sinklens.errors.InvalidArgumentError: prompts[1] must be a string like the others, got 3 (int).
    """
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
                f"{what}[{i}] must be a string like the others, got {item!r} ({type(item).__name__})."
            )
    return items


def token_ids(tokens: Any, d_vocab: int, *, what: str = "token ids") -> torch.Tensor:
    """An integer tensor ``[batch, pos]`` (a 1-D one gains a batch axis) with every id in ``0..d_vocab-1``.

    Checked on the CPU side before any forward pass: an out-of-vocabulary id would otherwise be an
    embedding ``IndexError`` on the CPU and a device-side assert (a broken process) on CUDA.

    Examples:
        >>> token_ids(torch.tensor([0, 5, 9]), 10).shape
        torch.Size([1, 3])
        >>> token_ids(torch.tensor([[0, 12]]), 10)
        Traceback (most recent call last):
        ...
        sinklens.errors.InvalidArgumentError: token ids must be in 0..9 (the model's d_vocab is 10), got 12 at [0, 1].
    """
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
    if tokens.numel() == 0:
        return
    bad = (tokens < 0) | (tokens >= d_vocab)
    if bool(bad.any()):
        where = [int(i) for i in bad.nonzero()[0].tolist()]
        value = int(tokens[tuple(where)].item())
        raise InvalidArgumentError(
            f"{what} must be in 0..{d_vocab - 1} (the model's d_vocab is {d_vocab}), got {value} at {where}."
        )


_FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")


def dtype(value: Any, *, what: str = "dtype") -> torch.dtype:
    """A floating ``torch.dtype`` from a dtype or its name (``"bfloat16"``, ``"torch.float16"``, ``"fp16"``)."""
    if isinstance(value, torch.dtype):
        resolved = value
    elif isinstance(value, str):
        name = value.strip().lower().replace("torch.", "")
        name = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16", "float": "float32",
                "fp64": "float64", "double": "float64"}.get(name, name)
        resolved = getattr(torch, name, None) if name else None
    else:
        resolved = None
    if not isinstance(resolved, torch.dtype):
        raise InvalidArgumentError(f"Unknown {what} {value!r}; use one of {list(_FLOAT_DTYPES)}.")
    if not resolved.is_floating_point:
        raise InvalidArgumentError(f"{what} must be a floating dtype for model weights ({list(_FLOAT_DTYPES)}), got {resolved}.")
    return resolved


def device(value: Any, *, what: str = "device") -> torch.device:
    """A ``torch.device`` that this machine has: ``cuda``/``cuda:N`` need that GPU, ``mps`` needs Apple's backend.

    Examples:
        >>> device("cpu")
        device(type='cpu')
        >>> device("gpu")
        Traceback (most recent call last):
        ...
        sinklens.errors.InvalidArgumentError: Unknown device 'gpu'; use 'cpu', 'cuda', 'cuda:N' or 'mps'.
    """
    if isinstance(value, torch.device):
        dev = value
    else:
        if not isinstance(value, str) or not value.strip():
            raise InvalidArgumentError(f"{what} must be a device name like 'cpu' or 'cuda', got {value!r}.")
        try:
            dev = torch.device(value.strip().lower())
        except (RuntimeError, ValueError):
            raise InvalidArgumentError(f"Unknown {what} {value!r}; use 'cpu', 'cuda', 'cuda:N' or 'mps'.") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise InvalidArgumentError(f"{what} {str(value)!r} needs a CUDA GPU, and this machine has none; use 'cpu'.")
        if dev.index is not None and dev.index >= n:
            raise InvalidArgumentError(f"{what} {str(value)!r}: this machine has {n} CUDA GPU(s), cuda:0..cuda:{n - 1}.")
        return dev
    if dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise InvalidArgumentError(f"{what} {str(value)!r} needs Apple's MPS backend, which is not available here; use 'cpu'.")
        return dev
    raise InvalidArgumentError(f"Unknown {what} {value!r}; use 'cpu', 'cuda', 'cuda:N' or 'mps'.")


def refuse_binary(file: Path, head: bytes, *, what: str, give: str = "a UTF-8 text file") -> None:
    """Raise :class:`~sinklens.errors.InvalidArgumentError` naming ``file`` when ``head`` (its first bytes) holds a NUL
    byte in its first 8 KiB: a binary file is not text (``--prompts``, a text corpus to train on)."""
    if b"\x00" in head[:8192]:
        raise InvalidArgumentError(f"{what} file {str(file)!r} is a binary file (it holds NUL bytes); give {give}.")


def utf8_text(file: Path, raw: bytes, *, what: str) -> str:
    """``raw`` (the bytes of ``file``) decoded as UTF-8; other bytes raise :class:`~sinklens.errors.InvalidArgumentError`
    naming the file, the first bad byte and its offset (never silently replaced)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidArgumentError(
            f"{what} file {str(file)!r} is not UTF-8 text (byte {raw[err.start]:#04x} at offset {err.start})."
        ) from None


def text_lines(path: Any, *, what: str) -> list[str]:
    """The non-empty, stripped lines of a UTF-8 text file; a missing file, a folder, a pipe or device, a binary or
    non-UTF-8 file and a file with no text raise :class:`~sinklens.errors.InvalidArgumentError` naming the path."""
    if path is None or str(path).strip() == "":
        raise InvalidArgumentError(f"{what} is empty; give the path of a text file with one prompt per line.")
    file = Path(path).expanduser()
    if not file.exists():
        raise InvalidArgumentError(f"{what} file {str(file)!r} does not exist.")
    if file.is_dir():
        raise InvalidArgumentError(f"{what} {str(file)!r} is a folder; give a text file with one prompt per line.")
    if not file.is_file():  # a pipe would block, a device like /dev/urandom never ends
        raise InvalidArgumentError(f"{what} {str(file)!r} is not a regular file (a pipe or a device); give a text file "
                                   "with one prompt per line.")
    try:
        raw = file.read_bytes()
    except OSError as err:
        raise InvalidArgumentError(f"{what} file {str(file)!r} cannot be read: {err.strerror or err}.") from None
    refuse_binary(file, raw, what=what)
    text = utf8_text(file, raw, what=what)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise InvalidArgumentError(f"{what} file {str(file)!r} has no non-empty lines.")
    return lines


def seq_len_within_context(seq_len: int | None, n_ctx: int, *, what: str = "--seq-len",
                           context: str = "the model's context", note: str = "cfg.n_ctx") -> None:
    """Refuse a sequence length (a CLI flag, ``what``) longer than a context of ``n_ctx`` tokens; None passes.

    Examples:
        >>> seq_len_within_context(65, 64)
        Traceback (most recent call last):
        ...
        sinklens.errors.InvalidArgumentError: --seq-len 65 is longer than the model's context of 64 tokens (cfg.n_ctx); pass a shorter --seq-len.
    """
    if seq_len is not None and seq_len > n_ctx:
        raise InvalidArgumentError(f"{what} {seq_len} is longer than {context} of {n_ctx} tokens ({note}); "
                                   f"pass a shorter {what}.")


#: Per model, the (parameter, version) key of its last all-finite :func:`finite_weights` pass.
_FINITE_AT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def finite_weights(model: Any, *, what: str = "The model", error: type[Exception] = InvalidArgumentError) -> None:
    """Raise ``error`` naming (up to 5) floating parameters that hold NaN or inf.

    One ``isfinite`` pass on the parameters' own devices and one host sync; skipped while no parameter
    has changed in place since the last passing check of this model.

    Examples:
        >>> layer = torch.nn.Linear(2, 2)
        >>> finite_weights(layer)
        >>> with torch.no_grad():
        ...     layer.bias[0] = float("nan")
        >>> finite_weights(layer)
        Traceback (most recent call last):
        ...
        sinklens.errors.InvalidArgumentError: The model holds NaN or inf in 1 weight tensor(s): bias. Nothing measured on it would mean anything.
    """
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
