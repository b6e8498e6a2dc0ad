"""Run folders and their checkpoints: one step saved, loaded and verified as a unit, nothing pickled. A step is
written into ``checkpoints/.tmp-*``, fsynced, renamed to ``step-N``; ``checkpoint.json`` is switched last, so a kill
leaves the old or the new checkpoint current; the step before stays as a fallback."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sinklens.errors import CorruptFileError, NotFoundError, OutputNotWritableError, SinklensError
from sinklens.export import default_file_mode, json_line, write_json, write_text_atomic
from sinklens.model_files import file_mismatch, sha256_file
from sinklens.sinklm.config import TrainConfig
from sinklens.sinklm.trainer_state import STATE, TENSORS, read_trainer_state, restore_trainer_state, trainer_state

CONFIG, WEIGHTS, TOKENIZER = "config.json", "model.safetensors", "tokenizer"
POINTER, MANIFEST, CHECKPOINTS, METRICS = "checkpoint.json", "manifest.json", "checkpoints", "metrics.jsonl"
FINGERPRINT, PERSISTENCE, FIGURE, LOCK = "data_fingerprint.json", "persistence_ref.json", "figures/training.png", ".lock"
_STEP_DIR = re.compile(r"^step-(\d+)$")
#: What a run writes at its top level (with ``checkpoints/step-*``): ``overwrite=True`` replaces these, nothing else.
RUN_ENTRIES: tuple[str, ...] = (POINTER, CONFIG, METRICS, FINGERPRINT, PERSISTENCE, TOKENIZER, FIGURE)


def _fsync(path: Path) -> None:
    """Flush a file or a folder to disk; a folder that cannot be flushed is skipped, a file's failure raises."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        if not path.is_dir():
            raise


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)


def _step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def unwrap_model(model: Any) -> Any:
    """The module inside DDP and ``torch.compile`` wrappers (weight names without a wrapper prefix)."""
    while (inner := getattr(model, "_orig_mod", None) or (
            model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None)) is not None:
        model = inner
    return model


def save_checkpoint(run_dir: str | Path, *, model: Any, optimizer: torch.optim.Optimizer | None, cfg: TrainConfig,
                    step: int, scaler: Any = None) -> Path:
    """Write the checkpoint after ``step`` as one unit and return its folder; OutputNotWritableError if that fails."""
    from safetensors import SafetensorError
    run_dir = Path(run_dir)
    try:
        return _save_checkpoint(run_dir, model, optimizer, cfg, step, scaler)
    except (OSError, SafetensorError) as err:
        if isinstance(err, SinklensError):
            raise
        current = _pointer(run_dir)
        kept = f"its checkpoint of step {current[0]} is kept" if current else "it has no earlier checkpoint"
        why = err.strerror if isinstance(err, OSError) and err.strerror else " ".join(str(err).split())
        raise OutputNotWritableError(f"Could not write the checkpoint of step {step} into {str(run_dir)!r} ({why}); "
                                     f"{kept}. Free space and continue with --resume.") from err


def _save_checkpoint(run_dir: Path, model: Any, optimizer: Any, cfg: TrainConfig, step: int, scaler: Any) -> Path:
    from safetensors.torch import save_file, save_model
    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    tmp, final = root / f".tmp-{_step_dir_name(step)}-{os.getpid()}-{uuid.uuid4().hex[:8]}", root / _step_dir_name(step)
    every = cfg.keep_every * cfg.checkpoint_interval
    try:
        tmp.mkdir()
        write_json(tmp / CONFIG, cfg.to_dict(), digits=None)
        save_model(unwrap_model(model), str(tmp / WEIGHTS))
        state, tensors = trainer_state(step, optimizer, scaler)
        write_json(tmp / STATE, state, digits=None, indent=None)
        save_file(tensors, str(tmp / TENSORS))
        files = {}
        for name in (CONFIG, WEIGHTS, STATE, TENSORS):
            os.chmod(tmp / name, default_file_mode())  # safetensors may create 0600: give open()'s mode
            _fsync(tmp / name)
            files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
        kept = bool(every and step % every == 0)  # recorded: a resume that changes the interval keeps it
        write_json(tmp / MANIFEST, {"format": 3, "step": step, "files": files, "kept": kept}, digits=None)
        _fsync(tmp)
        if final.exists():  # an orphan of a killed process (never current: the pointer is switched last)
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync(root)
    if (tokenizer := getattr(model, "tokenizer", None)) is not None and not (run_dir / TOKENIZER).is_dir():
        save_tokenizer(run_dir, tokenizer)
    write_json(run_dir / POINTER, {"format": 3, "step": step, "dir": f"{CHECKPOINTS}/{final.name}"}, digits=None)
    _fsync(run_dir)
    earlier = [p for s, p in _step_dirs(run_dir) if s < step][:1]  # the fallback
    for _, path in _step_dirs(run_dir):
        if path != final and path not in earlier and not _manifest(path).get("kept"):
            shutil.rmtree(path, ignore_errors=True)
    return final


def save_tokenizer(run_dir: str | Path, tokenizer: Any) -> Path:
    """Write ``run_dir/tokenizer/`` through a fsynced temporary folder renamed over any earlier one."""
    run_dir = Path(run_dir)
    target, tag = run_dir / TOKENIZER, f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp, old = run_dir / f".tmp-tokenizer-{tag}", run_dir / f".tmp-tokenizer-old-{tag}"
    try:
        tokenizer.save_pretrained(str(tmp))
        for file in [*tmp.iterdir(), tmp]:
            _fsync(file)
        if target.exists() or target.is_symlink():  # os.replace needs an empty target
            os.replace(target, old)
            _remove(old)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync(run_dir)
    return target


def _manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def verify_checkpoint(path: str | Path) -> str | None:
    """None if the step folder ``path`` is complete and every file matches its manifest, else what is wrong."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        return f"{path} has no {MANIFEST} (an unfinished write)"
    files = _manifest(path).get("files")
    if not isinstance(files, dict) or not {WEIGHTS, STATE, TENSORS} <= set(files):
        return f"{path / MANIFEST} is unreadable or lists not all of {WEIGHTS}, {STATE}, {TENSORS}"
    problems = (file_mismatch(path / name, meta["bytes"], meta["sha256"]) for name, meta in files.items())
    return next((problem for problem in problems if problem is not None), None)


def _pointer(run_dir: Path) -> tuple[int, Path] | None:
    """``(step, folder)`` named by ``checkpoint.json``; None if missing, unreadable, or naming anything but
    ``checkpoints/step-N`` of its own step (a folder outside the run is never followed)."""
    try:
        data = json.loads((run_dir / POINTER).read_text())
        step = int(data["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    path = run_dir / CHECKPOINTS / _step_dir_name(step)
    if data.get("dir") != f"{CHECKPOINTS}/{path.name}" or path.is_symlink() or path.parent.is_symlink():
        return None
    return step, path


def _step_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """The ``checkpoints/step-N`` folders (no symlinks), newest first."""
    root = run_dir / CHECKPOINTS
    found = [(int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() and not root.is_symlink() else ())
             if (m := _STEP_DIR.match(p.name)) and p.is_dir() and not p.is_symlink()]
    return sorted(found, reverse=True)


@dataclass(frozen=True)
class RunCheckpoint:
    """A verified checkpoint (:func:`load_run`): the run folder, its step folder, the step and the run's config."""

    run_dir: Path
    path: Path
    step: int
    config: TrainConfig


def is_run_dir(path: str | Path) -> bool:
    """True if ``path`` holds a sinklens run: ``checkpoint.json``, ``checkpoints/``, ``metrics.jsonl``, or a
    ``config.json`` with the keys ``model``, ``optim`` and ``data``."""
    path = Path(path)
    if not path.is_dir():
        return False
    if (path / POINTER).exists() or (path / CHECKPOINTS).is_dir() or (path / METRICS).is_file():
        return True
    try:
        data = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"model", "optim", "data"} <= set(data)


def has_checkpoint(run_dir: str | Path) -> bool:
    """True if ``run_dir`` names a checkpoint to resume from (not yet verified: :func:`load_run` does that)."""
    return _pointer(Path(run_dir)) is not None or bool(_step_dirs(Path(run_dir)))


def load_train_config(run_dir: str | Path) -> TrainConfig:
    """The :class:`TrainConfig` a run was trained with (its ``config.json``)."""
    path = Path(run_dir) / CONFIG
    if not path.is_file():
        raise NotFoundError(f"{str(run_dir)!r} is not a sinklens run directory: it has no {CONFIG}.")
    try:
        data = json.loads(path.read_text())
    except ValueError as err:
        raise CorruptFileError(f"{str(path)!r} is not valid JSON ({err}).") from None
    return TrainConfig.from_dict(data)


def load_run(run_dir: str | Path) -> RunCheckpoint:
    """The newest checkpoint of a run folder that passes verification (an earlier one, with a warning, when the
    current is broken); NotFoundError without one, CorruptFileError when none is good."""
    run_dir = Path(run_dir)
    if not is_run_dir(run_dir):
        raise NotFoundError(f"{str(run_dir)!r} is not a sinklens run directory: it has no {CONFIG} or {POINTER}.")
    pointer, candidates, problems = _pointer(run_dir), _step_dirs(run_dir), []
    if pointer is not None:
        candidates = [pointer] + [(s, p) for s, p in candidates if s < pointer[0]]
    elif (run_dir / POINTER).exists():
        problems.append(f"{run_dir / POINTER} is unreadable or names a folder other than its step's "
                        f"{CHECKPOINTS}/step-N (never followed)")
    for step, path in candidates:
        if (problem := verify_checkpoint(path)) is None:
            if problems:
                warnings.warn(f"The current checkpoint of {str(run_dir)!r} is broken ({problems[0]}); using the "
                              f"earlier checkpoint of step {step} instead.", stacklevel=2)
            return RunCheckpoint(run_dir, path, step, load_train_config(path))
        problems.append(problem)
    if problems:
        raise CorruptFileError(f"No good checkpoint in {str(run_dir)!r}: {'; '.join(problems)}.")
    raise NotFoundError(f"The run in {str(run_dir)!r} has no checkpoint yet (it stopped before its first one was "
                        "written); train it again, or with --resume after a checkpoint exists.")


def _load_weights(model: Any, path: Path, device: str) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import load_model
    try:
        load_model(model, str(path), device=device)
    except (SafetensorError, RuntimeError, OSError) as err:
        raise CorruptFileError(f"{str(path)!r} cannot be loaded ({type(err).__name__}: {err}).") from None


def load_checkpoint(run: str | Path | RunCheckpoint, *, model: Any, optimizer: torch.optim.Optimizer | None = None,
                    scaler: Any = None) -> int:
    """Restore weights, optimizer, grad-scaler and RNG states from ``run`` (a run folder, or a checkpoint
    :func:`load_run` returned); return the step to resume at (see :func:`restore_trainer_state`)."""
    ckpt = run if isinstance(run, RunCheckpoint) else load_run(run)
    model = unwrap_model(model)
    _load_weights(model, ckpt.path / WEIGHTS, str(next(model.parameters()).device))
    state, tensors = read_trainer_state(ckpt.path)
    try:
        restore_trainer_state(state, tensors, optimizer, scaler)
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise CorruptFileError(f"The trainer state in {str(ckpt.path)!r} does not fit this run "
                               f"({type(err).__name__}: {err}).") from None
    return int(state["step"])


def _model(run_dir: Path, cfg: TrainConfig, weights: Path | None, device: str | torch.device | None) -> Any:
    """A SinkLM of ``cfg`` with ``weights`` (None: the run's init), in eval mode, with train_config and tokenizer."""
    from sinklens.sinklm.init import sinklm_at_init
    from sinklens.sinklm.model import SinkLM
    device = torch.device(device or "cpu")
    if weights is None:
        model = sinklm_at_init(cfg.model, cfg.seed, device=device)
    else:
        model = SinkLM(cfg.model).to(device)
        _load_weights(model, weights, str(device))
    if (run_dir / TOKENIZER).is_dir():
        from sinklens.sinklm.tokenizer import load_tokenizer
        model.tokenizer = load_tokenizer(str(run_dir / TOKENIZER))
    model.train_config = cfg
    return model.eval()


def load_trained_model(run_dir: str | Path, device: str | torch.device | None = None) -> Any:
    """The SinkLM of a run's newest good checkpoint (:func:`load_run`), in eval mode, with tokenizer and train_config."""
    ckpt = load_run(run_dir)
    return _model(ckpt.run_dir, ckpt.config, ckpt.path / WEIGHTS, device)


def checkpoint_steps(run_dir: str | Path) -> list[int]:
    """The steps of the verified checkpoints in ``run_dir/checkpoints/``, oldest first (broken ones skipped, warned)."""
    run_dir = Path(run_dir)
    if not is_run_dir(run_dir):
        raise NotFoundError(f"{str(run_dir)!r} is not a sinklens run directory: it has no {CONFIG} or {POINTER}.")
    steps = []
    for step, path in sorted(_step_dirs(run_dir)):
        if (problem := verify_checkpoint(path)) is None:
            steps.append(step)
        else:
            warnings.warn(f"Skipping the broken checkpoint of step {step} in {str(run_dir)!r}: {problem}.", stacklevel=2)
    return steps


def load_step_model(run_dir: str | Path, step: int, device: str | torch.device | None = None) -> Any:
    """The :class:`~sinklens.sinklm.model.SinkLM` of the kept checkpoint of ``step``, verified, in eval mode; step 0
    (never written) is the run's initialization, ``RUN_DIR@init`` (:func:`sinklens.sinklm.init.sinklm_at_init`)."""
    run_dir = Path(run_dir)
    path = run_dir / CHECKPOINTS / _step_dir_name(step)
    if step and not path.is_dir():
        raise NotFoundError(f"{str(run_dir)!r} keeps no checkpoint of step {step}; kept steps: "
                            f"{checkpoint_steps(run_dir)} (train with keep_every=K to keep every K-th checkpoint).")
    if step and (problem := verify_checkpoint(path)) is not None:
        raise CorruptFileError(f"The checkpoint of step {step} in {str(run_dir)!r} is broken: {problem}.")
    return _model(run_dir, load_train_config(run_dir), path / WEIGHTS if step else None, device)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The lines of ``run_dir/metrics.jsonl``, the last of a step's repeated train/eval lines kept; a last line cut
    short by a kill is dropped with a warning; a malformed line raises CorruptFileError naming it."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        raise NotFoundError(f"{str(run_dir)!r} has no {METRICS}; is it a sinklens training run directory?")
    text = path.read_text(encoding="utf-8", errors="replace")
    rows, lines = text.splitlines(), []
    for number, row in ((n, r) for n, r in enumerate(rows, start=1) if r.strip()):
        try:
            line = json.loads(row)
        except json.JSONDecodeError as error:
            if number == len(rows) and not text.endswith("\n"):
                warnings.warn(f"{path}: its last line is cut short ({error.msg}, column {error.colno}), as when "
                              "the run was stopped while writing it; that line is ignored.", RuntimeWarning, stacklevel=2)
                break
            raise CorruptFileError(f"{path}: line {number} is not JSON ({error.msg}, column {error.colno}).") from None
        if not isinstance(line, dict):
            raise CorruptFileError(f"{path}: line {number} is not a JSON object, got {row[:80]!r}.")
        step, kind, loss = line.get("step"), line.get("kind"), line.get("loss")
        if not isinstance(kind, str):
            raise CorruptFileError(f"{path}: line {number} has no string \"kind\" (got {kind!r}): {row[:80]!r}.")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise CorruptFileError(f"{path}: line {number} has no whole-number \"step\" >= 0 (got {step!r}): "
                                   f"{row[:80]!r}.")
        if kind == "train" and (isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss)):
            got = "no \"loss\"" if "loss" not in line else f"\"loss\": {json.dumps(loss, allow_nan=True)}"
            raise CorruptFileError(f"{path}: line {number} is a \"train\" line with {got}, not a finite number; sinklens "
                                   "train logs a non-finite step as a \"nonfinite\" line, so the file was damaged or "
                                   "edited: fix or remove that line.")
        lines.append(with_current_metric_names(line))
    last = {(line["kind"], line["step"]): i for i, line in enumerate(lines)}
    return [line for i, line in enumerate(lines) if line["kind"] not in ("train", "eval")
            or last[line["kind"], line["step"]] == i]


def with_current_metric_names(line: dict[str, Any]) -> dict[str, Any]:
    """``line`` with an eval line's lone ``sink_rate`` (sinklens' q >= 1 variant in the stored benchmark curves)
    renamed ``sinklens_sink_rate``."""
    if line.get("kind") == "eval" and "sink_rate" in line and "sinklens_sink_rate" not in line:
        return {k: v for k, v in line.items() if k != "sink_rate"} | {"sinklens_sink_rate": line["sink_rate"]}
    return line


def write_metrics(run_dir: str | Path, lines: list[dict[str, Any]]) -> None:
    """Replace ``metrics.jsonl`` atomically with ``lines`` (strict JSON, one per line)."""
    write_text_atomic(Path(run_dir) / METRICS, "".join(json_line(line) + "\n" for line in lines))
