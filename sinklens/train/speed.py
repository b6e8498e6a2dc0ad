"""How fast the trainer runs: compiling the model, the attention kernels of a step, and MFU."""

from __future__ import annotations

import contextlib
import inspect
import re
from typing import Any

import torch

#: Dense (no sparsity) bfloat16 tensor-core peak FLOP/s of each GPU, from the vendors' datasheets, for MFU:
#: the first key found as a whole word in ``torch.cuda.get_device_name()`` (so "L4" does not match "L40S").
PEAK_FLOPS: dict[str, float] = {
    "H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989.4e12, "H200": 989.4e12, "GH200": 989.4e12, "H800": 989.4e12,
    "B200": 2250e12, "A100": 312e12, "A800": 312e12, "L40S": 362.05e12, "L40": 181.05e12, "L4": 121e12,
    "A10": 125e12, "RTX 4090": 165.2e12, "RTX 3090": 71e12,
}

#: Extra keyword arguments of every ``torch.compile`` call the trainer makes (tests set a cheap backend).
COMPILE_KWARGS: dict[str, Any] = {}


def compile_model(model: torch.nn.Module) -> torch.nn.Module:
    """``torch.compile(model, **COMPILE_KWARGS)`` with its own recompilation budget where torch has one."""
    extra = {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {}
    return torch.compile(model, **extra, **COMPILE_KWARGS)


def compile_failed_warning(error: BaseException) -> str:
    text = " ".join(str(error).split())  # one line: dynamo's messages span several
    text = text if len(text) <= 300 else text[:297] + "..."
    return (f"torch.compile failed ({type(error).__name__}: {text}); training continues eagerly. "
            f"Set compile=false to skip the attempt.")


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak FLOP/s of the GPU called ``device_name``, None if unknown.

    Examples:
        >>> peak_flops("NVIDIA H100 PCIe"), peak_flops("NVIDIA H200"), peak_flops("NVIDIA L40S"), peak_flops("Tesla T4")
        (756000000000000.0, 989400000000000.0, 362050000000000.0, None)
    """
    for key, value in PEAK_FLOPS.items():
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", device_name):
            return value
    return None


def estimate_mfu(flops_per_token: float, tokens_per_s: float, device: torch.device) -> float | None:
    """Model FLOPs utilisation: ``flops_per_token × tokens/s`` over the GPU's dense bf16 peak; None on a CPU or an
    unknown GPU."""
    if device.type != "cuda":
        return None
    peak = peak_flops(torch.cuda.get_device_name(device))
    return None if peak is None else flops_per_token * tokens_per_s / peak


def attention_kernels(device: torch.device) -> Any:
    """SDPA kernels of a step: on Hopper or newer cuDNN's fused attention first, then flash, memory-efficient
    and math; elsewhere torch's default."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if "set_priority" not in inspect.signature(sdpa_kernel).parameters:
        return contextlib.nullcontext()
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(order, set_priority=True)
