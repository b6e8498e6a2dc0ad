"""The run folder around its checkpoints (:mod:`sinklens.sinklm.checkpoint`): what a resume continues with, the
data it must find again, the lock one trainer holds, and ``overwrite=True`` that keeps the old run until the new
one has a checkpoint (set aside in ``.overwritten-*``, put back when the new run fails or was killed before)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

from sinklens.errors import CorruptFileError, InvalidArgumentError, NotFoundError, OutputExistsError
from sinklens.export import write_json
from sinklens.folder_lock import FolderLock
from sinklens.sinklm.checkpoint import (
    _STEP_DIR, CHECKPOINTS, CONFIG, FIGURE, FINGERPRINT, LOCK, PERSISTENCE, POINTER, RUN_ENTRIES, TOKENIZER,
    WEIGHTS, _fsync, _pointer, _remove, _step_dirs, has_checkpoint, is_run_dir, load_run, load_train_config,
)
from sinklens.sinklm.config import LOCAL_DATA_SOURCES, TrainConfig

#: Config keys a resume may not change (:func:`resume_changes`; ``x.`` covers a section), except :data:`RESUME_FREE`.
RUN_IDENTITY: tuple[str, ...] = ("model.", "data.", "seed")
RESUME_FREE: frozenset[str] = frozenset({"data.cache_dir"})
#: Entries a folder that is not a run may not hold for a run to start there (another tool's model or tokenizer).
FOREIGN_BLOCKERS: tuple[str, ...] = (
    CONFIG, POINTER, CHECKPOINTS, TOKENIZER, WEIGHTS, "trainer_state.pt", "optimizer.pt", PERSISTENCE, FINGERPRINT,
    FIGURE, "pytorch_model.bin", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json")


def resume_config(out: str | Path) -> TrainConfig | None:
    """The config ``--resume`` continues the run in ``out`` with: its ``config.json``, else its newest good
    checkpoint's (with a warning); None with neither. NotFoundError when ``out`` is not a run folder."""
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


def _dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}``, values as JSON gives them back (tuples become lists)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_dotted(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = json.loads(json.dumps(value))
    return flat


def resume_changes(saved: TrainConfig, requested: TrainConfig, *, run_dir: str | Path) -> dict[str, list[Any]]:
    """What ``requested`` changes in the resumed run's config, ``{dotted key: [saved, requested]}``: how it goes on
    may change, not what it is (:data:`RUN_IDENTITY`: InvalidArgumentError). ``d_vocab="auto"`` matches any
    vocabulary; a local ``data.path`` matches another spelling of the same file."""
    old, new = _dotted(saved.to_dict()), _dotted(requested.to_dict())
    if new.get("model.d_vocab") == "auto":
        new["model.d_vocab"] = old.get("model.d_vocab")
    a, b = old.get("data.path"), new.get("data.path")
    if saved.data.source in LOCAL_DATA_SOURCES and a and b and Path(a).expanduser().resolve() == Path(b).expanduser().resolve():
        new["data.path"] = a
    changes = {key: [old.get(key), new.get(key)] for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)}
    if fixed := [key for key in changes if key.startswith(RUN_IDENTITY) and key not in RESUME_FREE]:
        listed = "; ".join(f"{key} is {changes[key][1]!r} here but {changes[key][0]!r} in the run" for key in fixed)
        raise InvalidArgumentError(
            f"Cannot resume {str(run_dir)!r} with another model, data or seed: {listed}. A resume continues the run "
            "with its own config (sinklens train --out DIR --resume, or train(sinklens.sinklm.run_folder."
            "resume_config(DIR), out_dir=DIR, resume=True)) and may change steps, optim, eval...; for another model "
            "or data start a new run (another out_dir, or --overwrite).")
    return changes


def write_data_fingerprint(run_dir: str | Path, fingerprint: dict[str, Any]) -> None:
    """Store the run's data fingerprint (:func:`sinklens.train.data.data_fingerprint`) in ``run_dir``."""
    write_json(Path(run_dir) / FINGERPRINT, {"format": 1, **fingerprint}, digits=None)


def check_data_fingerprint(run_dir: str | Path, fingerprint: dict[str, Any]) -> None:
    """InvalidArgumentError naming what changed when the data differ from the fingerprint the run stored."""
    path = Path(run_dir) / FINGERPRINT
    if not path.is_file():
        return
    try:
        stored = json.loads(path.read_text())
        if not isinstance(stored, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:
        raise CorruptFileError(f"{str(path)!r} is unreadable ({err}).") from None

    def shown(data: dict[str, Any], key: str) -> str:
        if key in ("train", "val"):
            return f"{data.get(key + '_tokens')} tokens, sha256 {str(data.get(key))[:12]}"
        return f"sha256 {str(data.get(key))[:12]}" if key == "tokenizer" else str(data.get(key))

    labels = {"tokenizer": "the tokenizer (its vocabulary and merges)", "vocab_size": "the vocabulary size",
              "train": "the train token stream", "val": "the validation token stream"}
    if changed := [f"{label} is {shown(fingerprint, key)} now but {shown(stored, key)} in the run"
                   for key, label in labels.items() if stored.get(key) != fingerprint.get(key)]:
        raise InvalidArgumentError(
            f"Cannot resume {str(run_dir)!r}: its data changed since the run started ({'; '.join(changed)}), though "
            "the config names the same data. Restore the data the run trained on, or start a new run (another "
            "out_dir, or --overwrite).")


def tokenizer_problem(run_dir: str | Path) -> str | None:
    """None if ``run_dir/tokenizer/`` loads, else what is wrong with it (missing, or why it does not load)."""
    path = Path(run_dir) / TOKENIZER
    if not path.is_dir():
        return f"{str(path)!r} is missing"
    from sinklens.sinklm.tokenizer import load_tokenizer
    try:
        load_tokenizer(str(path))
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file, whatever the parser raises
        return f"{str(path)!r} does not load ({type(err).__name__}: {' '.join(str(err).split())[:200]})"
    return None


def clean_stale(run_dir: str | Path) -> list[Path]:
    """Remove (and return) what killed processes left: ``.tmp-*`` and step folders newer than the current one."""
    run_dir = Path(run_dir)
    removed = [*run_dir.glob(".tmp-*"), *(run_dir / CHECKPOINTS).glob(".tmp-*")]
    pointer = _pointer(run_dir)
    removed += [p for s, p in _step_dirs(run_dir) if pointer is not None and s > pointer[0]]
    for path in removed:
        _remove(path)
    return removed


def _own_entries(run_dir: Path) -> list[str]:
    """The entries of ``run_dir`` the run wrote itself: :data:`RUN_ENTRIES` and ``checkpoints/step-*``/``.tmp-*``."""
    names = [name for name in RUN_ENTRIES if os.path.lexists(run_dir / name)]
    root = run_dir / CHECKPOINTS
    if root.is_dir():
        names += [f"{CHECKPOINTS}/{p.name}" for p in sorted(root.iterdir())
                  if _STEP_DIR.match(p.name) or p.name.startswith(".tmp-")]
    return names


def _move_run(source: Path, target: Path) -> None:
    """Move the run's own entries from ``source`` to ``target``; ``checkpoints/`` and ``figures/`` left empty go."""
    for name in _own_entries(source):
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(source / name, target / name)
    for folder in (source / CHECKPOINTS, source / "figures", target / CHECKPOINTS, target / "figures"):
        with contextlib.suppress(OSError):  # only when empty: other files in it stay
            folder.rmdir()
    _fsync(source)
    _fsync(target)


def set_aside_run(run_dir: str | Path) -> Path | None:
    """Move the run's own files into ``run_dir/.overwritten-PID-*/`` for ``overwrite=True`` and return that folder
    (None: nothing there); deleted at the new run's first checkpoint, put back if it fails before."""
    run_dir = Path(run_dir)
    clean_stale(run_dir)
    if not _own_entries(run_dir):
        return None
    aside = run_dir / f".overwritten-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    _move_run(run_dir, aside)
    return aside


def restore_set_aside(run_dir: str | Path, aside: Path) -> None:
    """Undo :func:`set_aside_run`: delete what the new run wrote and move the old run back."""
    run_dir = Path(run_dir)
    for name in _own_entries(run_dir):
        _remove(run_dir / name)
    _move_run(aside, run_dir)
    shutil.rmtree(aside, ignore_errors=True)


def set_aside_runs(run_dir: str | Path) -> list[Path]:
    """The folders :func:`set_aside_run` left in ``run_dir``, newest first."""
    found = [p for p in Path(run_dir).glob(".overwritten-*") if p.is_dir()]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def discard_set_aside(run_dir: str | Path) -> None:
    """Delete the runs set aside in ``run_dir`` (once the run there has written a regular checkpoint)."""
    for path in set_aside_runs(run_dir):
        shutil.rmtree(path, ignore_errors=True)


def set_aside_to_recover(run_dir: str | Path) -> Path | None:
    """The newest set-aside run if ``run_dir`` has no checkpoint (its overwrite died before its first), else None."""
    aside = set_aside_runs(run_dir)
    return aside[0] if aside and not has_checkpoint(run_dir) else None


def recover_set_aside(run_dir: str | Path) -> str | None:
    """At a start, under the run's lock: put back the run that an overwrite killed before its first checkpoint
    set aside; return what was done or found (None: nothing)."""
    if (back := set_aside_to_recover(run_dir)) is not None:
        restore_set_aside(run_dir, back)
        return (f"An overwrite of {str(run_dir)!r} was killed before its first checkpoint: the run it was replacing, "
                f"set aside in {str(back)!r}, is put back.")
    aside = set_aside_runs(run_dir)
    return None if not aside else (
        f"{str(run_dir)!r} still holds the run an earlier overwrite replaced, in {[str(p) for p in aside]} "
        "(the replacement stopped after a checkpoint of its own); it is deleted once this run writes a "
        "regular checkpoint. Move its files back into the folder to keep it instead.")


def check_run_dir(out: Path | None, *, resume: bool, overwrite: bool) -> None:
    """Refuse to clobber a run, or another tool's folder, by accident; and a resume with nothing to resume."""
    if resume and overwrite:
        raise InvalidArgumentError("resume and overwrite exclude each other: resume continues the run in out_dir, "
                                   "overwrite deletes it.")
    if out is None:
        if resume:
            raise InvalidArgumentError("resume=True needs out_dir, the run directory to continue.")
        return
    if out.exists() and not out.is_dir():
        raise InvalidArgumentError(f"out_dir {str(out)!r} exists and is not a folder.")
    foreign = [] if not out.is_dir() or is_run_dir(out) else [n for n in FOREIGN_BLOCKERS if os.path.lexists(out / n)]
    if foreign and not resume:
        raise OutputExistsError(
            f"out_dir {str(out)!r} is not a sinklens training run but holds {', '.join(foreign)} (another tool's "
            "files?), which a run there would replace or be loaded with; "
            + ("overwrite=True (--overwrite) only replaces a sinklens run. " if overwrite else "")
            + "Pick an empty or new out_dir.")
    if resume and not has_checkpoint(out):
        again = (" It stopped before its first checkpoint, so there is nothing to continue: start it again with "
                 "overwrite=True (--overwrite instead of --resume), or pick another out_dir.") if is_run_dir(out) else ""
        raise NotFoundError(f"resume=True but {str(out)!r} holds no checkpoint to resume from.{again}")
    if not resume and not overwrite and is_run_dir(out):
        if not has_checkpoint(out):  # a run that failed before its first checkpoint: --resume cannot continue it
            raise OutputExistsError(
                f"{str(out)!r} already holds a training run that stopped before its first checkpoint (nothing to "
                "resume from). Start it again with overwrite=True (--overwrite), which deletes what it left, or pick "
                "another out_dir.")
        raise OutputExistsError(f"{str(out)!r} already holds a training run. Continue it with resume=True (--resume), "
                                "replace it with overwrite=True (--overwrite), or pick another out_dir.")


class RunLock(FolderLock):
    """``run_dir/.lock``, held while a process trains there: a second trainer gets :class:`OutputExistsError`."""

    def __init__(self, run_dir: str | Path) -> None:
        super().__init__(run_dir, LOCK)

    def refusal(self, holder: str) -> Exception:
        return OutputExistsError(f"{str(self.folder)!r} is being trained by another process (pid {holder}); wait for it "
                                 f"to finish or stop it, or pick another out_dir.")
