"""Send the trainer's ``train``/``eval`` lines to Weights & Biases or TensorBoard (``TrainConfig.log``) as
``train/<key>``/``eval/<key>`` at their step; the library is imported only when asked for."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

from sinklens.errors import InvalidArgumentError


def check_log(kind: str) -> None:
    if kind != "none" and importlib.util.find_spec(kind) is None:  # the package is named as the kind
        raise InvalidArgumentError(f"log={kind!r} needs the {kind} package, which is not installed: pip install "
                                   f"'sinklens[{kind}]' (or set log='none'; metrics.jsonl is written either way).")


class MetricsLog:
    """One run's Weights & Biases run or TensorBoard writer (``out_dir/tensorboard``, else ``runs/``)."""

    def __init__(self, kind: str, config: dict[str, Any], out: Path | None) -> None:
        self.kind = kind
        if kind == "wandb":
            import wandb
            self.run = wandb.init(project="sinklens", name=out.name if out is not None else None,
                                  dir=str(out) if out is not None else None, config=config)
        else:
            from torch.utils.tensorboard import SummaryWriter
            self.run = SummaryWriter(log_dir=str(out / "tensorboard") if out is not None else None)

    def write(self, line: dict[str, Any]) -> None:
        if line.get("kind") not in ("train", "eval"):
            return
        scalars = {f"{line['kind']}/{key}": float(value) for key, value in line.items()
                   if key not in ("kind", "step") and isinstance(value, (int, float)) and not isinstance(value, bool)
                   and math.isfinite(value)}
        if self.kind == "wandb":
            self.run.log(scalars, step=line["step"])
        else:
            for key, value in scalars.items():
                self.run.add_scalar(key, value, global_step=line["step"])

    def close(self) -> None:
        (self.run.finish if self.kind == "wandb" else self.run.close)()
