"""Scale an analysis out over ``torchrun`` processes inside :func:`session`: each streams a share of
the batches, then the reducers' statistics are merged in rank order (as one process, to float64 rounding)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import torch.distributed as dist

from sinklens.distributed.ddp import DistContext, cleanup_distributed, init_distributed

T = TypeVar("T")

_SESSION: DistContext | None = None
_DEVICE: str | None = None


@contextmanager
def session(device: str | None = None) -> Iterator[str | None]:
    """Join the ``torchrun`` process group for the block and yield the device to load on (``cuda:LOCAL_RANK`` when
    CUDA is asked for or available, else cpu); without ``torchrun``, ``device`` unchanged."""
    global _SESSION, _DEVICE
    if not launched_by_torchrun() or _SESSION is not None:  # nested: the outer session owns the group
        yield device if _SESSION is None else _DEVICE
        return
    ctx, dev = init_distributed("auto" if device is None else device)
    _SESSION, _DEVICE = ctx, str(dev)
    try:
        yield _DEVICE
    finally:
        _SESSION, _DEVICE = None, None
        cleanup_distributed(ctx)


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def writes_outputs() -> bool:
    """Whether this process writes the command's files: rank 0 under ``torchrun``, the only process otherwise."""
    return not launched_by_torchrun() or int(os.environ["RANK"]) == 0


def active() -> bool:
    """True inside :func:`session` with more than one process."""
    return _SESSION is not None and _SESSION.world_size > 1 and dist.is_initialized()


def rank() -> int:
    return _SESSION.rank if _SESSION is not None else 0


def world_size() -> int:
    return _SESSION.world_size if _SESSION is not None else 1


def is_main() -> bool:
    return rank() == 0


def shard_bounds(n_batches: int, *, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, stop)`` of the batches process ``rank`` streams: contiguous shares in rank order, the first
    ``n_batches % world_size`` processes taking one batch more."""
    base, extra = divmod(n_batches, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def local_batches(batches: Sequence[T]) -> Sequence[T]:
    """This process's share of ``batches`` (all of them unless :func:`active`)."""
    if not active():
        return batches
    batches = batches if hasattr(batches, "__len__") else list(batches)
    start, stop = shard_bounds(len(batches), rank=rank(), world_size=world_size())
    return [batches[i] for i in range(start, stop)]
