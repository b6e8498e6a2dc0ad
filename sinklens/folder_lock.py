"""One process at a time in a run or result folder: a non-blocking :mod:`filelock` lock on a file inside it."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from sinklens.errors import OutputExistsError

#: The lock file of a result folder (``analyze``/``origins --out``); a training run's is ``.lock``.
OUTPUT_LOCK = ".sinklens.lock"


class FolderLock:
    """Held while one process writes in ``folder``; a second is refused, naming the holder's pid (the lock file's
    text). On release the lock file goes, and a folder the lock created goes too if it is still empty."""

    def __init__(self, folder: str | Path, name: str = ".lock") -> None:
        self.folder = Path(folder)
        self.path = self.folder / name
        self.created = False
        self.lock = FileLock(self.path, timeout=0, on_acquired=lambda fd: os.write(fd, f"{os.getpid()}\n".encode()))

    def refusal(self, holder: str) -> Exception:
        """The error for a folder another process (pid ``holder``) holds."""
        return OutputExistsError(f"{str(self.folder)!r} is being written by another sinklens process (pid {holder}); "
                                 f"wait for it to finish or stop it, or pick another folder.")

    def __enter__(self) -> FolderLock:
        self.created = not self.folder.exists()
        try:
            self.lock.acquire()
        except Timeout:
            holder = "unknown"
            with contextlib.suppress(OSError):
                holder = self.path.read_text().strip() or holder
            self._remove_created_dir()
            raise self.refusal(holder) from None
        except OSError:
            pass  # unwritable, or a file: the caller's writable_dir names it
        return self

    def _remove_created_dir(self) -> None:
        if self.created:
            with contextlib.suppress(OSError):
                self.folder.rmdir()

    def __exit__(self, *exc: Any) -> None:
        if self.lock.is_locked:
            self.path.unlink(missing_ok=True)  # while held: filelock re-checks that the file it locked is still there
            self.lock.release()
        self._remove_created_dir()
