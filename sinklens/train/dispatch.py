"""Where the trainer's hand-written CPU kernels may run: eager CPU float32 work only."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["eager_cpu_float32"]


def _compiling() -> bool:
    """True while torch.compile traces (``torch.compiler.is_compiling``, torch >= 2.3)."""
    is_compiling = getattr(torch.compiler, "is_compiling", None)
    return bool(is_compiling and is_compiling())


def _autocast_on() -> bool:
    if hasattr(torch, "is_autocast_enabled"):
        try:
            return torch.is_autocast_enabled("cpu")
        except TypeError:  # torch < 2.4: no device argument
            pass
    return torch.is_autocast_cpu_enabled()


def eager_cpu_float32(*tensors: Tensor) -> bool:
    """True when every tensor is a CPU float32 one and no autocast or ``torch.compile`` tracing is
    active: where the trainer's hand-written CPU kernels (:func:`sinklens.train.matmul.matmul`'s oneDNN path,
    :func:`sinklens.train.rms_norm.rms_norm`'s closed-form backward) apply."""
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
        and not _compiling()
        and not _autocast_on()
    )
