"""What a training run returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sinklens.display import CompactRepr


@dataclass(repr=False, eq=False)
class TrainResult(CompactRepr):
    """What :func:`~sinklens.train.loop.train` returns.

    Attributes:
        model: the trained (unwrapped) :class:`~sinklens.sinklm.model.SinkLM`, in train mode.
        history: the metrics lines (also in ``out_dir/metrics.jsonl``): ``kind="train"`` lines
            with ``loss`` (mean over the step's batch), ``lr``, ``grad_norm`` (before clipping),
            ``tokens_per_s``, ``mfu``; ``kind="eval"`` lines with ``val_loss``, sink metrics and
            ``persistence_*`` (correlations with step 0, :mod:`sinklens.train.persistence`); in a
            resumed run a ``kind="resume"`` line where it was picked up (``step``, ``changes``:
            ``{config key: [before, now]}``).
        out_dir: the run directory, or None.
        compile: whether this process trained compiled (``TrainConfig.compile``): ``compiled``,
            ``compile_s`` (wall seconds of the first compiled step, compilation included) and ``error``
            (a failed compile, after which the run went on eagerly); also the ``kind="compile"`` metrics
            line written when a compile was attempted.
        device: the device type the run trained on (``"cpu"``, ``"cuda"``).
        autocast: the forward's autocast dtype, ``"bfloat16"``/``"float16"``, or ``"none"``
            (:mod:`sinklens.train.precision`).
    """

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
