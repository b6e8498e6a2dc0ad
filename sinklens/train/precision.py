"""Mixed precision of a training run: ``TrainConfig.autocast`` on CUDA (float16 adds a ``GradScaler``),
``cpu_autocast`` on a CPU (warns where the CPU lacks native bfloat16)."""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@functools.cache
def native_cpu_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether the first ``flags``/``Features`` line of ``cpuinfo`` names native bfloat16; None without one (not Linux)."""
    try:
        flags = re.search(r"^\s*(?:flags|features)\s*:(.*)$", Path(cpuinfo).read_text(), re.MULTILINE | re.IGNORECASE)
    except OSError:
        return None
    return None if flags is None else bool({"avx512_bf16", "amx_bf16", "bf16"} & set(flags.group(1).split()))


@dataclass(frozen=True)
class MixedPrecision:
    """The forward's ``autocast`` context, its ``dtype`` name (``"none"``: float32) and float16's ``scaler``."""

    autocast: Any
    dtype: str
    scaler: torch.amp.GradScaler | None = None


def mixed_precision(cfg: Any, device: torch.device) -> MixedPrecision:
    if device.type == "cuda" and cfg.autocast != "none":
        dtype = torch.bfloat16 if cfg.autocast == "bfloat16" else torch.float16
        scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None
        return MixedPrecision(torch.autocast(device_type="cuda", dtype=dtype), cfg.autocast, scaler)
    if device.type == "cpu" and cfg.cpu_autocast == "bfloat16":
        if native_cpu_bf16() is False:
            warnings.warn("cpu_autocast='bfloat16' on a CPU without native bfloat16 instructions (no avx512_bf16 / "
                          "amx_bf16 in /proc/cpuinfo): bfloat16 is emulated there and likely slower than float32; "
                          "set cpu_autocast='none' to train in float32.", RuntimeWarning, stacklevel=3)
        return MixedPrecision(torch.autocast(device_type="cpu", dtype=torch.bfloat16), "bfloat16")
    return MixedPrecision(contextlib.nullcontext(), "none")
