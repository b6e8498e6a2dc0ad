"""Mixed precision of a training run: the autocast context of every forward and the loss scaler.

CUDA: ``TrainConfig.autocast`` (bfloat16 by default; float16 adds a ``GradScaler``). CPU:
``cpu_autocast="bfloat16"`` runs matmuls in bfloat16 while weights, optimizer, loss and evaluation stay
float32; a CPU without native bfloat16 (``avx512_bf16``, ``amx_bf16``, ARM ``bf16``) warns.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["MixedPrecision", "mixed_precision", "native_cpu_bf16"]

#: CPU feature flags (``/proc/cpuinfo``) of native bfloat16 arithmetic.
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


@functools.cache
def native_cpu_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether the first ``flags``/``Features`` line of ``cpuinfo`` names native bfloat16; None where there
    is no such line (not Linux)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return bool(_BF16_FLAGS & set(value.split()))
    return None


@dataclass(frozen=True)
class MixedPrecision:
    """The forward's ``autocast`` context (``nullcontext`` in float32), its ``dtype`` name (``"bfloat16"``,
    ``"float16"``, ``"none"``) and the ``scaler`` (float16 on CUDA only, else None).
    """

    autocast: Any
    dtype: str
    scaler: torch.amp.GradScaler | None = None


def mixed_precision(cfg: Any, device: torch.device) -> MixedPrecision:
    """``cfg.autocast`` on CUDA, ``cfg.cpu_autocast`` on a CPU, float32 elsewhere (see the module docstring)."""
    if device.type == "cuda" and cfg.autocast != "none":
        dtype = torch.bfloat16 if cfg.autocast == "bfloat16" else torch.float16
        scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None
        return MixedPrecision(torch.autocast(device_type="cuda", dtype=dtype), cfg.autocast, scaler)
    if device.type == "cpu" and cfg.cpu_autocast == "bfloat16":
        if native_cpu_bf16() is False:
            warnings.warn(
                "cpu_autocast='bfloat16' on a CPU without native bfloat16 instructions (no avx512_bf16 / "
                "amx_bf16 in /proc/cpuinfo): bfloat16 is emulated there and likely slower than float32; "
                "set cpu_autocast='none' to train in float32.",
                RuntimeWarning,
                stacklevel=3,
            )
        return MixedPrecision(torch.autocast(device_type="cpu", dtype=torch.bfloat16), "bfloat16")
    return MixedPrecision(contextlib.nullcontext(), "none")
