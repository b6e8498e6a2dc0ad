"""What a training run returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sinklens.display import CompactRepr


@dataclass(repr=False, eq=False)
class TrainResult(CompactRepr):
    """What :func:`~sinklens.train.loop.train` returns: the trained ``model``, its ``history`` (the lines of
    ``metrics.jsonl``; ``grad_norm`` is before clipping), ``compile`` (``compiled``, ``compile_s`` of the first
    compiled step, ``error``), ``device`` type and ``autocast`` dtype."""

    model: Any
    history: list[dict[str, Any]] = field(default_factory=list)
    out_dir: Path | None = None
    compile: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    autocast: str = "none"

    def losses(self) -> list[float]:
        return [line["loss"] for line in self.history if line["kind"] == "train"]

    def evals(self) -> list[dict[str, Any]]:
        return [line for line in self.history if line["kind"] == "eval"]
