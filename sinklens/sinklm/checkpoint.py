"""Run directories and checkpoints: every checkpoint is one atomic, verified unit.

A run directory holds::

    config.json                 TrainConfig.to_dict() of the run
    metrics.jsonl               one strict-JSON line per logged step / evaluation
    tokenizer/                  the text tokenizer (save_pretrained, written atomically; a resume rewrites
                                one that is missing or does not load), when the run trained on text
    data_fingerprint.json       what the data is beyond its config (tokenizer and token-stream hashes,
                                :func:`sinklens.train.data.data_fingerprint`): a resume refuses other data
    .lock                       held (``fcntl.flock``) by the process training the run: one trainer at a time
    checkpoints/step-000040/    one checkpoint: model.safetensors (weights, tied embeddings once),
                                optimizer.pt (AdamW state), trainer_state.pt (step, torch/CUDA/numpy/
                                python RNG states, grad-scaler state), config.json, and
                                manifest.json (step, size and SHA-256 of each of those files)
    checkpoint.json             the pointer: which step directory is the current checkpoint

Writing a checkpoint (:func:`save_checkpoint`): the files go into a fresh temporary directory
``checkpoints/.tmp-step-N-...``, are fsynced, ``manifest.json`` is written last, the directory is
renamed to ``step-N`` and fsynced, and only then is ``checkpoint.json`` replaced atomically to name
it. The newest earlier step directory is kept as a fallback; older ones are deleted after the switch.
A process killed at any point therefore leaves either the old checkpoint or the new one current,
never a mix. Reading (:func:`load_run`) verifies the manifest's sizes and checksums; if the current
checkpoint is broken it falls back, with a warning, to the newest good earlier one, and raises
:class:`~sinklens.errors.CorruptCheckpointError` when none is good. :func:`clean_stale` removes
temporary directories left by killed processes. ``metrics.jsonl`` is appended a line at a time; a
last line cut short by a kill is dropped with a warning when it is read (:func:`read_metrics`), and a
resume rewrites the file up to its checkpoint's step.

``overwrite=True`` moves the old run's own files (never another tool's) into ``.overwritten-*/``
(:func:`set_aside_run`), deletes them once the new run writes its first regular (periodic or final)
checkpoint, and puts them back if the new run fails before any checkpoint, or is killed then
(:func:`recover_set_aside`, at the next start); a replacement that diverges or is interrupted after a
checkpoint of its own keeps it, and the old run stays set aside, named in a warning. A folder that is not a run but holds files a run would replace
or be loaded with (another tool's ``config.json``, ``model.safetensors``, ``tokenizer/``) is refused.

Run directories of sinklens 0.1 (the checkpoint files directly in the run directory, no
``checkpoint.json``) still load and resume.

A resume continues a run as it was: :func:`resume_changes` refuses a config that changes the run's
model, data or initialisation seed, and lists what else it changes (steps, optimizer, evaluation...),
which the trainer records as a ``kind="resume"`` metrics line.

The data order is a pure function of ``(data.seed, step)`` (:mod:`sinklens.train.data`), so the step
is the whole data state, and resuming reproduces the uninterrupted loss curve exactly on CPU.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import shutil
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sinklens.errors import (
    CorruptCheckpointError,
    ResumeMismatchError,
    RunLockedError,
    RunNotFoundError,
)
from sinklens.export import default_file_mode, json_line, write_json, write_text_atomic
from sinklens.folder_lock import FolderLock
from sinklens.model_files import file_mismatch, sha256_file
from sinklens.sinklm.config import LOCAL_DATA_SOURCES, TrainConfig
from sinklens.sinklm.init import sinklm_at_init
from sinklens.sinklm.tokenizer import load_tokenizer

CONFIG, WEIGHTS, OPTIMIZER, STATE, TOKENIZER = "config.json", "model.safetensors", "optimizer.pt", "trainer_state.pt", "tokenizer"
POINTER, MANIFEST, CHECKPOINTS, METRICS = "checkpoint.json", "manifest.json", "checkpoints", "metrics.jsonl"
FINGERPRINT, PERSISTENCE, FIGURE, LOCK = "data_fingerprint.json", "persistence_ref.json", "figures/training.png", ".lock"
_STEP_DIR = re.compile(r"^step-(\d+)$")
#: The files and folders of a run directory that the run itself writes (``checkpoints/`` holds its ``step-*`` and
#: ``.tmp-*`` folders): ``overwrite=True`` replaces these and nothing else.
RUN_ENTRIES: tuple[str, ...] = (POINTER, CONFIG, METRICS, FINGERPRINT, PERSISTENCE, TOKENIZER, FIGURE,
                                WEIGHTS, OPTIMIZER, STATE)
#: Names that a folder which is not a sinklens run may not hold for a new run to start there: what the run would
#: replace, or what loading the run would then pick up beside it (another tool's model or tokenizer).
FOREIGN_BLOCKERS: tuple[str, ...] = (CONFIG, POINTER, CHECKPOINTS, TOKENIZER, WEIGHTS, OPTIMIZER, STATE, PERSISTENCE,
                                     FINGERPRINT, FIGURE, "pytorch_model.bin", "model.safetensors.index.json",
                                     "tokenizer.json", "tokenizer_config.json")

#: The fields of a :class:`TrainConfig` that say what a run *is* (dotted keys; a prefix ending in
#: ``.`` covers a whole section): a resume may not change them (:func:`resume_changes`).
RUN_IDENTITY: tuple[str, ...] = ("model.", "data.", "seed")
#: Fields inside :data:`RUN_IDENTITY` that say where things are kept, not what they are.
RESUME_FREE: frozenset[str] = frozenset({"data.cache_dir"})


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory file descriptors
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def unwrap_model(model: Any) -> Any:
    """The plain module inside DDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers, so a
    checkpoint's weight names never carry a ``module.`` or ``_orig_mod.`` prefix and load into an
    eager model whether the run trained compiled or not."""
    while True:
        inner = getattr(model, "_orig_mod", None) or (
            model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None)
        if inner is None:
            return model
        model = inner


def save_checkpoint(
    run_dir: str | Path,
    *,
    model: Any,
    optimizer: torch.optim.Optimizer | None,
    cfg: TrainConfig,
    step: int,
    scaler: Any = None,
) -> Path:
    """Write the checkpoint of ``model`` after ``step`` optimizer steps as one atomic unit; return its directory.

    See the module docstring for the order of operations; the previous checkpoint stays current
    until ``checkpoint.json`` names the new one.
    """
    from safetensors.torch import save_model

    run_dir = Path(run_dir)
    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{_step_dir_name(step)}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write_json(tmp / CONFIG, cfg.to_dict(), digits=None)
        save_model(unwrap_model(model), str(tmp / WEIGHTS))
        os.chmod(tmp / WEIGHTS, default_file_mode())  # safetensors may create it 0600; give it open()'s mode
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
        names = [n for n in (CONFIG, WEIGHTS, OPTIMIZER, STATE) if (tmp / n).is_file()]
        for name in names:
            _fsync_file(tmp / name)
        files = {n: {"bytes": (tmp / n).stat().st_size, "sha256": sha256_file(tmp / n)} for n in names}
        every = cfg.keep_every * cfg.checkpoint_interval
        kept = bool(every and step % every == 0)  # a keeper of the run that wrote it, whatever a resume changes later
        write_json(tmp / MANIFEST, {"format": 2, "step": step, "files": files, "kept": kept}, digits=None)
        _fsync_dir(tmp)
        final = root / _step_dir_name(step)
        if final.exists():  # an orphan from a killed process (never current: the pointer is switched last)
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(root)
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is not None and not (run_dir / TOKENIZER).is_dir():
        save_tokenizer(run_dir, tokenizer)
    write_json(run_dir / POINTER, {"format": 2, "step": step, "dir": f"{CHECKPOINTS}/{final.name}"}, digits=None)
    _fsync_dir(run_dir)
    earlier = [p for s, p in _step_dirs(run_dir) if s < step]
    keep = {final.name} | ({earlier[0].name} if earlier else set())
    for s, path in _step_dirs(run_dir):  # keep the new checkpoint, the newest one before it, every keep_every-th
        if path.name not in keep and not _kept(path, s, every):
            shutil.rmtree(path, ignore_errors=True)
    return final


def save_tokenizer(run_dir: str | Path, tokenizer: Any) -> Path:
    """Write ``run_dir/tokenizer/`` atomically: ``save_pretrained`` into a temporary ``.tmp-tokenizer-*`` folder
    (removed by :func:`clean_stale` if the process dies), fsynced, then renamed over any earlier (broken) one, so a
    kill never leaves a half-written tokenizer that a resume would keep and ``analyze`` fail on."""
    run_dir = Path(run_dir)
    target = run_dir / TOKENIZER
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = run_dir / f".tmp-tokenizer-{tag}"
    try:
        tokenizer.save_pretrained(str(tmp))
        for file in tmp.iterdir():
            if file.is_file():
                _fsync_file(file)
        _fsync_dir(tmp)
        if target.exists() or target.is_symlink():  # a broken one: out of the way first (os.replace needs an empty target)
            old = run_dir / f".tmp-tokenizer-old-{tag}"
            os.replace(target, old)
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(run_dir)
    return target


def tokenizer_problem(run_dir: str | Path) -> str | None:
    """None if ``run_dir/tokenizer/`` loads, else what is wrong with it (missing, or why it does not load)."""
    path = Path(run_dir) / TOKENIZER
    if not path.is_dir():
        return f"{str(path)!r} is missing"
    try:
        load_tokenizer(str(path))
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file, whatever the parser raises
        return f"{str(path)!r} does not load ({type(err).__name__}: {' '.join(str(err).split())[:200]})"
    return None


def _kept(path: Path, step: int, every: int) -> bool:
    """Whether the step directory ``path`` is one that ``keep_every`` keeps: as its manifest recorded when it was
    written (so a resume that changes ``checkpoint_interval`` or ``keep_every`` never prunes an earlier keeper), or,
    for a checkpoint written before manifests recorded it, ``step`` a multiple of the current ``every``."""
    try:
        recorded = json.loads((path / MANIFEST).read_text()).get("kept")
    except (OSError, ValueError, AttributeError):
        recorded = None
    return bool(recorded) if isinstance(recorded, bool) else bool(every and step % every == 0)


def _pointer(run_dir: Path) -> tuple[int, Path] | None:
    """``(step, directory)`` named by ``checkpoint.json``, or None if there is none or it is unreadable."""
    try:
        data = json.loads((run_dir / POINTER).read_text())
        return int(data["step"]), run_dir / str(data["dir"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def verify_checkpoint(path: str | Path) -> str | None:
    """None if the step directory ``path`` is complete and every file matches its manifest, else what is wrong."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return f"{path} has no {MANIFEST} (an unfinished write)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{path / MANIFEST} is unreadable ({err})"
    for name in (WEIGHTS, STATE):
        if name not in files:
            return f"{path / MANIFEST} lists no {name}"
    for name, meta in files.items():
        problem = file_mismatch(path / name, meta["bytes"], meta["sha256"])
        if problem is not None:
            return problem
    return None


@dataclass(frozen=True)
class RunCheckpoint:
    """A verified checkpoint of a run directory (what :func:`load_run` returns).

    Attributes:
        run_dir: the run directory.
        path: the folder holding ``model.safetensors``, ``trainer_state.pt`` and ``optimizer.pt``
            (the run directory itself for a sinklens 0.1 run).
        step: optimizer steps done when it was written.
        config: the run's :class:`TrainConfig`.
    """

    run_dir: Path
    path: Path
    step: int
    config: TrainConfig


def is_run_dir(path: str | Path) -> bool:
    """True if ``path`` holds a sinklens training run (finished, interrupted, or 0.1-style).

    A run is recognised by ``checkpoint.json``, a ``checkpoints/`` folder, a ``metrics.jsonl``, or a
    ``config.json`` that is a :class:`TrainConfig` (keys ``model``, ``optim``, ``data``).
    """
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


def _legacy_checkpoint(run_dir: Path) -> bool:
    return all((run_dir / name).is_file() for name in (WEIGHTS, STATE))


def has_checkpoint(run_dir: str | Path) -> bool:
    """True if ``run_dir`` names a checkpoint to resume from (not yet verified: :func:`load_run` does that)."""
    run_dir = Path(run_dir)
    return _pointer(run_dir) is not None or any(_step_dirs(run_dir)) or _legacy_checkpoint(run_dir)


def _step_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def load_train_config(run_dir: str | Path) -> TrainConfig:
    """The :class:`TrainConfig` a run was trained with (its ``config.json``)."""
    path = Path(run_dir) / CONFIG
    if not path.is_file():
        raise RunNotFoundError(f"{str(run_dir)!r} is not a sinklens run directory: it has no {CONFIG}.")
    try:
        data = json.loads(path.read_text())
    except ValueError as err:
        raise CorruptCheckpointError(f"{str(path)!r} is not valid JSON ({err}).") from None
    return TrainConfig.from_dict(data)


def load_run(run_dir: str | Path) -> RunCheckpoint:
    """The newest good checkpoint of a run directory, verified against its manifest.

    Falls back (with a ``UserWarning``) to an earlier complete checkpoint when the current one is
    broken.

    Raises:
        RunNotFoundError: ``run_dir`` is not a run directory, or the run stopped before its first
            checkpoint.
        CorruptCheckpointError: every checkpoint it holds is broken (the message lists why).
    """
    run_dir = Path(run_dir)
    if not is_run_dir(run_dir):
        raise RunNotFoundError(f"{str(run_dir)!r} is not a sinklens run directory: it has no {CONFIG} or {POINTER}.")
    pointer = _pointer(run_dir)
    candidates = _step_dirs(run_dir)
    if pointer is not None:
        candidates = [pointer] + [(s, p) for s, p in candidates if s < pointer[0]]
    problems: list[str] = []
    for step, path in candidates:
        problem = verify_checkpoint(path)
        if problem is None:
            if problems:
                warnings.warn(
                    f"The current checkpoint of {str(run_dir)!r} is broken ({problems[0]}); using the earlier "
                    f"checkpoint of step {step} instead.",
                    stacklevel=2,
                )
            return RunCheckpoint(run_dir, path, step, load_train_config(path))
        problems.append(problem)
    if not problems and _legacy_checkpoint(run_dir):  # a sinklens 0.1 run directory
        state = _torch_load(run_dir / STATE)
        return RunCheckpoint(run_dir, run_dir, int(state["step"]), load_train_config(run_dir))
    if problems:
        raise CorruptCheckpointError(f"No good checkpoint in {str(run_dir)!r}: {'; '.join(problems)}.")
    if (run_dir / POINTER).exists():
        raise CorruptCheckpointError(f"{str(run_dir / POINTER)!r} is unreadable and no checkpoint folder is left.")
    raise RunNotFoundError(
        f"The run in {str(run_dir)!r} has no checkpoint yet (it stopped before its first one was written); "
        f"train it again, or with --resume after a checkpoint exists."
    )


def _dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}``, values as JSON gives them back (tuples become lists)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_dotted(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = json.loads(json.dumps(value))
    return flat


def resume_config(out: str | Path) -> TrainConfig | None:
    """The config ``--resume`` continues the run in ``out`` with: its ``config.json``, else (that file lost)
    the config saved in its newest good checkpoint, with a warning (the resume writes ``config.json`` again);
    None for a run with neither (it stopped before its first checkpoint), for :func:`~sinklens.train.loop.train`
    to refuse the resume as it refuses a fresh run there. ``sinklens train --resume`` starts from it, and so does
    ``train(resume_config(DIR), out_dir=DIR, resume=True)``. Where an ``--overwrite`` of ``out`` was killed before
    its first checkpoint, the run it replaced comes back when training starts
    (:func:`recover_set_aside`), so that run's config is the one read.

    Raises:
        RunNotFoundError: ``out`` is not a run directory at all.
    """
    run_dir = Path(out).expanduser()
    run_dir = set_aside_to_recover(run_dir) or run_dir
    if (run_dir / CONFIG).is_file() or not is_run_dir(run_dir):
        return load_train_config(run_dir)
    if not has_checkpoint(run_dir):
        return None
    checkpoint = load_run(run_dir)
    warnings.warn(f"{str(out)!r} has no {CONFIG}; resuming with the config saved in its checkpoint of step "
                  f"{checkpoint.step} ({str(checkpoint.path)!r}), which the resume writes back to {CONFIG}.", stacklevel=2)
    return checkpoint.config


def resume_changes(saved: TrainConfig, requested: TrainConfig, *, run_dir: str | Path) -> dict[str, list[Any]]:
    """What ``requested`` changes in the config of the run it resumes: ``{dotted key: [saved, requested]}``.

    A resume may change how the run goes on (``steps``, ``optim.*``, ``eval.*``, ``batch_size``,
    ``compile``, ``device``, ``interventions``...). It may not change what the run is
    (:data:`RUN_IDENTITY`: the model, the data and the initialisation seed, which the restored
    weights, data order and RNG states already fix). ``model.d_vocab="auto"`` matches any vocabulary;
    a local ``data.path`` matches another spelling of the same file or folder (relative ones from here).

    Examples:
        >>> run = TrainConfig()
        >>> resume_changes(run, run.replace(steps=600), run_dir="runs/a")
        {'steps': [300, 600]}

    Raises:
        ResumeMismatchError: ``requested`` changes a field of :data:`RUN_IDENTITY`; the message names
            each such field with both values.
    """
    old, new = _dotted(saved.to_dict()), _dotted(requested.to_dict())
    if new.get("model.d_vocab") == "auto":
        new["model.d_vocab"] = old.get("model.d_vocab")
    if saved.data.source in LOCAL_DATA_SOURCES and _same_path(old.get("data.path"), new.get("data.path")):
        new["data.path"] = old.get("data.path")  # one file, named from two folders (or before paths were absolute)
    changes = {key: [old.get(key), new.get(key)] for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)}
    fixed = [key for key in changes if key.startswith(RUN_IDENTITY) and key not in RESUME_FREE]
    if fixed:
        listed = "; ".join(f"{key} is {changes[key][1]!r} here but {changes[key][0]!r} in the run" for key in fixed)
        raise ResumeMismatchError(
            f"Cannot resume {str(run_dir)!r} with another model, data or seed: {listed}. A resume continues the run "
            "with its own config (sinklens train --out DIR --resume, or train(sinklens.sinklm.checkpoint.resume_config(DIR), out_dir=DIR, resume=True)); "
            "it may change steps, optim, eval and the like. For another model or data start a new run "
            "(another out_dir, or --overwrite)."
        )
    return changes


def _same_path(a: Any, b: Any) -> bool:
    """Whether two ``data.path`` values name the same file or folder (relative ones from this folder)."""
    if not a or not b:
        return a == b
    return Path(str(a)).expanduser().resolve() == Path(str(b)).expanduser().resolve()


def _torch_load(path: Path, **kwargs: Any) -> Any:
    try:
        return torch.load(path, weights_only=False, **kwargs)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{str(path)!r} is missing.") from None
    except Exception as err:  # a truncated or foreign file
        raise CorruptCheckpointError(f"{str(path)!r} cannot be read ({type(err).__name__}: {err}).") from None


def _load_weights(model: Any, path: Path, device: str) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    try:
        load_model(model, str(path), device=device)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{str(path)!r} is missing.") from None
    except (SafetensorError, RuntimeError, OSError) as err:
        raise CorruptCheckpointError(f"{str(path)!r} cannot be loaded ({type(err).__name__}: {err}).") from None


def load_checkpoint(
    run: str | Path | RunCheckpoint, *, model: Any, optimizer: torch.optim.Optimizer | None = None, scaler: Any = None
) -> int:
    """Restore weights, optimizer, grad-scaler and RNG states from ``run`` (a run directory, read with
    :func:`load_run`, or a checkpoint it returned); return the step to resume at.

    The optimizer's state (AdamW moments and step counts) comes from the checkpoint; its
    hyperparameters (betas, eps, weight decay, fused...) stay those ``optimizer`` was built with, so a
    resume that changes ``optim`` takes effect (``torch.optim.Optimizer.load_state_dict`` alone would
    put the saved ones back)."""
    ckpt = run if isinstance(run, RunCheckpoint) else load_run(run)
    model = unwrap_model(model)
    device = next(model.parameters()).device
    _load_weights(model, ckpt.path / WEIGHTS, str(device))
    if optimizer is not None and (ckpt.path / OPTIMIZER).is_file():
        configured = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
        optimizer.load_state_dict(_torch_load(ckpt.path / OPTIMIZER, map_location=device))
        for group, settings in zip(optimizer.param_groups, configured):
            group.update(settings)
    state = _torch_load(ckpt.path / STATE)
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    np.random.set_state(state["numpy_rng"])
    random.setstate(state["python_rng"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    return int(state["step"])


def clean_stale(run_dir: str | Path) -> list[Path]:
    """Remove what killed processes left in a run directory; return what was removed.

    Temporary checkpoint folders (``checkpoints/.tmp-*``, ``.tmp-*`` of sinklens 0.1) and step
    folders newer than the current checkpoint (renamed but never made current).
    """
    run_dir = Path(run_dir)
    removed = [p for p in run_dir.glob(".tmp-*")] + [p for p in (run_dir / CHECKPOINTS).glob(".tmp-*")]
    pointer = _pointer(run_dir)
    if pointer is not None:
        removed += [p for s, p in _step_dirs(run_dir) if s > pointer[0]]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    return removed


def _own_entries(run_dir: Path) -> list[str]:
    """The entries of ``run_dir`` (relative paths) that the run wrote itself: :data:`RUN_ENTRIES` and the
    ``step-*`` / ``.tmp-*`` folders in ``checkpoints/``; nothing else under it."""
    names = [name for name in RUN_ENTRIES if (run_dir / name).exists() or (run_dir / name).is_symlink()]
    root = run_dir / CHECKPOINTS
    if root.is_dir():
        names += [f"{CHECKPOINTS}/{p.name}" for p in sorted(root.iterdir())
                  if _STEP_DIR.match(p.name) or p.name.startswith(".tmp-")]
    return names


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _prune_empty(run_dir: Path) -> None:
    for folder in (CHECKPOINTS, "figures"):
        with contextlib.suppress(OSError):  # only when empty: other files in it stay
            (run_dir / folder).rmdir()


def set_aside_run(run_dir: str | Path) -> Path | None:
    """Move the run in ``run_dir`` (its own files only, :func:`_own_entries`) into ``run_dir/.overwritten-PID-*/``
    for ``overwrite=True``; return that folder (None when there was nothing to move).

    The new run deletes it (:func:`discard_set_aside`) once its first checkpoint is written, and puts it back
    (:func:`restore_set_aside`) when it fails before that, so an overwrite that fails (out of memory in the first
    step, a divergence, Ctrl-C) never loses the run it was to replace."""
    run_dir = Path(run_dir)
    clean_stale(run_dir)
    names = _own_entries(run_dir)
    if not names:
        return None
    aside = run_dir / f".overwritten-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    for name in names:
        (aside / name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(run_dir / name, aside / name)
    _prune_empty(run_dir)
    _fsync_dir(run_dir)
    return aside


def restore_set_aside(run_dir: str | Path, aside: Path) -> None:
    """Undo :func:`set_aside_run`: delete what the new run wrote and move the old run back."""
    run_dir = Path(run_dir)
    for name in _own_entries(run_dir):
        _remove(run_dir / name)
    for path in sorted(aside.rglob("*")):
        name = path.relative_to(aside).as_posix()
        if name in RUN_ENTRIES or (name.startswith(f"{CHECKPOINTS}/") and name.count("/") == 1):
            (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, run_dir / name)
    shutil.rmtree(aside, ignore_errors=True)
    _prune_empty(run_dir)
    _fsync_dir(run_dir)


def set_aside_runs(run_dir: str | Path) -> list[Path]:
    """The folders :func:`set_aside_run` left in ``run_dir``, newest first."""
    found = [p for p in Path(run_dir).glob(".overwritten-*") if p.is_dir()]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def discard_set_aside(run_dir: str | Path) -> None:
    """Delete the runs that :func:`set_aside_run` moved aside in ``run_dir`` (also those of a killed overwrite):
    called once the run in ``run_dir`` has written a regular checkpoint, which is what ``overwrite=True`` asked for."""
    for path in set_aside_runs(run_dir):
        shutil.rmtree(path, ignore_errors=True)


def set_aside_to_recover(run_dir: str | Path) -> Path | None:
    """The run that :func:`recover_set_aside` puts back in ``run_dir`` at the next start: the newest one an
    ``overwrite=True`` set aside, where ``run_dir`` holds no checkpoint (the replacement was killed before its
    first); None otherwise. A ``--resume`` reads that run's config, not the killed replacement's."""
    aside = set_aside_runs(run_dir)
    return aside[0] if aside and not has_checkpoint(run_dir) else None


def recover_set_aside(run_dir: str | Path) -> str | None:
    """Put back a run that an ``overwrite=True`` killed before its first checkpoint (SIGKILL, out of memory) left in
    ``run_dir/.overwritten-*``; say what was done (None when there was nothing).

    Called by a trainer that holds the run directory's lock, before it looks at the folder: where ``run_dir`` holds
    no checkpoint, the newest set-aside run comes back (the replacement never got as far as one); where it holds
    one (the replacement stopped on a divergence or Ctrl-C after a checkpoint of its own), the set-aside runs stay
    where they are, named, until the run reaches a regular checkpoint (:func:`discard_set_aside`)."""
    back = set_aside_to_recover(run_dir)
    if back is None:
        aside = set_aside_runs(run_dir)
        return None if not aside else (
            f"{str(run_dir)!r} still holds the run an earlier overwrite replaced, in {[str(p) for p in aside]} "
            "(the replacement stopped after a checkpoint of its own); it is deleted once this run writes a "
            "regular checkpoint. Move its files back into the folder to keep it instead.")
    restore_set_aside(run_dir, back)
    return (f"An overwrite of {str(run_dir)!r} was killed before its first checkpoint: the run it was replacing, "
            f"set aside in {str(back)!r}, is put back.")


def clear_run(run_dir: str | Path) -> None:
    """Delete a run's own checkpoints, metrics, tokenizer and figure at once; other files stay (``train`` itself
    uses :func:`set_aside_run`, which keeps the old run until the new one has a checkpoint)."""
    run_dir = Path(run_dir)
    clean_stale(run_dir)
    for name in _own_entries(run_dir):
        _remove(run_dir / name)
    _prune_empty(run_dir)


def foreign_entries(run_dir: str | Path) -> list[str]:
    """The entries of a folder that is *not* a sinklens run that a new run there would replace or be confused with
    (:data:`FOREIGN_BLOCKERS`: e.g. a Hugging Face model's ``config.json``, ``model.safetensors``, ``tokenizer/``)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir() or is_run_dir(run_dir):
        return []
    return [name for name in FOREIGN_BLOCKERS if (run_dir / name).exists() or (run_dir / name).is_symlink()]


def write_data_fingerprint(run_dir: str | Path, fingerprint: dict[str, Any]) -> None:
    """Store the run's data fingerprint (:func:`sinklens.train.data.data_fingerprint`) in ``run_dir``."""
    write_json(Path(run_dir) / FINGERPRINT, {"format": 1, **fingerprint}, digits=None)


def check_data_fingerprint(run_dir: str | Path, fingerprint: dict[str, Any]) -> bool:
    """Compare the data a resume built with the fingerprint its run stored at its first start; return whether the
    run had one (a run written before fingerprints were stored resumes unchecked).

    Raises:
        ResumeMismatchError: the tokenizer or a token stream differs (e.g. the corpus was rewritten in place, so
            a BPE was retrained and the ids remapped); the message names what changed.
        CorruptCheckpointError: the stored fingerprint is not readable JSON.
    """
    path = Path(run_dir) / FINGERPRINT
    if not path.is_file():
        return False
    try:
        stored = json.loads(path.read_text())
        if not isinstance(stored, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:
        raise CorruptCheckpointError(f"{str(path)!r} is unreadable ({err}).") from None
    labels = {"tokenizer": "the tokenizer (its vocabulary and merges)", "vocab_size": "the vocabulary size",
              "train": "the train token stream", "val": "the validation token stream"}
    changed = []
    for key, label in labels.items():
        if stored.get(key) != fingerprint.get(key):
            before, now = stored.get(key), fingerprint.get(key)
            if key in ("train", "val"):
                before = f"{stored.get(key + '_tokens')} tokens, sha256 {str(before)[:12]}"
                now = f"{fingerprint.get(key + '_tokens')} tokens, sha256 {str(now)[:12]}"
            elif key == "tokenizer":
                before, now = f"sha256 {str(before)[:12]}", f"sha256 {str(now)[:12]}"
            changed.append(f"{label} is {now} now but {before} in the run")
    if changed:
        raise ResumeMismatchError(
            f"Cannot resume {str(run_dir)!r}: its data changed since the run started ({'; '.join(changed)}), though "
            f"the config names the same data. Restore the data the run trained on, or start a new run (another "
            f"out_dir, or --overwrite)."
        )
    return True


class RunLock(FolderLock):
    """:class:`~sinklens.folder_lock.FolderLock` on a run directory (``run_dir/.lock``), held while a process trains
    there: a second trainer (a fresh run, ``--overwrite`` or ``--resume``) on the same folder is refused up front
    (:class:`~sinklens.errors.RunLockedError`, naming the holder's pid) instead of the two runs overwriting each
    other."""

    def __init__(self, run_dir: str | Path) -> None:
        super().__init__(run_dir, LOCK)

    def refusal(self, holder: str) -> Exception:
        return RunLockedError(f"{str(self.folder)!r} is being trained by another process (pid {holder}); wait for it "
                              f"to finish or stop it, or pick another out_dir.")


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The lines of ``run_dir/metrics.jsonl`` (``kind="train"``, ``"eval"``, ``"compile"``, ``"nonfinite"``).

    The trainer appends one line per write, so a process killed in the middle of a write (or a full
    disk) can leave a last line without its newline that is not JSON: that line is dropped with a
    ``RuntimeWarning`` (a ``--resume`` rewrites the file from its checkpoint's step anyway). A line
    that is not JSON anywhere else is damage this cannot explain and raises. An evaluation line written
    before 2026-11-25 logged sinklens' sink-rate variant as ``sink_rate``; it is returned under its own name,
    ``sinklens_sink_rate`` (``sink_rate`` is Gu et al.'s since: :class:`~sinklens.train.sink_metrics.SinkMetrics`).

    Raises:
        RunNotFoundError: ``run_dir`` has no ``metrics.jsonl``.
        CorruptCheckpointError: a line other than a torn last one is not a JSON object, a line lacks a
            string ``kind`` or a whole-number ``step``, or a ``kind="train"`` line lacks a finite number ``loss``
            (the trainer logs a non-finite step as a ``kind="nonfinite"`` line); the message names the line number.
    """
    path = Path(run_dir) / METRICS
    if not path.is_file():
        raise RunNotFoundError(f"{str(run_dir)!r} has no {METRICS}; is it a sinklens training run directory?")
    text = path.read_text(encoding="utf-8", errors="replace")
    rows = text.splitlines()
    lines: list[dict[str, Any]] = []
    for number, row in enumerate(rows, start=1):
        if not row.strip():
            continue
        try:
            line = json.loads(row)
        except json.JSONDecodeError as error:
            if number == len(rows) and not text.endswith("\n"):
                warnings.warn(f"{path}: its last line is cut short ({error.msg}, column {error.colno}), as when "
                              "the run was stopped while writing it; that line is ignored.", RuntimeWarning, stacklevel=2)
                break
            raise CorruptCheckpointError(f"{path}: line {number} is not JSON ({error.msg}, column {error.colno}).") from None
        if not isinstance(line, dict):
            raise CorruptCheckpointError(f"{path}: line {number} is not a JSON object, got {row[:80]!r}.")
        step, kind = line.get("step"), line.get("kind")
        if not isinstance(kind, str):
            raise CorruptCheckpointError(f"{path}: line {number} has no string \"kind\" (got {kind!r}): {row[:80]!r}.")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise CorruptCheckpointError(
                f"{path}: line {number} has no whole-number \"step\" >= 0 (got {step!r}): {row[:80]!r}.")
        loss = line.get("loss")
        if kind == "train" and (isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss)):
            got = "no \"loss\"" if "loss" not in line else f"\"loss\": {json.dumps(loss, allow_nan=True)}"
            raise CorruptCheckpointError(
                f"{path}: line {number} is a \"train\" line with {got}, not a finite number. sinklens train never writes "
                "one (a non-finite step is logged as a \"nonfinite\" line), so the file was damaged or edited; fix or "
                "remove that line.")
        lines.append(with_current_metric_names(line))
    return lines


def with_current_metric_names(line: dict[str, Any]) -> dict[str, Any]:
    """``line`` with today's metric names: an evaluation line written before 2026-11-25 held sinklens' sink-rate
    variant (queries ``q >= 1``) under ``sink_rate``, which now means Gu et al.'s; it becomes ``sinklens_sink_rate``."""
    if line.get("kind") == "eval" and "sink_rate" in line and "sinklens_sink_rate" not in line:
        line = dict(line)
        line["sinklens_sink_rate"] = line.pop("sink_rate")
    return line


def write_metrics(run_dir: str | Path, lines: list[dict[str, Any]]) -> None:
    """Replace ``metrics.jsonl`` atomically with ``lines`` (strict JSON, one per line)."""
    write_text_atomic(Path(run_dir) / METRICS, "".join(json_line(line) + "\n" for line in lines))


def load_trained_model(run_dir: str | Path, device: str | torch.device | None = None) -> Any:
    """Load a trained :class:`~sinklens.sinklm.model.SinkLM` from a run directory, in eval mode.

    Uses the newest good checkpoint (:func:`load_run`). The model gets its text tokenizer as
    ``model.tokenizer`` (a ``PreTrainedTokenizerFast``) when the run trained on text, so analyzers
    accept strings; synthetic-task models take token tensors. ``model.train_config`` is the run's
    :class:`TrainConfig`.

    Raises:
        RunNotFoundError: not a run directory, or no checkpoint written yet.
        CorruptCheckpointError: no checkpoint passes verification.
    """
    from sinklens.sinklm.model import SinkLM

    ckpt = load_run(run_dir)
    cfg = ckpt.config
    model = SinkLM(cfg.model)
    device = torch.device(device) if device is not None else torch.device("cpu")
    model.to(device)
    _load_weights(model, ckpt.path / WEIGHTS, str(device))
    if (ckpt.run_dir / TOKENIZER).is_dir():
        model.tokenizer = load_tokenizer(str(ckpt.run_dir / TOKENIZER))
    model.train_config = cfg
    return model.eval()


def checkpoint_steps(run_dir: str | Path) -> list[int]:
    """The steps of the verified checkpoints kept in ``run_dir/checkpoints/``, oldest first.

    Only the newest checkpoint and its fallback are kept unless the run set ``keep_every``; broken
    step directories are skipped with a warning.
    """
    run_dir = Path(run_dir)
    if not is_run_dir(run_dir):
        raise RunNotFoundError(f"{str(run_dir)!r} is not a sinklens run directory: it has no {CONFIG} or {POINTER}.")
    steps = []
    for step, path in sorted(_step_dirs(run_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            steps.append(step)
        else:
            warnings.warn(f"Skipping the broken checkpoint of step {step} in {str(run_dir)!r}: {problem}.", stacklevel=2)
    return steps


def load_step_model(run_dir: str | Path, step: int, device: str | torch.device | None = None) -> Any:
    """The :class:`~sinklens.sinklm.model.SinkLM` of the kept checkpoint of ``step``, verified, in eval mode.

    Step 0 (never written as a checkpoint) is the run's initialization, ``RUN_DIR@init``
    (:func:`sinklens.loading.init.sinklm_at_init` with the run's config and seed).
    """
    from sinklens.sinklm.model import SinkLM

    run_dir = Path(run_dir)
    device = torch.device(device) if device is not None else torch.device("cpu")
    cfg = load_train_config(run_dir)
    if step == 0:
        model = sinklm_at_init(cfg.model, cfg.seed, device=device)
    else:
        path = run_dir / CHECKPOINTS / _step_dir_name(step)
        if not path.is_dir():
            raise RunNotFoundError(
                f"{str(run_dir)!r} keeps no checkpoint of step {step}; kept steps: {checkpoint_steps(run_dir)} "
                f"(train with keep_every=K to keep every K-th checkpoint)."
            )
        problem = verify_checkpoint(path)
        if problem is not None:
            raise CorruptCheckpointError(f"The checkpoint of step {step} in {str(run_dir)!r} is broken: {problem}.")
        model = SinkLM(cfg.model).to(device)
        _load_weights(model, path / WEIGHTS, str(device))
    if (run_dir / TOKENIZER).is_dir():
        model.tokenizer = load_tokenizer(str(run_dir / TOKENIZER))
    model.train_config = cfg
    return model.eval()
