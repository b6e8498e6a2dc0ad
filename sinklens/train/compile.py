"""When the trainer compiles its model with ``torch.compile``, and how it falls back to eager.

``TrainConfig.compile`` is ``True`` (always compile), ``False`` (never) or ``"auto"`` (default).
``"auto"`` compiles only when it is safe and pays for itself:

1. **Safe** (:func:`compile_blocker`): ``torch.compile`` exists, the device is a CPU or a CUDA GPU,
   a CPU run finds the C++ compiler CPU inductor needs (``torch._inductor.config.cpp.cxx`` or
   ``g++``/``clang++``/``c++`` on ``PATH``; looked up once, no compilation), no training-time
   intervention hooks are attached (a hook on the compiled model would break its graph every step),
   and the run is not distributed (every DDP process would have to make the same timing-based
   decision).
2. **Long enough** (:func:`decide`): the run has at least :data:`AUTO_MIN_STEPS` steps left, and
   after :data:`AUTO_PROBE_STEPS` eager steps the measured step time ``t`` (of the last probe step;
   the first one carries one-off warm-up costs) gives an expected saving
   ``steps_left × t × SAVED_FRACTION[device]`` at least ``COMPILE_SECONDS[device]``, the expected
   compile time. Before that the run trains eagerly, so a short run (every run of the test suite)
   never pays a compile.

3. **Faster, measured** (:meth:`CompileSwitch.record_compiled_step`): after the compile step,
   ``"auto"`` times :data:`AUTO_CHECK_STEPS` compiled steps and keeps the compiled model only if
   their median is below the eager step time ``t`` it decided on; otherwise the run goes back to the
   eager model (the compile is then a one-off cost, never a slower run). The reason in the metrics
   says which, with both times.

The constants come from ``benchmarks/bench_train.py headnorm`` at the head-wise RMSNorm authors'
CPU configuration (4 layers, d_model 256, sequence 256, batch 16; ``benchmarks/RESULTS.md``,
"Against the authors' trainer"). Whether a compiled CPU step is faster depends on the CPU: on the
project's 2-core Intel Xeon (AMX) a compiled step took 0.90 of an eager one (9602 vs 8660 tokens/s,
3 alternated repeats); on its 2-core AMD EPYC, quiet, it was no faster (3604 vs 3634 tokens/s, an
older tree) while inductor put its own ``aten::mm`` (MKL) in place of the oneDNN products; since they
stay oneDNN in the compiled graph (:mod:`sinklens.sinklm.matmul`) it takes 0.94 of an eager one (5584 vs
5237 tokens/s, 4 alternated repeats). Hence :data:`SAVED_FRACTION` of 0.1 for the CPU as the expectation,
and the measured check (3. above) for the machines where it does not hold. The compile itself (first compiled step
minus an eager one) took 82–133 s with a cold inductor cache on a loaded machine and 3–56 s with the
cache warm, hence :data:`COMPILE_SECONDS` of 60 s: a CPU run compiles when
``steps_left × t × 0.1 ≥ 60 s`` (about 1300 steps of that configuration). The CUDA constants are
estimates (no GPU was lent when they were set): a run compiles on a GPU when
``steps_left × t × 0.2 ≥ 60 s``.

Whatever the mode, a compile that fails (no compiler, an unsupported operator, an inductor error)
never ends the run: :func:`compile_failed_warning` explains it in one line and the trainer goes on
eagerly from the same step, on the same batch. Checkpoints always hold the uncompiled model's
``state_dict`` (no ``_orig_mod.`` prefix), so a run trained compiled resumes and loads eagerly and
the other way round.

Examples:
    >>> import torch
    >>> decide("auto", blocker=None, steps_left=2000, step_seconds=0.9, device=torch.device("cuda")).compile
    True
    >>> decide("auto", blocker=None, steps_left=2000, step_seconds=0.9, device=torch.device("cpu")).compile
    True
    >>> decide("auto", blocker=None, steps_left=500, step_seconds=0.9, device=torch.device("cpu")).compile
    False
    >>> decide("auto", blocker=None, steps_left=20, step_seconds=0.9, device=torch.device("cpu")).reason
    'auto: only 20 steps left (fewer than 100)'
    >>> decide(True, blocker="no C++ compiler", steps_left=5, step_seconds=None, device=torch.device("cpu")).compile
    True
"""

from __future__ import annotations

import functools
import inspect
import os
import shutil
import statistics
from dataclasses import dataclass
from typing import Any, Literal, Union

import torch

#: ``TrainConfig.compile``: always, never, or when safe and long enough.
CompileMode = Union[bool, Literal["auto"]]

#: ``"auto"`` does not consider compiling a run with fewer steps left than this.
AUTO_MIN_STEPS = 100
#: Eager steps ``"auto"`` times before it decides (the decision uses the last one's time).
AUTO_PROBE_STEPS = 2
#: Expected seconds of the first compiled step (compilation), per device type.
COMPILE_SECONDS = {"cpu": 60.0, "cuda": 60.0}
#: Expected share of an eager step's time a compiled step saves, per device type (module docstring).
SAVED_FRACTION = {"cpu": 0.1, "cuda": 0.2}
#: Compiled steps ``"auto"`` times after the compile step before it keeps the compiled model.
AUTO_CHECK_STEPS = 3

#: Extra keyword arguments of every ``torch.compile`` call the trainer makes (tests set a cheap backend).
COMPILE_KWARGS: dict[str, Any] = {}


@dataclass(frozen=True)
class CompileDecision:
    """Whether the trainer compiles, and why (the ``reason`` goes to the run's metrics and summary)."""

    compile: bool
    reason: str


@functools.lru_cache(maxsize=None)
def cxx_compiler() -> str | None:
    """The C++ compiler CPU inductor would call, found on ``PATH``, or None (looked up once; no build).

    ``torch._inductor.config.cpp.cxx`` names candidates (``(None, "g++")`` by default; None means
    "search"); ``CXX`` in the environment comes first, then ``g++``, ``clang++``, ``c++``.
    """
    candidates: list[str] = [os.environ["CXX"]] if os.environ.get("CXX") else []
    try:
        from torch._inductor import config as inductor_config

        candidates += [c for c in inductor_config.cpp.cxx if c]
    except Exception:  # noqa: BLE001 - an inductor without this setting: search the usual names
        pass
    for name in [*candidates, "g++", "clang++", "c++"]:
        found = shutil.which(name)
        if found:
            return found
    return None


def compile_blocker(device: torch.device, *, hooks: bool, distributed: bool) -> str | None:
    """Why ``"auto"`` must not compile on this run, or None when nothing stands in the way."""
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    if device.type not in ("cpu", "cuda"):
        return f"device {device.type!r} is not a CPU or CUDA device"
    if device.type == "cpu" and cxx_compiler() is None:
        return "no C++ compiler (g++, clang++) on PATH for CPU inductor"
    if hooks:
        return "training-time intervention hooks are attached (they would break the compiled graph)"
    if distributed:
        return "distributed run (set compile=true to compile every process)"
    return None


def decide(
    mode: CompileMode,
    *,
    blocker: str | None,
    steps_left: int,
    step_seconds: float | None,
    device: torch.device,
) -> CompileDecision:
    """The compile decision for ``mode`` (see the module docstring for the rule and its constants).

    Args:
        blocker: :func:`compile_blocker`'s answer (ignored unless ``mode == "auto"``).
        steps_left: steps this process will still run.
        step_seconds: measured time of one eager step, or None before any was timed.
    """
    if mode is True:
        return CompileDecision(True, "compile=true")
    if mode is False:
        return CompileDecision(False, "compile=false")
    if blocker is not None:
        return CompileDecision(False, f"auto: {blocker}")
    if steps_left < AUTO_MIN_STEPS:
        return CompileDecision(False, f"auto: only {steps_left} steps left (fewer than {AUTO_MIN_STEPS})")
    if step_seconds is None:
        return CompileDecision(False, "auto: no eager step timed yet")
    kind = device.type
    saving = steps_left * step_seconds * SAVED_FRACTION.get(kind, 0.0)
    cost = COMPILE_SECONDS.get(kind, float("inf"))
    verdict = (f"{steps_left} steps × {step_seconds:.3g} s × {SAVED_FRACTION.get(kind, 0.0)} = {saving:.0f} s expected "
               f"saving vs ~{cost:.0f} s to compile")
    return CompileDecision(saving >= cost, f"auto: {verdict}")


@functools.lru_cache(maxsize=None)
def _isolates_recompiles() -> bool:
    """Whether this torch's ``torch.compile`` takes ``isolate_recompiles`` (newer releases)."""
    return "isolate_recompiles" in inspect.signature(torch.compile).parameters


def compile_model(model: torch.nn.Module) -> torch.nn.Module:
    """``torch.compile(model, **COMPILE_KWARGS)``; compilation itself happens at the first call.

    Where torch has it, the call gets its own recompilation budget (``isolate_recompiles=True``).
    By default every ``torch.compile`` of ``SinkLM`` shares dynamo's per-code-object limit of 8
    compiled entries, so in a process that trains many differently shaped models (a notebook
    sweeping variants) the ninth would run eagerly while the run reported it compiled.
    """
    extra: dict[str, Any] = {"isolate_recompiles": True} if _isolates_recompiles() else {}
    return torch.compile(model, **extra, **COMPILE_KWARGS)


class CompileSwitch:
    """The trainer's compile state over one run: which module the step calls, and what to report.

    ``mode`` True/False is decided at once; ``"auto"`` either at once (a blocker, too few steps) or
    after :data:`AUTO_PROBE_STEPS` eager steps (:meth:`maybe_decide`). ``wrap`` turns the module the
    step should call (the raw model or its compiled form) into what it calls (e.g. DDP around it).

    Attributes:
        decision: the :class:`CompileDecision`, None while ``"auto"`` is still timing eager steps.
        compiled: the step currently calls the compiled model.
        compile_s: wall time of the first compiled step minus the last timed eager step (the
            compilation, to within one step's noise); None when nothing was compiled.
        error: the one-line warning of a compile that failed (the run went on eagerly), or None.
        eager_step_s: ``"auto"``: the eager step time the decision used (None before it, or for
            True/False).
        compiled_step_s: ``"auto"``: the median of the :data:`AUTO_CHECK_STEPS` compiled steps timed
            after the compile step (None until they ran).
    """

    def __init__(self, mode: CompileMode, raw_model: torch.nn.Module, wrap: Any, device: torch.device, *,
                 hooks: bool, distributed: bool, steps_left: int) -> None:
        self.mode, self.raw_model, self.wrap, self.device = mode, raw_model, wrap, device
        self.blocker = compile_blocker(device, hooks=hooks, distributed=distributed) if mode == "auto" else None
        self.decision: CompileDecision | None = None
        self.compiled = False
        self.compile_s: float | None = None
        self.error: str | None = None
        self.eager_step_s: float | None = None
        self.compiled_step_s: float | None = None
        self._check: list[float] | None = None  # compiled step times while "auto" checks its choice
        self.model = wrap(raw_model)
        first = decide(mode, blocker=self.blocker, steps_left=steps_left, step_seconds=None, device=device)
        if mode != "auto" or self.blocker is not None or steps_left < AUTO_MIN_STEPS:
            self._settle(first)

    def _settle(self, decision: CompileDecision) -> None:
        self.decision = decision
        if decision.compile:
            self.model = self.wrap(compile_model(self.raw_model))
            self.compiled = True

    def maybe_decide(self, steps_done: int, steps_left: int, step_seconds: float | None) -> None:
        """``"auto"``: decide once ``steps_done`` eager steps (of this process) have been timed."""
        if self.decision is None and steps_done >= AUTO_PROBE_STEPS:
            self.eager_step_s = step_seconds
            self._settle(decide(self.mode, blocker=None, steps_left=steps_left, step_seconds=step_seconds,
                                device=self.device))
            self._check = [] if self.compiled and step_seconds is not None else None

    @property
    def checking(self) -> bool:
        """``"auto"`` compiled and its compile step is done: the next compiled steps are to be timed."""
        return self._check is not None and self.compiled and self.compile_s is not None

    def record_compiled_step(self, seconds: float) -> bool:
        """While :attr:`checking`, add one compiled step's wall time. After :data:`AUTO_CHECK_STEPS` of
        them, keep the compiled model if their median is below :attr:`eager_step_s`, else go back to the
        eager one; returns True when this call settled it (the reason then says which, with both times)."""
        if not self.checking:
            return False
        self._check.append(seconds)
        if len(self._check) < AUTO_CHECK_STEPS:
            return False
        self.compiled_step_s, self._check = statistics.median(self._check), None
        keep = self.compiled_step_s < self.eager_step_s
        if not keep:
            self._run_eagerly()
        verdict = (f"a compiled step took {self.compiled_step_s:.3g} s against {self.eager_step_s:.3g} s eager "
                   f"(median of {AUTO_CHECK_STEPS}), so {'kept compiled' if keep else 'back to eager'}")
        self.decision = CompileDecision(keep, f"{self.decision.reason}; {verdict}")
        return True

    def fall_back(self, error: BaseException) -> str:
        """Switch to the eager model after a failed compile; returns the warning."""
        self.error = compile_failed_warning(error)
        self._run_eagerly()
        return self.error

    def _run_eagerly(self) -> None:
        self.model = self.wrap(self.raw_model)
        self.compiled = False

    def summary(self) -> dict[str, Any]:
        """The ``kind="compile"`` metrics fields: mode, whether compiled, why, compile seconds, error, and
        ``"auto"``'s eager and compiled step times."""
        return {"mode": self.mode, "compiled": self.compiled, "reason": self.decision.reason if self.decision else None,
                "compile_s": self.compile_s, "error": self.error, "eager_step_s": self.eager_step_s,
                "compiled_step_s": self.compiled_step_s}


def compile_failed_warning(error: BaseException) -> str:
    """The one-line warning of a compile that failed (the run continues eagerly)."""
    text = " ".join(str(error).split())  # one line: dynamo's messages span several
    text = text if len(text) <= 300 else text[:297] + "..."
    return (f"torch.compile failed ({type(error).__name__}: {text}); training continues eagerly. "
            f"Set compile=false to skip the attempt.")
