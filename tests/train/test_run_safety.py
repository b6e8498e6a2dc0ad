"""Never lose a run: refusal to clobber, atomic checkpoints under a kill at every step, divergence stop,
named errors for broken or unfinished runs, strict JSON everywhere."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import warnings

import pytest
import torch
from _train_cfg import build_cfg

import sinklens
import sinklens.sinklm.checkpoint as ckpt_mod
from sinklens.cli import main
from sinklens.errors import (
    CorruptFileError, InvalidArgumentError, NotFoundError, OutputExistsError, TrainingDivergedError,
    TrainingInterrupted,
)
from sinklens.sinklm.checkpoint import (
    load_checkpoint, load_run, load_train_config, load_trained_model, read_metrics, save_checkpoint,
)
from sinklens.sinklm.trainer_state import read_trainer_state
from sinklens.sinklm.run_folder import clean_stale, resume_changes
from sinklens.train import loop as _loop
from sinklens.train.interrupt import StopSignals, interrupted_error
from sinklens.train.optim import configure_optimizer
from sinklens.sinklm.model import SinkLM
from sinklens.train.loop import train

pytestmark = pytest.mark.models


def _snapshot(run_dir):
    return {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ refusal to clobber


def test_new_run_refuses_a_directory_holding_a_run(tmp_path):
    cfg = build_cfg(steps=3)
    train(cfg, out_dir=tmp_path, progress=False)
    before = _snapshot(tmp_path)
    with pytest.raises(OutputExistsError, match="already holds a training run.*--resume.*--overwrite"):
        train(build_cfg(steps=5), out_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match="Unknown intervention 'restrat'.*Did you mean 'restart'"):  # typo'd spec
        train(build_cfg(steps=5), out_dir=tmp_path, overwrite=True, interventions=["restrat:positions=4"], progress=False)
    with pytest.raises(ValueError, match="(?i)position 999 is out of range"):  # fails only once built on the model: still before writing
        train(build_cfg(steps=5, interventions=["restart:positions=999"]), out_dir=tmp_path, overwrite=True, progress=False)
    assert _snapshot(tmp_path) == before  # nothing touched: config, metrics, weights all as they were

    again = train(build_cfg(steps=5), out_dir=tmp_path, overwrite=True, progress=False)
    assert len(again.losses()) == 5 and load_run(tmp_path).step == 5
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5


def test_cli_refuses_existing_run_and_bad_values_before_touching_it(tmp_path, capsys):
    tiny = ["--preset", "tiny", "--set", "model.d_model=16", "--set", "model.n_ctx=16", "--set", "model.d_vocab=24",
            "--set", "data.vocab_size=24", "--seq-len", "16", "--batch-size", "8", "--device", "cpu", "--no-progress",
            "--set", "eval.interval=0", "--out", str(tmp_path)]
    assert main(["train", "--steps", "2", *tiny]) == 0
    before = _snapshot(tmp_path)
    capsys.readouterr()
    assert main(["train", "--steps", "3", *tiny]) == 2
    assert "already holds a training run" in capsys.readouterr().err
    for bad, message in [(["--set", "optim.lr=nan"], "optim.lr must be a finite number, got nan"),
                         (["--optim.lr", "inf"], "optim.lr must be a finite number, got inf"),
                         (["--lr", "-1"], "optim.lr must be in (0, inf], got -1"),
                         (["--intervention", "explode:k=1"], "Unknown intervention 'explode'")]:
        assert main(["train", "--overwrite", *tiny, *bad]) == 2, bad
        assert message in capsys.readouterr().err
    assert _snapshot(tmp_path) == before
    assert main(["train", "--steps", "4", "--overwrite", "--optim.warmup-steps", "1", *tiny]) == 0
    assert json.loads((tmp_path / "config.json").read_text())["optim"]["warmup_steps"] == 1


# ------------------------------------------------------------------ a resume continues the run as it was

HEADWISE = {"model": {"variant": "headwise_rms"}}


def test_resume_refuses_another_model_data_or_seed_before_touching_the_run(tmp_path):
    train(build_cfg(steps=6, **HEADWISE), out_dir=tmp_path, progress=False, until=3)
    before = _snapshot(tmp_path)
    for change, named in [
        ({"model": {"variant": "baseline"}}, "model.variant is 'baseline' here but 'headwise_rms' in the run"),
        ({**HEADWISE, "data": {"alpha": 0.2}}, "data.alpha is 0.2 here but 0.05 in the run"),
        ({**HEADWISE, "seed": 7}, "seed is 7 here but 0 in the run"),
        ({"model": {"variant": "headwise_rms", "d_mlp": 48}}, "model.d_mlp is 48 here but 32 in the run"),
    ]:
        with pytest.raises(InvalidArgumentError, match=re.escape(named)):
            train(build_cfg(steps=6, **change), out_dir=tmp_path, resume=True, progress=False)
    assert _snapshot(tmp_path) == before  # refused before anything was written


def test_resume_applies_and_records_changes_to_how_the_run_goes_on(tmp_path):
    cfg = build_cfg(steps=6, **HEADWISE)
    train(cfg, out_dir=tmp_path / "a", progress=False, until=3)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    same = train(cfg, out_dir=tmp_path / "a", resume=True, progress=False)
    changed_cfg = build_cfg(steps=8, optim={"weight_decay": 0.9, "beta2": 0.5}, **HEADWISE)
    changed = train(changed_cfg, out_dir=tmp_path / "b", resume=True, progress=False)
    resumes = [[x for x in run.history if x["kind"] == "resume"] for run in (same, changed)]
    assert resumes[0] == [{"kind": "resume", "step": 3, "changes": {}}]
    assert resumes[1] == [{"kind": "resume", "step": 3, "changes": {
        "optim.beta2": [0.95, 0.5], "optim.weight_decay": [0.1, 0.9], "steps": [6, 8]}}]
    assert read_metrics(tmp_path / "b")[3] == resumes[1][0]
    # step 3's loss comes before its update; from step 4 on the new betas and decay (and schedule) act
    assert changed.losses()[:4] == same.losses()[:4] and changed.losses()[4] != pytest.approx(same.losses()[4], abs=1e-6)

    # the optimizer keeps the configured hyperparameters and takes its moments from the checkpoint
    model = SinkLM(changed_cfg.model)
    optimizer = configure_optimizer(model, changed_cfg.optim, torch.device("cpu"))
    saved, tensors = read_trainer_state(load_run(tmp_path / "a").path)  # trained with cfg
    assert load_checkpoint(tmp_path / "a", model=model, optimizer=optimizer) == 6
    assert [(g["weight_decay"], g["betas"]) for g in optimizer.param_groups] == [(0.9, (0.9, 0.5)), (0.0, (0.9, 0.5))]
    assert [g["weight_decay"] for g in saved["optimizer"]["param_groups"]] == [0.1, 0.0]  # what load_state_dict would restore
    state = optimizer.state_dict()["state"]
    assert len(state) == len(model.state_dict()) > 0
    assert all(torch.equal(state[i]["exp_avg_sq"], tensors[f"optimizer.{i}.exp_avg_sq"]) for i in state)


def test_cli_resume_takes_the_runs_own_config(tmp_path, capsys):
    cfg = build_cfg(steps=6, **HEADWISE)
    full = train(cfg, out_dir=tmp_path / "full", progress=False)
    train(cfg, out_dir=tmp_path / "cut", progress=False, until=3)
    assert load_train_config(tmp_path / "cut").model.variant == "headwise_rms"
    assert main(["train", "--out", str(tmp_path / "cut"), "--resume", "--no-progress"]) == 0  # no other flag
    printed = capsys.readouterr().out
    assert "resumed at step 3 with the run's config" in printed and "trained headwise_rms for 6 steps" in printed
    assert [x["loss"] for x in read_metrics(tmp_path / "cut") if x["kind"] == "train"] == pytest.approx(full.losses(), abs=1e-6)

    assert main(["train", "--out", str(tmp_path / "cut"), "--resume", "--steps", "7", "--no-progress"]) == 0
    assert "resumed at step 6 with steps 6 -> 7" in capsys.readouterr().out
    assert main(["train", "--out", str(tmp_path / "cut"), "--resume", "--variant", "baseline"]) == 2
    err = capsys.readouterr().err
    assert "model.variant is 'baseline' here but 'headwise_rms' in the run" in err and "Traceback" not in err
    assert main(["train", "--out", str(tmp_path / "nothing"), "--resume"]) == 2
    assert "'" + str(tmp_path / "nothing") + "' is not a sinklens run directory" in capsys.readouterr().err


def test_a_text_run_resumes_from_any_folder_and_refuses_another_file(tmp_path, monkeypatch, capsys):
    """config.json records the data file absolutely; a resume names it from anywhere, another file is refused."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    text = " ".join(f"word{i % 37} and then some more text {i}" for i in range(400))
    (tmp_path / "a" / "corpus.txt").write_text(text)
    (tmp_path / "b" / "copy.txt").write_text(text)  # same bytes, another file: still another run's data
    cfg = build_cfg(steps=6, model={"d_vocab": "auto"},
                    data={"source": "text", "path": "corpus.txt", "tokenizer": "byte", "vocab_size": None,
                          "cache_dir": str(tmp_path / "cache")})
    monkeypatch.chdir(tmp_path / "a")
    full = train(cfg, out_dir=tmp_path / "full", progress=False)
    for name in ("cut", "cut2"):
        train(cfg, out_dir=tmp_path / name, progress=False, until=3)
    assert load_train_config(tmp_path / "cut").data.path == str(tmp_path / "a" / "corpus.txt")

    monkeypatch.chdir(tmp_path / "b")  # from another folder: the run's own config, or the same file named from here
    assert main(["train", "--out", "../cut", "--resume", "--no-progress"]) == 0
    assert main(["train", "--out", "../cut2", "--resume", "--data", "../a/corpus.txt", "--no-progress"]) == 0
    capsys.readouterr()
    for name in ("cut", "cut2"):
        losses = [x["loss"] for x in read_metrics(tmp_path / name) if x["kind"] == "train"]
        assert losses == pytest.approx(full.losses(), abs=1e-6)
    before = _snapshot(tmp_path / "cut")
    assert main(["train", "--out", "../cut", "--resume", "--steps", "8", "--data", "copy.txt"]) == 2
    err = capsys.readouterr().err
    assert f"data.path is '{tmp_path / 'b' / 'copy.txt'}' here but '{tmp_path / 'a' / 'corpus.txt'}' in the run" in err
    assert _snapshot(tmp_path / "cut") == before

    # a run written before paths were recorded absolutely: its relative path still matches from its folder
    saved = load_train_config(tmp_path / "cut").replace(data={**cfg.data.to_dict(), "path": "corpus.txt"})
    monkeypatch.chdir(tmp_path / "a")
    assert resume_changes(saved, saved.replace(data=saved.data.with_absolute_path()), run_dir="r") == {}


# ------------------------------------------------------------------ Ctrl-C and SIGTERM


@pytest.fixture
def terminal_signals():
    """SIGINT and SIGTERM as a terminal process has them. A job started in the background (``&``, ``nohup``,
    some CI runners) inherits SIGINT ignored, and StopSignals rightly leaves an ignored signal alone."""
    previous = {sig: signal.signal(sig, handler) for sig, handler in
                ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL))}
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _signal_at_forward(n: int, sig: signal.Signals = signal.SIGINT):
    """A training-time intervention that changes nothing and sends ``sig`` to this process in the n-th forward."""
    calls = []

    def hooks(model):
        def fn(x, hook):
            calls.append(1)
            if len(calls) == n:
                signal.raise_signal(sig)
            return x
        return [("blocks.0.hook_resid_pre", fn)]
    return hooks


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.usefixtures("terminal_signals")
def test_a_signal_finishes_the_step_checkpoints_it_and_resume_goes_on_exactly(tmp_path, sig):
    cfg = build_cfg(steps=8)
    full = train(cfg, out_dir=tmp_path / "full", progress=False)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(TrainingInterrupted, match=rf"{sig.name} at step 4 of 8: .*checkpoint is saved in .*--resume"):
        train(cfg, out_dir=tmp_path / "cut", progress=False, interventions=[_signal_at_forward(4, sig)])  # in step 3
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # handlers given back
    assert load_run(tmp_path / "cut").step == 4  # steps 0-3 done: step 3 was finished, not cut
    assert [x["step"] for x in read_metrics(tmp_path / "cut")] == [0, 1, 2, 3]
    resumed = train(cfg, out_dir=tmp_path / "cut", resume=True, progress=False)
    assert resumed.losses() == pytest.approx(full.losses(), abs=1e-6)
    assert all(torch.equal(p, q) for p, q in zip(resumed.model.parameters(), full.model.parameters()))


@pytest.mark.usefixtures("terminal_signals")
def test_a_signal_right_after_a_periodic_checkpoint_does_not_write_it_again(tmp_path, monkeypatch):
    steps = []
    real = _loop.save_checkpoint
    monkeypatch.setattr(_loop, "save_checkpoint", lambda *args, **kwargs: steps.append(kwargs["step"]) or real(*args, **kwargs))
    with pytest.raises(TrainingInterrupted, match="SIGINT at step 4 of 8"):
        train(build_cfg(steps=8, checkpoint_interval=2), out_dir=tmp_path, progress=False,
              interventions=[_signal_at_forward(4)])
    assert steps == [2, 4] and load_run(tmp_path).step == 4


@pytest.mark.usefixtures("terminal_signals")
def test_a_signal_without_out_dir_or_before_a_step_saves_nothing_and_says_so(tmp_path):
    with pytest.raises(TrainingInterrupted, match="SIGINT at step 2 of 5: .*nothing was saved"):
        train(build_cfg(steps=5), progress=False, interventions=[_signal_at_forward(2)])
    # a signal before the first step of a resumed process finished: the run stays as it was
    message = str(interrupted_error("SIGINT", 2, 2, 5, tmp_path, lambda step: pytest.fail("no checkpoint expected")))
    assert message == (f"SIGINT at step 2 of 5: training stopped after a whole step; no step had finished since step 2, "
                       f"so the run in {str(tmp_path)!r} is as it was.")


@pytest.mark.usefixtures("terminal_signals")
def test_a_second_signal_stops_at_once_and_an_ignored_one_stays_ignored():
    with StopSignals() as stops:
        assert stops.active and signal.getsignal(signal.SIGINT) == stops._handle
        signal.raise_signal(signal.SIGINT)
        assert stops.received == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back at the second
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with StopSignals():
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # a background job's ignored signal
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not StopSignals(enabled=False).__enter__().active


@pytest.mark.usefixtures("terminal_signals")
def test_cli_ctrl_c_checkpoints_and_exits_130(tmp_path, capsys, monkeypatch):
    real = _loop.forward_backward
    calls = []

    def forward_backward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(_loop, "forward_backward", forward_backward)
    tiny = ["--preset", "tiny", "--set", "model.d_model=16", "--set", "model.n_ctx=16", "--set", "model.d_vocab=24",
            "--set", "data.vocab_size=24", "--seq-len", "16", "--batch-size", "8", "--device", "cpu", "--no-progress",
            "--set", "eval.interval=0", "--data", "bigram-backcopy", "--steps", "6", "--out", str(tmp_path)]
    assert main(["train", *tiny]) == 130
    err = capsys.readouterr().err
    assert "sinklens train: interrupted: SIGINT at step 3 of 6: training stopped after a whole step" in err
    assert "Traceback" not in err and load_run(tmp_path).step == 3


# ------------------------------------------------------------------ atomic checkpoints

OPS = ("write_json", "save_model", "save_file", "fsync", "replace")


def _kill_after(monkeypatch, op: str, n: int):
    """Raise KeyboardInterrupt (a simulated kill) right after the n-th call of ``op`` inside save_checkpoint."""
    import safetensors.torch

    calls = {"n": 0}

    def wrap(fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            calls["n"] += 1
            if calls["n"] == n:
                raise KeyboardInterrupt(f"killed after {op} #{n}")
            return out

        return wrapped

    targets = {
        "write_json": (ckpt_mod, "write_json", ckpt_mod.write_json),
        "save_model": (safetensors.torch, "save_model", safetensors.torch.save_model),
        "save_file": (safetensors.torch, "save_file", safetensors.torch.save_file),
        "fsync": (ckpt_mod, "_fsync", ckpt_mod._fsync),
        "replace": (ckpt_mod.os, "replace", os.replace),
    }
    module, name, fn = targets[op]
    monkeypatch.setattr(module, name, wrap(fn))
    return calls


def test_a_kill_at_every_point_of_a_checkpoint_write_leaves_one_consistent_checkpoint(tmp_path, monkeypatch):
    cfg = build_cfg(steps=4)
    ref = train(cfg, out_dir=tmp_path / "ref", progress=False, until=2)  # a run with its step-2 checkpoint
    later = train(cfg, progress=False)  # different weights to save "at step 4"
    killed_points = 0
    for op in OPS:
        for n in range(1, 6):
            run = tmp_path / f"{op}-{n}"
            shutil.copytree(tmp_path / "ref", run)
            with monkeypatch.context() as m:
                calls = _kill_after(m, op, n)
                try:
                    save_checkpoint(run, model=later.model, optimizer=None, cfg=cfg, step=4)
                except KeyboardInterrupt:
                    killed_points += 1
                else:
                    assert calls["n"] < n  # the write finished before the n-th call: no more points of this op
                    continue
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # the pointer must never name a broken checkpoint
                got = load_run(run)
            model = load_trained_model(run)
            expected = ref.model if got.step == 2 else later.model
            assert got.step in (2, 4)
            for p, q in zip(model.parameters(), expected.parameters()):
                torch.testing.assert_close(p, q, atol=0, rtol=0)  # weights and step always belong together
            assert read_trainer_state(got.path)[0]["step"] == got.step
            clean_stale(run)
            assert not list(run.rglob(".tmp-*"))  # temporaries of the killed write are cleaned up
    assert killed_points >= 8  # the kill really hit the write at many points


def test_a_corrupt_current_checkpoint_falls_back_to_the_previous_one(tmp_path):
    cfg = build_cfg(steps=6, checkpoint_interval=2)
    train(cfg, out_dir=tmp_path, progress=False)
    assert load_run(tmp_path).step == 6
    steps = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert steps == ["step-000004", "step-000006"]  # the current one and the one before it
    weights = tmp_path / "checkpoints" / "step-000006" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated
    with pytest.warns(UserWarning, match="step-000006.*truncated.*using the earlier checkpoint of step 4"):
        assert load_run(tmp_path).step == 4
    with pytest.warns(UserWarning):
        resumed = train(cfg, out_dir=tmp_path, resume=True, progress=False)  # continues from step 4
    assert [x["step"] for x in resumed.history if x["kind"] == "train"] == list(range(6))
    assert load_run(tmp_path).step == 6

    data = tmp_path / "checkpoints" / "step-000004" / "trainer_state.json"
    data.write_bytes(b"garbage")
    weights = tmp_path / "checkpoints" / "step-000006" / "model.safetensors"
    weights.write_bytes(b"x" * weights.stat().st_size)  # same size, wrong content
    with pytest.raises(CorruptFileError, match="fails its SHA-256 checksum"):
        load_run(tmp_path)
    with pytest.raises(CorruptFileError, match="No good checkpoint"):
        sinklens.load_model(tmp_path, device="cpu")


def test_a_trainer_state_that_does_not_fit_is_a_named_error(tmp_path, capsys):
    """A consistent manifest over a trainer_state.json of the wrong shape: refused by name, no internal error."""
    train(build_cfg(steps=4), out_dir=tmp_path, progress=False, until=2)
    step = load_run(tmp_path).path
    for bad in ({"python_rng": "x"}, {"format": 2}):
        state = {**json.loads((step / "trainer_state.json").read_text()), **bad}
        (step / "trainer_state.json").write_text(json.dumps(state))
        manifest = json.loads((step / "manifest.json").read_text())
        manifest["files"]["trainer_state.json"] = {"bytes": (step / "trainer_state.json").stat().st_size,
                                                   "sha256": ckpt_mod.sha256_file(step / "trainer_state.json")}
        (step / "manifest.json").write_text(json.dumps(manifest))
        capsys.readouterr()
        assert main(["train", "--out", str(tmp_path), "--resume", "--no-progress"]) == 1
        err = " ".join(capsys.readouterr().err.split())
        assert ("does not fit this run" if "python_rng" in bad else "is not a sinklens trainer state") in err, err
        assert "internal error" not in err and load_run(tmp_path).step == 2


def test_a_pointer_out_of_the_run_is_never_followed(tmp_path):
    train(build_cfg(steps=4, checkpoint_interval=2), out_dir=tmp_path / "a", progress=False)
    train(build_cfg(steps=2, seed=1), out_dir=tmp_path / "b", progress=False)
    pointer, own = tmp_path / "a" / "checkpoint.json", tmp_path / "a" / "checkpoints" / "step-000004"
    (tmp_path / "a" / "checkpoints" / "step-000006").symlink_to(tmp_path / "b" / "checkpoints" / "step-000002")
    for step, target in ((4, "../b/checkpoints/step-000002"), (4, str(tmp_path / "b" / "checkpoints" / "step-000002")),
                         (6, "checkpoints/step-000006")):
        pointer.write_text(json.dumps({"format": 2, "step": step, "dir": target}))
        with pytest.warns(UserWarning, match="names a folder other than its step's checkpoints/step-N"):
            assert load_run(tmp_path / "a").path == own  # the run's own newest checkpoint, never b's
    shutil.rmtree(own.parent)  # no checkpoint of its own left
    pointer.write_text(json.dumps({"format": 2, "step": 2, "dir": "../b/checkpoints/step-000002"}))
    with pytest.raises(CorruptFileError, match="checkpoint.json is unreadable or names a folder other than"):
        load_run(tmp_path / "a")


def test_a_full_disk_while_checkpointing_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    import errno

    import safetensors.torch
    from safetensors import SafetensorError

    cfg = build_cfg(steps=4, checkpoint_interval=2)
    full = train(cfg, out_dir=tmp_path / "full", progress=False)
    run = tmp_path / "run"
    train(cfg, out_dir=run, progress=False, until=2)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def serializer_no_space(*args, **kwargs):  # how safetensors reports it
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                              '"No space left on device" })')

    for module, name, fn in ((safetensors.torch, "save_model", serializer_no_space), (ckpt_mod, "write_json", no_space)):
        with monkeypatch.context() as m:
            m.setattr(module, name, fn)
            assert main(["train", "--out", str(run), "--resume", "--no-progress"]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "Could not write the checkpoint of step 4" in err and "No space left on device" in err, err
        assert "its checkpoint of step 2 is kept" in err and "internal error" not in err, err
        assert load_run(run).step == 2 and not list((run / "checkpoints").glob(".tmp-*"))
    resumed = train(cfg, out_dir=run, resume=True, progress=False)  # space again: the run goes on exactly
    assert resumed.losses() == pytest.approx(full.losses(), abs=1e-6)


def test_unfinished_and_missing_runs_give_named_errors(tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(_loop, "save_checkpoint", interrupted)  # killed before its first checkpoint
    with pytest.raises(KeyboardInterrupt):
        train(build_cfg(steps=2), out_dir=tmp_path / "run", progress=False)
    assert (tmp_path / "run" / "config.json").is_file()
    with pytest.raises(NotFoundError, match="has no checkpoint yet"):
        sinklens.load_model(tmp_path / "run", device="cpu")
    with pytest.raises(NotFoundError, match="holds no checkpoint to resume from"):
        train(build_cfg(steps=2), out_dir=tmp_path / "run", resume=True, progress=False)
    with pytest.raises(NotFoundError, match="not a sinklens run directory"):
        load_run(tmp_path / "nothing")


def test_a_metrics_line_cut_short_by_a_kill_neither_blocks_resume_nor_compare(tmp_path, capsys):
    """A process killed while appending to metrics.jsonl leaves a last line without its newline: resume
    and ``sinklens compare`` drop it with a warning, and the resumed run equals an uninterrupted one."""
    cfg = build_cfg(steps=6)
    full = train(cfg, out_dir=tmp_path / "full", progress=False)
    train(cfg, out_dir=tmp_path / "cut", progress=False, until=3)
    with open(tmp_path / "cut" / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 3, "loss": 5.2')  # the torn write of step 3's line
    with pytest.warns(RuntimeWarning, match="last line is cut short"):
        assert len(read_metrics(tmp_path / "cut")) == 3
    with pytest.warns(RuntimeWarning, match="last line is cut short"):
        resumed = train(cfg, out_dir=tmp_path / "cut", progress=False, resume=True)
    assert resumed.losses() == pytest.approx(full.losses(), abs=1e-6)
    lines = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [(line["kind"], line["step"]) for line in lines] == [
        ("train", 0), ("train", 1), ("train", 2), ("resume", 3), ("train", 3), ("train", 4), ("train", 5)]

    with open(tmp_path / "cut" / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "st')
    capsys.readouterr()
    with pytest.warns(RuntimeWarning, match="last line is cut short"):
        assert main(["compare", str(tmp_path / "cut"), "--out", str(tmp_path / "c.png")]) == 0
    assert "final loss" in capsys.readouterr().out


def test_a_damaged_metrics_file_and_a_missing_run_are_named_errors(tmp_path, capsys):
    train(build_cfg(steps=3), out_dir=tmp_path / "run", progress=False)
    path = tmp_path / "run" / "metrics.jsonl"
    rows = path.read_text().splitlines()
    path.write_text("\n".join([rows[0], rows[1][:20], rows[2]]) + "\n")  # damage inside, not a torn last line
    with pytest.raises(CorruptFileError, match="metrics.jsonl: line 2 is not JSON"):
        read_metrics(tmp_path / "run")
    path.write_text("[1, 2]\n")
    with pytest.raises(CorruptFileError, match="line 1 is not a JSON object"):
        read_metrics(tmp_path / "run")
    with pytest.raises(NotFoundError, match="has no metrics.jsonl"):
        read_metrics(tmp_path / "nothing")
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "nothing")]) == 2  # a wrong path is the user's mistake
    assert "has no metrics.jsonl" in capsys.readouterr().err


class _Payload:
    """Unpickling this creates ``path``: what a crafted ``trainer_state.pt`` could do (run any code)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_crafted_pickle_in_a_run_is_refused_never_unpickled(tmp_path, capsys):
    """Pickled trainer state (``trainer_state.pt`` / ``optimizer.pt``, with a manifest that matches them) is refused by
    ``train --resume`` and ``analyze --model RUN`` as a checkpoint without its safetensors state; never unpickled."""
    marker = tmp_path / "marker"
    train(build_cfg(steps=4), out_dir=tmp_path / "run", progress=False, until=2)
    step = load_run(tmp_path / "run").path
    files = {}
    for name in ("trainer_state.json", "trainer_state.safetensors"):
        (step / name).unlink()
    for name in ("trainer_state.pt", "optimizer.pt"):
        torch.save({"step": 2, "state": _Payload(marker)}, step / name)
    for name in ("config.json", "model.safetensors", "trainer_state.pt", "optimizer.pt"):
        files[name] = {"bytes": (step / name).stat().st_size, "sha256": ckpt_mod.sha256_file(step / name)}
    (step / "manifest.json").write_text(json.dumps({"format": 2, "step": 2, "files": files, "kept": False}))
    flat = tmp_path / "flat"  # the pickles beside the weights in the run folder itself, no checkpoints/
    flat.mkdir()
    for name in ("config.json", "model.safetensors", "trainer_state.pt", "optimizer.pt"):
        shutil.copy(step / name, flat / name)
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "run"), "--resume", "--no-progress"]) != 0
    err = " ".join(capsys.readouterr().err.split())
    assert "No good checkpoint" in err and "trainer_state.json" in err and "Traceback" not in err
    for run, error, what in ((tmp_path / "run", CorruptFileError, "No good checkpoint"),
                             (flat, NotFoundError, "has no checkpoint yet")):
        assert main(["analyze", "--model", str(run), "--text", "a b", "--out", str(tmp_path / "report")]) != 0
        err = " ".join(capsys.readouterr().err.split())
        assert what in err and "Traceback" not in err
        with pytest.raises(error, match=what):
            sinklens.load_model(run, device="cpu")
    assert not marker.exists()


# ------------------------------------------------------------------ divergence


def _explode_at(step_to_break: int):
    """A training-time intervention that makes the loss NaN from the ``step_to_break``-th forward on."""
    calls = {"n": 0}

    def factory(model):
        def fn(resid, hook):
            calls["n"] += 1
            return resid * float("nan") if calls["n"] > step_to_break else resid

        return [("blocks.0.hook_resid_post", fn)]

    return factory


def test_a_diverging_run_stops_keeps_its_last_finite_checkpoint_and_writes_strict_json(tmp_path):
    cfg = build_cfg(steps=10, checkpoint_interval=2)
    with pytest.raises(TrainingDivergedError, match=r"Training diverged at step 5: loss nan.*last finite checkpoint \(step 4\)"):
        train(cfg, out_dir=tmp_path, interventions=[_explode_at(5)], progress=False)
    got = load_run(tmp_path)
    assert got.step == 4  # the checkpoint written before the NaN step, still current
    model = load_trained_model(tmp_path)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    lines = [json.loads(line) for line in text.splitlines()]  # json.loads accepts NaN: check the text above
    assert [x["step"] for x in lines if x["kind"] == "train"] == [0, 1, 2, 3, 4]
    assert lines[-1] == {"kind": "nonfinite", "step": 5, "loss": None, "grad_norm": None, "lr": pytest.approx(lines[-1]["lr"]),
                         "action": "stop"}


def test_skip_mode_drops_nonfinite_steps_then_gives_up(tmp_path):
    calls = {"n": 0}

    def flaky(model):  # NaN at the 3rd forward only
        def fn(resid, hook):
            calls["n"] += 1
            return resid * float("nan") if calls["n"] == 3 else resid

        return [("blocks.0.hook_resid_post", fn)]

    with pytest.warns(UserWarning, match="Step 2: non-finite"):
        result = train(build_cfg(steps=5, on_nonfinite="skip"), interventions=[flaky], progress=False)
    assert [x["step"] for x in result.history if x["kind"] == "train"] == [0, 1, 3, 4]
    assert all(torch.isfinite(p).all() for p in result.model.parameters())
    with pytest.warns(UserWarning), pytest.raises(TrainingDivergedError, match="after max_skips=2 skipped steps in a row"):
        train(build_cfg(steps=8, on_nonfinite="skip", max_skips=2), interventions=[_explode_at(2)], progress=False)


def test_cli_exits_nonzero_on_divergence(tmp_path, capsys):
    code = main(["train", "--preset", "tiny", "--set", "model.d_model=16", "--set", "model.n_ctx=16", "--set",
                 "model.d_vocab=24", "--set", "data.vocab_size=24", "--seq-len", "16", "--batch-size", "8", "--device",
                 "cpu", "--no-progress", "--set", "eval.interval=0", "--steps", "3", "--lr", "1e30",
                 "--set", "optim.warmup_steps=0", "--set", "optim.grad_clip=0", "--out", str(tmp_path)])
    assert code == 1  # a failure of the work, not of the command line (sinklens.errors.exit_code_for)
    assert "Training diverged at step" in capsys.readouterr().err


def _checkpoint_steps(run_dir) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))


def test_a_diverging_run_without_checkpoints_checkpoints_its_finite_weights(tmp_path):
    """checkpoint_interval=0 (the default) wrote no checkpoint before the NaN, and the error said one was kept:
    the run was lost. Now its finite weights after the steps done are saved and say so."""
    with pytest.raises(TrainingDivergedError, match="it had no checkpoint, so its finite weights after step 5 are checkpointed"):
        train(build_cfg(steps=10), out_dir=tmp_path, interventions=[_explode_at(5)], progress=False)
    assert load_run(tmp_path).step == 5 and _checkpoint_steps(tmp_path) == [5]
    assert all(torch.isfinite(p).all() for p in load_trained_model(tmp_path).parameters())
    uninterrupted = train(build_cfg(steps=10), until=5, progress=False).model  # the same 5 steps, never diverged
    saved = load_trained_model(tmp_path).state_dict()
    assert all(torch.equal(saved[k], v) for k, v in uninterrupted.state_dict().items())


def test_a_resume_with_nothing_left_to_train_is_refused_and_touches_nothing(tmp_path):
    """``--resume --steps 20`` on a run at step 30 used to save the step-30 weights as step-20's checkpoint
    (deleting the real one) and then prune step 30."""
    train(build_cfg(steps=6, checkpoint_interval=2, keep_every=1), out_dir=tmp_path, progress=False)
    before = _snapshot(tmp_path)
    for steps in (4, 6):
        with pytest.raises(ValueError, match=f"is at step 6 already; steps={steps} leave nothing to train"):
            train(build_cfg(steps=steps, checkpoint_interval=2, keep_every=1), out_dir=tmp_path, resume=True, progress=False)
    assert _snapshot(tmp_path) == before


def test_a_skipped_step_still_gets_its_periodic_checkpoint(tmp_path):
    calls = {"n": 0}

    def flaky(model):  # NaN in step 1's forward only
        def fn(resid, hook):
            calls["n"] += 1
            return resid * float("nan") if calls["n"] == 2 else resid

        return [("blocks.0.hook_resid_post", fn)]

    with pytest.warns(UserWarning, match="Step 1: non-finite"):
        train(build_cfg(steps=8, checkpoint_interval=2, keep_every=1, on_nonfinite="skip"), out_dir=tmp_path,
              interventions=[flaky], progress=False)
    assert _checkpoint_steps(tmp_path) == [2, 4, 6, 8]  # step 2's was skipped with the step before it


def test_a_resume_that_changes_the_checkpoint_interval_keeps_the_earlier_keepers(tmp_path):
    train(build_cfg(steps=4, checkpoint_interval=1, keep_every=2), out_dir=tmp_path, progress=False)
    assert _checkpoint_steps(tmp_path) == [2, 3, 4]  # keepers 2, 4; 3 the newest before the last
    train(build_cfg(steps=9, checkpoint_interval=3, keep_every=2), out_dir=tmp_path, resume=True, progress=False)
    assert _checkpoint_steps(tmp_path) == [2, 4, 6, 9]  # 2 and 4 were keepers when written; 6 is one now


def test_an_intervention_that_cannot_run_on_the_runs_sequences_is_refused_before_the_run_is_written(tmp_path):
    """A position inside the context but past the persistence sequences (or the training sequences) used to fail
    at the first evaluation, after config.json was written (and after --overwrite had cleared the old run)."""
    train(build_cfg(steps=2), out_dir=tmp_path, progress=False)
    before = _snapshot(tmp_path)
    persistence = {"eval": {"interval": 1, "persistence_sequences": 2, "persistence_seq_len": 8}}
    # (a position past the persistence probe's sequences only: test_run_folder.py, the probe runs without it)
    with pytest.raises(ValueError, match=r"run's 10-token training sequences \(data.seq_len=10\): Position 12"):
        train(build_cfg(steps=2, data={"seq_len": 10}), out_dir=tmp_path, overwrite=True,
              interventions=["restart:positions=12"], progress=False)
    assert _snapshot(tmp_path) == before
    train(build_cfg(steps=2, **persistence), out_dir=tmp_path / "ok", interventions=["restart:positions=6"], progress=False)


class _InfGradient(torch.autograd.Function):
    """Identity forward; an inf gradient backward (an overflow in float16's scaled backward)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def _with_a_loss_scaler(monkeypatch) -> list:
    """Train on the CPU as float16 on CUDA would: under a ``GradScaler`` (no autocast); returns the scalers made."""
    from sinklens.train import loop
    from sinklens.train.precision import MixedPrecision

    made = []

    def fake(cfg, device):
        made.append(torch.amp.GradScaler("cpu", init_scale=2.0**8))
        return MixedPrecision(contextlib.nullcontext(), "float16", made[-1])

    monkeypatch.setattr(loop, "mixed_precision", fake)
    return made


def test_under_a_loss_scaler_a_nonfinite_loss_still_stops_the_run(tmp_path, monkeypatch):
    """The float16 path crashed at its first step (the loss was multiplied by ``get_scale()`` by hand, so
    ``unscale_`` found no scale: "Attempted unscale_ but _scale is None"), and it skipped the check
    altogether: a NaN loss would have run to the end with exit 0 while the scaler skipped every update."""
    _with_a_loss_scaler(monkeypatch)
    with pytest.raises(TrainingDivergedError, match=r"Training diverged at step 5: loss nan.*last finite checkpoint \(step 4\)"):
        train(build_cfg(steps=10, checkpoint_interval=2), out_dir=tmp_path, interventions=[_explode_at(5)], progress=False)
    assert load_run(tmp_path).step == 4


def test_under_a_loss_scaler_an_inf_gradient_is_the_scalers_to_skip(monkeypatch):
    scalers = _with_a_loss_scaler(monkeypatch)
    calls = {"n": 0}

    def overflow_once(model):  # an inf gradient in step 2's backward only; every loss stays finite
        def fn(resid, hook):
            calls["n"] += 1
            return _InfGradient.apply(resid) if calls["n"] == 3 else resid

        return [("blocks.0.hook_resid_post", fn)]

    result = train(build_cfg(steps=5), interventions=[overflow_once], progress=False)
    assert [x["step"] for x in result.history if x["kind"] == "train"] == [0, 1, 2, 3, 4]  # no step dropped by sinklens
    assert not any(x["kind"] == "nonfinite" for x in result.history)
    assert scalers[0].get_scale() == 2.0**7  # the scaler skipped step 2's update and halved its scale once
    assert all(torch.isfinite(p).all() for p in result.model.parameters())
