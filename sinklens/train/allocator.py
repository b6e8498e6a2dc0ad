"""Keep freed CPU memory in the process during a CPU training run (glibc only).

glibc's ``malloc`` serves large requests (a ``[16, 256, 1024]`` float32 activation is 16 MiB)
with ``mmap`` and gives them back to the kernel on ``free``, so every step of a CPU run maps the
same activations afresh and takes one page fault per 4 KiB page when it first writes them: on the
``headnorm-cpu`` configuration about 45,000 minor faults and 0.12 CPU-seconds of kernel time a
step (``benchmarks/RESULTS.md``). :func:`retained_cpu_memory` switches ``mmap`` off for the
allocations of the run and raises the trim threshold, so freed blocks stay in the heap and the next
step reuses pages already mapped (0–1 faults a step). The cost is that the process keeps its peak
heap until the run ends; on leaving, ``mmap`` is allowed again and ``malloc_trim(0)`` hands the
memory back.

This is the tuning that PyTorch's CPU performance guides get from ``LD_PRELOAD``-ing jemalloc or
tcmalloc, done in-process with ``mallopt`` so that ``sinklens train`` needs no launcher. On other C
libraries (musl, macOS, Windows) it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from collections.abc import Iterator
from functools import cache

__all__ = ["retained_cpu_memory"]

# mallopt parameters (glibc <malloc.h>)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
#: Set when the run ends: glibc's default mmap count, and the thresholds its dynamic mode reaches
#: after freeing a 32 MiB block (largest mmap threshold; trim threshold twice that). Any mallopt
#: call ends the dynamic mode, so these stand in for it.
_AFTER_MMAP_MAX = 65536
_AFTER_MMAP_THRESHOLD = 32 * 1024 * 1024
_AFTER_TRIM_THRESHOLD = 64 * 1024 * 1024
#: Freed memory below this stays in the heap during the run (the largest value mallopt takes).
_RUN_TRIM_THRESHOLD = 2**31 - 1


@cache
def _glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (it has ``mallopt`` and ``malloc_trim``), else None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # glibc only  # noqa: B018
        libc.mallopt, libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


@contextlib.contextmanager
def retained_cpu_memory(enabled: bool = True) -> Iterator[bool]:
    """Within the block, freed heap memory is kept for reuse instead of being unmapped (glibc).

    Yields True when the tuning is active (glibc and ``enabled``), False when it changed nothing.
    On exit ``mmap`` is allowed again, with the thresholds glibc's own dynamic mode settles on
    (32 MiB mmap, 64 MiB trim), and ``malloc_trim(0)`` returns the kept memory to the system.

    Examples:
        >>> import torch
        >>> with retained_cpu_memory() as active:
        ...     _ = [torch.ones(4_000_000) for _ in range(3)]
        >>> active in (True, False)
        True
    """
    libc = _glibc() if enabled else None
    if libc is None or not (libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, _RUN_TRIM_THRESHOLD)):
        yield False
        return
    try:
        yield True
    finally:
        libc.mallopt(_M_MMAP_MAX, _AFTER_MMAP_MAX)
        libc.mallopt(_M_MMAP_THRESHOLD, _AFTER_MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, _AFTER_TRIM_THRESHOLD)
        libc.malloc_trim(0)
