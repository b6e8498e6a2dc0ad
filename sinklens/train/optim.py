"""AdamW and its learning-rate schedule (linear warmup, then cosine decay)."""

from __future__ import annotations

import math
from typing import Any

import torch

from sinklens.sinklm.config import OptimConfig


def get_lr(step: int, optim: OptimConfig, total_steps: int) -> float:
    """``lr·(step+1)/warmup_steps`` during warmup, then ``min_lr + ½(1 + cos(π·r))·(lr - min_lr)`` with
    ``r = (step - warmup)/(decay - warmup)``, then ``min_lr`` from ``decay_steps`` (default total)."""
    decay = optim.decay_steps or total_steps
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if step >= decay:
        return optim.final_lr
    ratio = (step - optim.warmup_steps) / max(1, decay - optim.warmup_steps)
    return optim.final_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (optim.lr - optim.final_lr)


def configure_optimizer(model: Any, optim: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over ``model.param_groups`` (no weight decay on <2-D parameters); ``optim.fused=None`` takes the fused
    kernel on CUDA and the CPU, ``foreach`` elsewhere."""
    fused = device.type in ("cuda", "cpu") if optim.fused is None else optim.fused
    return torch.optim.AdamW(model.param_groups(optim.weight_decay), lr=optim.lr, betas=(optim.beta1, optim.beta2),
                             eps=optim.eps, **({"fused": True} if fused else {"foreach": True}))
