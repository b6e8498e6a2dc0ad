"""Where the trainer's hand-written CPU kernels may run: eager CPU float32 work only."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["at_least_float32", "eager_cpu_float32"]


def at_least_float32(x: Tensor) -> Tensor:
    """``x`` in the dtype its norms, softmaxes and sums run in: float32 for half precision and float32, float64
    kept as it is (a float64 model stays float64 throughout, e.g. for ``torch.autograd.gradcheck``)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


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


def _functorch_active() -> bool:
    """True inside ``torch.func`` transforms (``grad``, ``vmap``, ``jacrev``...), where autograd
    functions without a ``setup_context`` cannot run."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active and active())


def eager_cpu_float32(*tensors: Tensor) -> bool:
    """True when every tensor is a CPU float32 one and no autocast, ``torch.compile`` tracing or
    ``torch.func`` transform is active: where the trainer's hand-written CPU kernels
    (:func:`sinklens.train.matmul.matmul`'s oneDNN path, :func:`sinklens.train.rms_norm.rms_norm`'s
    and :func:`sinklens.train.rotary.rope`'s closed-form backwards) apply."""
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
        and not _compiling()
        and not _autocast_on()
        and not _functorch_active()
    )
