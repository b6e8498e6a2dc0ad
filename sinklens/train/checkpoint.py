"""Checkpoints of a training run: weights in safetensors, config in JSON, optimizer and RNG state.

A run directory holds::

    config.json          TrainConfig.to_dict()
    model.safetensors    SinkLM weights (tied embeddings stored once)
    optimizer.pt         AdamW state_dict (torch.save)
    trainer_state.pt     step, torch/CUDA/numpy/python RNG states, grad-scaler state
    tokenizer/           the text tokenizer (save_pretrained), when the run trained on text
    metrics.jsonl        one JSON line per logged step / evaluation

The data order is a pure function of ``(data.seed, step)`` (:mod:`sinklens.train.data`), so the step
is the whole data state, and resuming reproduces the uninterrupted loss curve exactly on CPU.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sinklens.errors import ModelFileNotFoundError
from sinklens.train.config import TrainConfig

CONFIG, WEIGHTS, OPTIMIZER, STATE, TOKENIZER = "config.json", "model.safetensors", "optimizer.pt", "trainer_state.pt", "tokenizer"


def _replace(tmp: Path, final: Path) -> None:
    os.replace(tmp, final)


def save_checkpoint(
    run_dir: str | Path,
    *,
    model: Any,
    optimizer: torch.optim.Optimizer | None,
    cfg: TrainConfig,
    step: int,
    scaler: Any = None,
) -> Path:
    """Write the checkpoint files of ``model`` after ``step`` optimizer steps into ``run_dir``.

    Each file is written under a temporary name and renamed, so an interrupted save leaves the
    previous checkpoint readable.
    """
    from safetensors.torch import save_model

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".tmp-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    (tmp / CONFIG).write_text(json.dumps(cfg.to_dict(), indent=2))
    save_model(model, str(tmp / WEIGHTS))
    state = {
        "step": step,
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "numpy_rng": np.random.get_state(),
        "python_rng": random.getstate(),
        "scaler": scaler.state_dict() if scaler is not None else None,
    }
    torch.save(state, tmp / STATE)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER)
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is not None and not (run_dir / TOKENIZER).is_dir():
        tokenizer.save_pretrained(str(run_dir / TOKENIZER))
    for name in (CONFIG, WEIGHTS, OPTIMIZER, STATE):  # trainer_state last: it marks a complete checkpoint
        if (tmp / name).exists():
            _replace(tmp / name, run_dir / name)
    tmp.rmdir()
    return run_dir


def has_checkpoint(run_dir: str | Path) -> bool:
    """True if ``run_dir`` holds a complete checkpoint to resume from."""
    return all((Path(run_dir) / name).is_file() for name in (CONFIG, WEIGHTS, STATE))


def load_checkpoint(
    run_dir: str | Path, *, model: Any, optimizer: torch.optim.Optimizer | None = None, scaler: Any = None
) -> int:
    """Restore weights, optimizer, grad-scaler and RNG states in place; return the step to resume at."""
    from safetensors.torch import load_model

    run_dir = Path(run_dir)
    if not has_checkpoint(run_dir):
        raise ModelFileNotFoundError(f"No checkpoint in {str(run_dir)!r} (expected {CONFIG}, {WEIGHTS}, {STATE}).")
    device = next(model.parameters()).device
    load_model(model, str(run_dir / WEIGHTS), device=str(device))
    if optimizer is not None and (run_dir / OPTIMIZER).is_file():
        optimizer.load_state_dict(torch.load(run_dir / OPTIMIZER, map_location=device, weights_only=False))
    state = torch.load(run_dir / STATE, weights_only=False)
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    np.random.set_state(state["numpy_rng"])
    random.setstate(state["python_rng"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    return int(state["step"])


def load_train_config(run_dir: str | Path) -> TrainConfig:
    """The :class:`TrainConfig` a run was trained with (its ``config.json``)."""
    path = Path(run_dir) / CONFIG
    if not path.is_file():
        raise ModelFileNotFoundError(f"{str(run_dir)!r} is not a sinklens run directory: it has no {CONFIG}.")
    return TrainConfig.from_dict(json.loads(path.read_text()))


def load_trained_model(run_dir: str | Path, device: str | torch.device | None = None) -> Any:
    """Load a trained :class:`~sinklens.train.model.SinkLM` from a run directory, in eval mode.

    The model gets its text tokenizer as ``model.tokenizer`` (a ``PreTrainedTokenizerFast``) when the
    run trained on text, so analyzers accept strings; synthetic-task models take token tensors.
    ``model.train_config`` is the run's :class:`TrainConfig`.
    """
    from safetensors.torch import load_model

    from sinklens.train.model import SinkLM

    run_dir = Path(run_dir)
    cfg = load_train_config(run_dir)
    if not (run_dir / WEIGHTS).is_file():
        raise ModelFileNotFoundError(f"{str(run_dir)!r} has a {CONFIG} but no {WEIGHTS} (the run saved no checkpoint).")
    model = SinkLM(cfg.model)
    device = torch.device(device) if device is not None else torch.device("cpu")
    model.to(device)
    load_model(model, str(run_dir / WEIGHTS), device=str(device))
    if (run_dir / TOKENIZER).is_dir():
        from sinklens.train.tokenizer import load_tokenizer

        model.tokenizer = load_tokenizer(str(run_dir / TOKENIZER))
    model.train_config = cfg
    return model.eval()
