"""PyTorch DDP set-up for ``torchrun`` (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``): NCCL on CUDA, gloo on the CPU."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sinklens.errors import InvalidArgumentError
from sinklens.validate import device as checked_device


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in a (possibly single-process) run; ``enabled`` under ``torchrun``."""

    enabled: bool = False
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str) -> tuple[DistContext, torch.device]:
    """Join the process group if launched by ``torchrun``; return the context and this process's device (``"auto"``:
    cuda when available, else cpu; any other name must be a device this machine has)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif str(device).strip().lower().split(":")[0] not in ("cpu", "cuda", "mps"):
        raise InvalidArgumentError(f"Unknown device {device!r}; use 'auto' (CUDA when available, else the CPU), "
                                   "'cpu', 'cuda', 'cuda:N' or 'mps'.")
    dev = checked_device(device, what="device")  # refuses a device this machine lacks
    if not ("WORLD_SIZE" in os.environ and "RANK" in os.environ):
        return DistContext(), dev
    ctx = DistContext(True, int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ["WORLD_SIZE"]))
    if dev.type == "cuda":
        dev = torch.device("cuda", ctx.local_rank)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return ctx, dev


def cleanup_distributed(ctx: DistContext) -> None:
    if ctx.enabled and dist.is_initialized():
        dist.destroy_process_group()
