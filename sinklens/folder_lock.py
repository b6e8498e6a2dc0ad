"""One process at a time in a folder: :class:`FolderLock` (``fcntl.flock`` on a lock file inside it), used by the
trainer for a run folder and by the commands that write a result folder (``analyze``, ``origins``)."""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Any

from sinklens.errors import OutputLockedError

#: The lock file of a result folder (``analyze``/``origins --out``); a training run's is ``.lock``.
OUTPUT_LOCK = ".sinklens.lock"


class FolderLock:
    """An exclusive, non-blocking lock on a folder (``fcntl.flock`` on ``folder/name``), held while one process
    writes there, so that a second one is refused up front (:meth:`refusal`, naming the holder's pid) instead of
    the two overwriting each other's files. The lock file holds the holder's pid and is removed on release; a
    folder the lock created is removed again if nothing else was written into it. Where ``fcntl`` is missing
    (Windows) or the filesystem refuses locks, no lock is taken (with a warning)."""

    def __init__(self, folder: str | Path, name: str = ".lock") -> None:
        self.folder = Path(folder)
        self.path = self.folder / name
        self.fd: int | None = None
        self.created = False

    def refusal(self, holder: str) -> Exception:
        """The error for a folder another process (pid ``holder``) holds."""
        return OutputLockedError(f"{str(self.folder)!r} is being written by another sinklens process (pid {holder}); "
                                 f"wait for it to finish or stop it, or pick another folder.")

    def __enter__(self) -> FolderLock:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            return self
        if self.folder.exists() and not self.folder.is_dir():
            return self  # refused by the caller's checks
        try:
            self.created = not self.folder.exists()
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            return self  # unwritable: the caller's writable_dir names it
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError:
                return self
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                self._remove_created_dir()
                raise self.refusal(holder) from None
            except OSError as err:  # e.g. a filesystem without locks (ENOLCK)
                os.close(fd)
                warnings.warn(f"Cannot lock {str(self.path)!r} ({err.strerror or err}); going on without a lock.",
                              RuntimeWarning, stacklevel=2)
                return self
            try:  # the holder before us may have removed the file it locked: lock the file now at the path
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def _remove_created_dir(self) -> None:
        if self.created:
            with contextlib.suppress(OSError):
                self.folder.rmdir()

    def __exit__(self, *exc: Any) -> None:
        if self.fd is None:
            return
        self.path.unlink(missing_ok=True)  # while still held: see the samestat check above
        os.close(self.fd)
        self.fd = None
        self._remove_created_dir()
