"""What a resume needs beyond the weights, as data that runs no code when read: ``trainer_state.json`` (strict JSON:
step, Python and numpy RNG states, grad scaler, the optimizer's non-tensor state and param groups) and
``trainer_state.safetensors`` (optimizer tensors ``optimizer.{param}.{key}``, RNG ``rng.torch``, ``rng.cuda.{i}``)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sinklens.errors import CorruptFileError

STATE, TENSORS = "trainer_state.json", "trainer_state.safetensors"


def trainer_state(step: int, optimizer: Any, scaler: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The trainer state of the module docstring as ``(JSON object, tensors)``."""
    numpy = np.random.get_state(legacy=False)
    numpy["state"] = {"key": numpy["state"]["key"].tolist(), "pos": int(numpy["state"]["pos"])}
    version, internal, gauss = random.getstate()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    tensors = {"rng.torch": torch.get_rng_state(), **{f"rng.cuda.{i}": s for i, s in enumerate(cuda)}}
    state: dict[str, Any] = {"format": 3, "step": step, "python_rng": [version, list(internal), gauss],
                             "numpy_rng": numpy, "scaler": scaler.state_dict() if scaler is not None else None}
    if optimizer is not None:
        saved, plain = optimizer.state_dict(), {}
        for param, entries in saved["state"].items():
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optimizer.{param}.{key}"] = value.detach().contiguous()
                else:
                    plain.setdefault(str(param), {})[key] = value
        groups = [{k: v for k, v in g.items() if not isinstance(v, torch.Tensor)} for g in saved["param_groups"]]
        state["optimizer"] = {"param_groups": groups, "state": plain}
    return state, tensors


def read_trainer_state(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The JSON object and tensors :func:`trainer_state` wrote into the step folder ``path``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        state = json.loads((path / STATE).read_text(encoding="utf-8"))
        tensors = load_file(str(path / TENSORS), device="cpu")
    except (OSError, ValueError, SafetensorError) as err:
        raise CorruptFileError(f"The trainer state in {str(path)!r} cannot be read ({type(err).__name__}: "
                               f"{err}).") from None
    if not isinstance(state, dict) or state.get("format") != 3 or not isinstance(state.get("step"), int):
        raise CorruptFileError(f"{str(path / STATE)!r} is not a sinklens trainer state (format 3, a step).")
    return state, tensors


def restore_trainer_state(state: dict[str, Any], tensors: dict[str, torch.Tensor], optimizer: Any, scaler: Any) -> None:
    """Put back what :func:`trainer_state` saved; the optimizer keeps its own hyperparameters (a changed ``optim``)."""
    if optimizer is not None and state.get("optimizer") is not None:
        params: dict[int, dict[str, Any]] = {int(p): dict(v) for p, v in state["optimizer"]["state"].items()}
        for name, value in tensors.items():
            if name.startswith("optimizer."):
                param, key = name[len("optimizer."):].split(".", 1)
                params.setdefault(int(param), {})[key] = value
        configured = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
        optimizer.load_state_dict({"state": params, "param_groups": state["optimizer"]["param_groups"]})
        for group, settings in zip(optimizer.param_groups, configured):
            group.update(settings)
    torch.set_rng_state(tensors["rng.torch"])
    cuda = [tensors[f"rng.cuda.{i}"] for i in range(sum(name.startswith("rng.cuda.") for name in tensors))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    numpy = state["numpy_rng"]
    np.random.set_state({**numpy, "state": {"key": np.asarray(numpy["state"]["key"], dtype=np.uint32),
                                            "pos": numpy["state"]["pos"]}})
    version, internal, gauss = state["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
