"""The run directory before training starts: refuse to clobber a run by accident, read back its history."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sinklens.errors import InvalidArgumentError, NotFoundError, OutputExistsError
from sinklens.sinklm.checkpoint import METRICS, has_checkpoint, is_run_dir, read_metrics
from sinklens.sinklm.run_folder import foreign_entries


def read_history(run_dir: Path, before_step: int) -> list[dict[str, Any]]:
    """Metrics lines of an interrupted run before ``before_step``."""
    if not (run_dir / METRICS).is_file():
        return []
    return [line for line in read_metrics(run_dir) if line["step"] < before_step]


def check_run_dir(out: Path | None, *, resume: bool, overwrite: bool) -> None:
    if resume and overwrite:
        raise InvalidArgumentError("resume and overwrite exclude each other: resume continues the run in out_dir, "
                                   "overwrite deletes it.")
    if out is None:
        if resume:
            raise InvalidArgumentError("resume=True needs out_dir, the run directory to continue.")
        return
    if out.exists() and not out.is_dir():
        raise InvalidArgumentError(f"out_dir {str(out)!r} exists and is not a folder.")
    foreign = foreign_entries(out)
    if foreign and not resume:
        raise OutputExistsError(
            f"out_dir {str(out)!r} is not a sinklens training run but holds {', '.join(foreign)} (another tool's "
            f"files?), which a run there would replace or be loaded with; "
            + ("overwrite=True (--overwrite) only replaces a sinklens run. " if overwrite else "")
            + "Pick an empty or new out_dir."
        )
    if resume and not has_checkpoint(out):
        again = (" It stopped before its first checkpoint, so there is nothing to continue: start it again with "
                 "overwrite=True (--overwrite instead of --resume), or pick another out_dir.") if is_run_dir(out) else ""
        raise NotFoundError(f"resume=True but {str(out)!r} holds no checkpoint to resume from.{again}")
    if not resume and not overwrite and is_run_dir(out):
        if not has_checkpoint(out):  # a run that failed before its first checkpoint: --resume cannot continue it
            raise OutputExistsError(
                f"{str(out)!r} already holds a training run that stopped before its first checkpoint (it has "
                f"config.json or metrics.jsonl but nothing to resume from). Start it again with overwrite=True "
                f"(--overwrite), which deletes what it left, or pick another out_dir."
            )
        raise OutputExistsError(
            f"{str(out)!r} already holds a training run. Continue it with resume=True (--resume), replace it "
            f"with overwrite=True (--overwrite), or pick another out_dir."
        )
