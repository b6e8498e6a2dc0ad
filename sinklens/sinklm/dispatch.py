"""Where the trainer's hand-written CPU kernels may run: CPU float32 work outside autocast and ``torch.func``."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["at_least_float32", "cpu_float32", "eager_cpu_float32", "is_compiling", "is_exporting"]


def at_least_float32(x: Tensor) -> Tensor:
    """``x`` in the dtype its norms, softmaxes and sums run in: float32 for half precision and float32, float64
    kept as it is (a float64 model stays float64 throughout, e.g. for ``torch.autograd.gradcheck``)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def is_compiling() -> bool:
    """True while torch.compile traces (``torch.compiler.is_compiling``, torch >= 2.3)."""
    probe = getattr(torch.compiler, "is_compiling", None)
    return bool(probe and probe())


def is_exporting() -> bool:
    """True while ``torch.export`` traces (``torch.compiler.is_exporting``, torch >= 2.5)."""
    probe = getattr(torch.compiler, "is_exporting", None)
    return bool(probe and probe())


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


def cpu_float32(*tensors: Tensor, compiling: bool = False) -> bool:
    """True when every tensor is a CPU float32 one and no autocast or ``torch.func`` transform is
    active: where the trainer's hand-written CPU kernels apply. While ``torch.compile`` traces it is
    ``compiling``: True for a kernel that is a custom operator, which inductor keeps as one opaque call
    (:func:`sinklens.sinklm.matmul.matmul`'s oneDNN product), False for an ``autograd.Function``, which
    the graph should see as the plain operations it replaces (inductor fuses those itself)."""
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors):
        return False
    if is_compiling():
        return compiling and not _autocast_on()
    return not _autocast_on() and not _functorch_active()


def eager_cpu_float32(*tensors: Tensor) -> bool:
    """:func:`cpu_float32` outside ``torch.compile``: where the trainer's ``autograd.Function`` kernels
    (:func:`sinklens.sinklm.rms_norm.rms_norm`'s and :func:`sinklens.sinklm.rotary.rope`'s closed-form
    backwards) apply."""
    return cpu_float32(*tensors)
