"""Ctrl-C and SIGTERM during training: finish the step in progress, checkpoint it, then raise
:class:`~sinklens.errors.TrainingInterrupted` (exit 130). A second signal interrupts at once."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from sinklens.errors import TrainingInterrupted

class StopSignals:
    """While active (main thread, not over an ignored signal), the first SIGINT/SIGTERM is recorded in
    ``received`` instead of raised."""

    def __init__(self, enabled: bool = True) -> None:
        self.active = enabled and threading.current_thread() is threading.main_thread()
        self.received: str | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> StopSignals:
        if self.active:
            for sig in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:  # the second signal: stop now, without a checkpoint
            self.__exit__()
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name
        print(f"\n{self.received}: stopping after this step and saving a checkpoint (again to stop at once)",
              file=sys.stderr, flush=True)


def interrupted_error(signal_name: str, step: int, start_step: int, steps: int, out: Path | None,
                      checkpoint: Callable[..., None]) -> TrainingInterrupted:
    """Checkpoint the ``step`` steps done (when any were done since ``start_step``) and say so."""
    if step > start_step and out is not None:
        checkpoint(step, regular=False)
        kept = f"its checkpoint is saved in {str(out)!r}; continue with --resume (train(..., resume=True))"
    elif out is not None:
        kept = f"no step had finished since step {start_step}, so the run in {str(out)!r} is as it was"
    else:
        kept = "nothing was saved (no out_dir)"
    return TrainingInterrupted(f"{signal_name} at step {step} of {steps}: training stopped after a whole step; {kept}.")
