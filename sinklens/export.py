"""The one JSON exporter (:func:`write_json`): strict JSON (a non-finite float becomes ``null``), written
atomically (a temporary file in the same folder, fsynced and renamed)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sinklens.errors import OutputExistsError, OutputNotWritableError


def to_json(value: Any, digits: int | None = 6) -> Any:
    """A strict-JSON-ready copy of ``value``: tensors and arrays as lists, dataclasses and mappings as dicts,
    non-finite floats as None, floats rounded to ``digits`` significant digits (None: full precision).

    Examples:
        >>> to_json({"a": torch.tensor([1.0, math.nan]), "b": math.inf, "c": 1/3})
        {'a': [1.0, None], 'b': None, 'c': 0.333333}
    """
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().tolist()
    elif isinstance(value, (np.ndarray, np.generic)):
        value = value.tolist()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): to_json(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_json(v, digits) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return value if digits is None else float(f"{value:.{digits}g}")
    if isinstance(value, (Path, torch.dtype, torch.device)):
        return str(value)
    raise TypeError(f"Cannot write a {type(value).__name__} to JSON: {value!r}")


def dumps(value: Any, *, digits: int | None = 6, indent: int | None = 2) -> str:
    """Strict JSON text of ``value`` (see :func:`to_json`); raises if anything non-finite slipped through."""
    return json.dumps(to_json(value, digits), indent=indent, allow_nan=False)


def default_file_mode() -> int:
    """The permission bits a plain ``open(path, "w")`` gives a new file: ``0o666`` less the umask."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            mask = next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, ValueError, StopIteration):
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def write_text_atomic(path: str | Path, text: str, *, replace: bool = True) -> Path:
    """Write ``text`` to ``path`` atomically (:func:`write_atomic`)."""
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), replace=replace)


def write_atomic(path: str | Path, write: Any, *, replace: bool = True) -> Path:
    """``write(tmp)`` writes a temporary file (plain ``open()``'s mode) beside ``path``, which is then fsynced and
    renamed onto it; ``replace=False``: only while ``path`` is absent, else :class:`OutputExistsError`."""
    path = Path(path)
    tmp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".tmp{path.suffix}", dir=path.parent)
        tmp = Path(name)
        if hasattr(os, "fchmod"):
            os.fchmod(fd, default_file_mode())
        os.close(fd)
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        if replace:
            os.replace(tmp, path)
        else:  # only if path does not exist: a hard link, or a check and a rename where there are none
            try:
                os.link(tmp, path)
            except OSError as err:  # FileExistsError, or no hard links here (some network or FUSE file systems)
                if isinstance(err, FileExistsError) or path.exists():
                    raise FileExistsError(path) from None
                os.replace(tmp, path)
            else:
                tmp.unlink()
    except BaseException as err:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        if isinstance(err, FileExistsError):
            raise OutputExistsError(f"{str(path)!r} was written by another process while this one ran; it is kept. "
                                    "Pass --overwrite to replace it, or choose another path.") from None
        if isinstance(err, OSError):
            raise OutputNotWritableError(f"Cannot write {str(path)!r}: {err.strerror or err}.") from err
        raise
    return path


@contextmanager
def staged_outputs(folder: str | Path, *, marker: str, owned: Sequence[str] = ()) -> Iterator[Path]:
    """Write a result's files into a staging folder inside ``folder`` (yielded); on success remove the old
    ``marker`` and the ``owned`` names not rewritten, then rename the new files in, the marker last. An error or
    Ctrl-C leaves ``folder`` as it was."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".sinklens-staging-", dir=folder))
    try:
        yield stage
        names = sorted(entry.name for entry in stage.iterdir())
        for stale in [marker, *(name for name in owned if name not in names)]:  # the marker first
            (folder / stale).unlink(missing_ok=True)
        for name in sorted(names, key=lambda name: name == marker):
            os.replace(stage / name, folder / name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def write_json(path: str | Path, value: Any, *, digits: int | None = 6, indent: int | None = 2,
               replace: bool = True) -> Path:
    """Write ``value`` as strict JSON to ``path`` with :func:`write_atomic`; returns the path."""
    return write_text_atomic(path, dumps(value, digits=digits, indent=indent) + "\n", replace=replace)


def json_line(value: Any) -> str:
    """One strict-JSON line (for ``.jsonl`` logs) at full precision, without a trailing newline."""
    return dumps(value, digits=None, indent=None)
