"""More never-lose-a-run checks: data fingerprints on resume, foreign folders, the run lock, non-finite weights,
an overwrite that fails, the tokenizer's atomic save, file modes, metrics line shapes, keep_every."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from _train_cfg import build_cfg

import sinklens.sinklm.checkpoint as ckpt_mod
from sinklens.errors import CorruptFileError, InvalidArgumentError, OutputExistsError, TrainingDivergedError
from sinklens.export import write_text_atomic
from sinklens.train import loop as _loop
import sinklens.sinklm.run_folder as run_folder
from sinklens.sinklm.checkpoint import load_run, load_trained_model, read_metrics, save_checkpoint
from sinklens.sinklm.run_folder import RunLock, tokenizer_problem
from sinklens.train.loop import train

pytestmark = pytest.mark.models


def _snapshot(run_dir):
    return {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _corpus(path, words, seed):
    rng = random.Random(seed)
    path.write_text(" ".join(rng.choice(words) for _ in range(3000)))


def _text_cfg(tmp_path, **extra):
    data = {"source": "text", "path": str(tmp_path / "corpus.txt"), "tokenizer": "bpe", "vocab_size": 300,
            "cache_dir": str(tmp_path / "cache")}
    return build_cfg(**{"steps": 2, "model": {"d_vocab": "auto"}, "data": data, **extra})


# ------------------------------------------------------------------ 1. data fingerprint


def test_resume_refuses_text_data_rewritten_in_place_and_old_runs_still_resume(tmp_path):
    _corpus(tmp_path / "corpus.txt", ["alpha", "beta", "gamma", "delta", "sink", "token"], 0)
    run = tmp_path / "run"
    train(_text_cfg(tmp_path), out_dir=run, progress=False)
    assert json.loads((run / "data_fingerprint.json").read_text())["tokenizer"]
    _corpus(tmp_path / "corpus.txt", ["zebra", "quux", "foo", "bar", "lorem", "ipsum", "xylophone"], 1)
    before = _snapshot(run)
    with pytest.raises(InvalidArgumentError, match=r"its data changed since the run started \(the tokenizer .* now but "
                                                  r".* in the run; the train token stream"):
        train(_text_cfg(tmp_path, steps=4), out_dir=run, resume=True, progress=False)
    assert _snapshot(run) == before
    # a run without a stored fingerprint resumes and is checked from then on
    _corpus(tmp_path / "corpus.txt", ["alpha", "beta", "gamma", "delta", "sink", "token"], 0)  # the run's data again
    (run / "data_fingerprint.json").unlink()
    train(_text_cfg(tmp_path, steps=3), out_dir=run, resume=True, progress=False)
    assert (run / "data_fingerprint.json").is_file()
    train(_text_cfg(tmp_path, steps=4), out_dir=run, resume=True, progress=False)  # same data: resumes
    assert load_run(run).step == 4


def test_resume_refuses_a_memmap_rewritten_with_the_same_size(tmp_path):
    ids = np.random.default_rng(0).integers(0, 24, size=4000).astype(np.uint16)
    ids.tofile(tmp_path / "train.bin")
    cfg = build_cfg(steps=2, data={"source": "memmap", "path": str(tmp_path / "train.bin")})
    train(cfg, out_dir=tmp_path / "run", progress=False)
    ids[2000] = (int(ids[2000]) + 1) % 24  # one token in the middle
    ids.tofile(tmp_path / "train.bin")
    with pytest.raises(InvalidArgumentError, match="the train token stream is 3600 tokens"):
        train(cfg.replace(steps=4), out_dir=tmp_path / "run", resume=True, progress=False)


# ------------------------------------------------------------------ 2. foreign folders


def _hf_folder(path):
    (path / "tokenizer").mkdir(parents=True)
    (path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}')
    (path / "model.safetensors").write_text("weights")
    (path / "tokenizer" / "tokenizer.json").write_text("tok")


def test_a_folder_holding_another_tools_files_is_refused_with_or_without_overwrite(tmp_path):
    _hf_folder(tmp_path)
    before = _snapshot(tmp_path)
    for overwrite in (False, True):
        with pytest.raises(OutputExistsError, match=r"is not a sinklens training run but holds config.json, tokenizer, "
                                                    r"model.safetensors"):
            train(build_cfg(steps=2), out_dir=tmp_path, overwrite=overwrite, progress=False)
    assert _snapshot(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors", "tokenizer"]


def test_overwrite_deletes_only_the_runs_own_files(tmp_path):
    train(build_cfg(steps=2), out_dir=tmp_path, progress=False)
    (tmp_path / "checkpoints" / "notes.txt").write_text("mine")
    (tmp_path / "checkpoints" / "analysis").mkdir()
    (tmp_path / "checkpoints" / "analysis" / "report.json").write_text("{}")
    (tmp_path / "README.md").write_text("mine")
    train(build_cfg(steps=3), out_dir=tmp_path, overwrite=True, progress=False)
    assert (tmp_path / "checkpoints" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "checkpoints" / "analysis" / "report.json").is_file()
    assert (tmp_path / "README.md").is_file() and load_run(tmp_path).step == 3


# ------------------------------------------------------------------ 3. the run lock


def test_a_run_directory_being_trained_is_refused_to_a_second_trainer(tmp_path):
    run = tmp_path / "run"
    train(build_cfg(steps=2), out_dir=run, progress=False)
    before = _snapshot(run)
    with RunLock(run):  # another trainer holds it (flock conflicts between two open files, in one process too)
        for kwargs in ({"resume": True}, {"overwrite": True}, {}):
            with pytest.raises(OutputExistsError, match=rf"is being trained by another process \(pid {os.getpid()}\)"):
                train(build_cfg(steps=4), out_dir=run, progress=False, **kwargs)
    assert _snapshot(run) == before and not (run / ".lock").exists()
    with RunLock(tmp_path / "new"):  # a fresh folder: the lock creates it ...
        with pytest.raises(OutputExistsError):
            train(build_cfg(steps=2), out_dir=tmp_path / "new", progress=False)
    assert not (tmp_path / "new").exists()  # ... and removes it again when nothing else was written
    train(build_cfg(steps=4), out_dir=run, resume=True, progress=False)  # released: goes on
    assert not (run / ".lock").exists()


def test_the_lock_is_held_while_training(tmp_path, monkeypatch):
    seen = []
    real = ckpt_mod.save_checkpoint

    def checking(run_dir, **kwargs):
        with pytest.raises(OutputExistsError):
            RunLock(run_dir).__enter__()
        seen.append(kwargs["step"])
        return real(run_dir, **kwargs)

    monkeypatch.setattr(_loop, "save_checkpoint", checking)
    train(build_cfg(steps=2), out_dir=tmp_path, progress=False)
    assert seen == [2]


def test_only_rank_0_of_a_distributed_run_takes_the_lock(monkeypatch):
    from sinklens.distributed import writes_outputs

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert not writes_outputs()
    monkeypatch.setenv("RANK", "0")
    assert writes_outputs()


# ------------------------------------------------------------------ 4. non-finite weights


def _nan_weights_after_update(monkeypatch, n):
    real = torch.optim.AdamW.step
    calls = {"n": 0}

    def step(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == n:  # a finite loss and gradient, but the update leaves NaN weights
            with torch.no_grad():
                self.param_groups[0]["params"][0].fill_(float("nan"))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", step)


def test_nonfinite_weights_are_never_checkpointed(tmp_path, monkeypatch):
    _nan_weights_after_update(monkeypatch, 5)  # the update of step 4 (0-based)
    cfg = build_cfg(steps=20, checkpoint_interval=2, on_nonfinite="skip", max_skips=8)
    with pytest.raises(TrainingDivergedError, match=r"the weights after step 6 are not finite \(1 of \d+ parameter tensors"
                                                   r".*its last finite checkpoint \(step 4\).* is kept"):
        train(cfg, out_dir=tmp_path, progress=False)
    assert load_run(tmp_path).step == 4
    steps = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert steps == ["step-000002", "step-000004"]
    from safetensors.torch import load_file

    for name in steps:
        weights = load_file(str(tmp_path / "checkpoints" / name / "model.safetensors"))
        assert all(bool(torch.isfinite(v).all()) for v in weights.values()), name
    last = read_metrics(tmp_path)[-1]
    assert last["kind"] == "nonfinite" and last["action"] == "stop" and "weights" in last


def test_a_diverging_run_with_nonfinite_weights_does_not_claim_to_checkpoint_them(tmp_path, monkeypatch):
    _nan_weights_after_update(monkeypatch, 1)  # step 0's update breaks the weights; step 1's loss is NaN
    with pytest.raises(TrainingDivergedError, match=r"at step 1.*its weights after step 1 are not finite .* so none was "
                                                   r"written"):
        train(build_cfg(steps=5), out_dir=tmp_path, progress=False)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "checkpoint.json").exists()


# ------------------------------------------------------------------ 5. overwrite that fails


def test_an_overwrite_that_fails_before_its_first_checkpoint_restores_the_old_run(tmp_path, monkeypatch):
    train(build_cfg(steps=3), out_dir=tmp_path, progress=False)
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "training.png").write_bytes(b"old figure")
    before = _snapshot(tmp_path)

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    with monkeypatch.context() as patch:
        patch.setattr(_loop, "forward_backward", oom)
        with pytest.raises(torch.OutOfMemoryError):
            train(build_cfg(steps=5, seed=3), out_dir=tmp_path, overwrite=True, progress=False)
    assert _snapshot(tmp_path) == before
    assert not list(tmp_path.glob(".overwritten-*"))

    train(build_cfg(steps=4, seed=3), out_dir=tmp_path, overwrite=True, progress=False)
    assert load_run(tmp_path).step == 4 and load_run(tmp_path).config.seed == 3
    assert not (tmp_path / "figures" / "training.png").exists()  # the old run's figure went with it
    assert not list(tmp_path.glob(".overwritten-*"))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000004"]


def test_an_overwrite_killed_before_its_first_checkpoint_is_undone_at_the_next_start(tmp_path):
    """A SIGKILL (the OOM killer) between setting the old run aside and the new run's first checkpoint left the
    old run hidden in .overwritten-*: every later command said the folder held no checkpoint, and the --overwrite
    they advised deleted it. The next start now puts it back first."""
    train(build_cfg(steps=3), out_dir=tmp_path, progress=False)
    before = _snapshot(tmp_path)
    aside = run_folder.set_aside_run(tmp_path)  # what the killed overwrite had done ...
    write_text_atomic(tmp_path / "config.json", json.dumps(build_cfg(steps=9, seed=5).to_dict()))  # ... and written
    assert aside is not None and not ckpt_mod.has_checkpoint(tmp_path)
    with pytest.warns(UserWarning, match="was killed before its first checkpoint: the run it was replacing"):
        with pytest.raises(OutputExistsError):  # the old run is back, and a plain run does not replace it
            train(build_cfg(steps=3), out_dir=tmp_path, progress=False)
    assert _snapshot(tmp_path) == before and not list(tmp_path.glob(".overwritten-*"))
    assert load_run(tmp_path).step == 3


def test_a_resume_after_a_killed_overwrite_continues_the_old_run_with_its_own_config(tmp_path):
    """``--resume`` read the killed replacement's config.json before train() put the old run back: the old run
    went on with the replacement's lr and steps (or was refused over a model nobody asked for)."""
    from sinklens.sinklm.run_folder import resume_config

    train(build_cfg(steps=3), out_dir=tmp_path, progress=False)
    own = ckpt_mod.load_train_config(tmp_path)
    run_folder.set_aside_run(tmp_path)  # the killed overwrite: old run aside, its own config.json written
    killed = build_cfg(steps=9, optim={"lr": 3e-4})
    write_text_atomic(tmp_path / "config.json", json.dumps(killed.to_dict()))
    assert resume_config(tmp_path) == own  # the run that comes back, not the killed one
    assert ckpt_mod.load_train_config(tmp_path) == killed  # (what the folder holds until the next start)
    done = subprocess.run([sys.executable, "-m", "sinklens.cli", "train", "--out", str(tmp_path), "--resume", "--steps", "5",
                           "--no-progress"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "is put back" in done.stderr and "resumed at step 3 with steps 3 -> 5" in done.stdout
    assert ckpt_mod.load_train_config(tmp_path) == own.replace(steps=5)
    (line,) = [m for m in read_metrics(tmp_path) if m.get("kind") == "resume"]
    assert line["changes"] == {"steps": [3, 5]}


def test_an_overwrite_that_diverges_after_saving_its_weights_keeps_the_old_run_aside(tmp_path):
    """A replacement that diverges saves its finite weights (so that it is never lost); that salvage checkpoint
    used to delete the run it replaced. The old run now stays set aside, named, until a regular checkpoint."""
    train(build_cfg(steps=3), out_dir=tmp_path, progress=False)
    old = load_trained_model(tmp_path).state_dict()
    wild = build_cfg(steps=6, seed=5, optim={"lr": 1e30, "warmup_steps": 0, "grad_clip": 0.0})
    with pytest.warns(UserWarning, match="The run this overwrite replaced is kept in"):
        with pytest.raises(TrainingDivergedError):
            train(wild, out_dir=tmp_path, overwrite=True, progress=False)
    (aside,) = tmp_path.glob(".overwritten-*")
    kept = load_trained_model(aside).state_dict()
    assert all(torch.equal(kept[k], old[k]) for k in old)  # the old run, whole, in the set-aside folder
    with pytest.warns(UserWarning, match="still holds the run an earlier overwrite replaced"):
        train(build_cfg(steps=4, seed=5), out_dir=tmp_path, overwrite=True, progress=False)
    assert not list(tmp_path.glob(".overwritten-*"))  # a regular checkpoint: now it goes


# ------------------------------------------------------------------ 6. the tokenizer


def _vocab_matches(run):
    model = load_trained_model(run)
    return len(model.tokenizer) == model.train_config.model.d_vocab


def test_a_kill_while_saving_the_tokenizer_never_leaves_a_broken_one(tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    _corpus(tmp_path / "corpus.txt", ["alpha", "beta", "gamma", "delta"], 0)
    cfg = _text_cfg(tmp_path, steps=4, checkpoint_interval=2)
    run = tmp_path / "run"
    real = PreTrainedTokenizerFast.save_pretrained

    def dying(self, path, *args, **kwargs):
        if str(path).startswith(str(run)):
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, "tokenizer.json"), "w") as handle:
                handle.write('{"version": "1.0", "trunc')
            raise KeyboardInterrupt  # the process dies here
        return real(self, path, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(PreTrainedTokenizerFast, "save_pretrained", dying)
        with pytest.raises(KeyboardInterrupt):
            train(cfg, out_dir=run, progress=False)
    assert not (run / "tokenizer").exists()  # never a half-written one in place
    train(cfg, out_dir=run, resume=True, progress=False)
    assert tokenizer_problem(run) is None and _vocab_matches(run)


def test_a_resume_rewrites_a_broken_tokenizer(tmp_path):
    _corpus(tmp_path / "corpus.txt", ["alpha", "beta", "gamma", "delta"], 0)
    run = tmp_path / "run"
    train(_text_cfg(tmp_path), out_dir=run, progress=False)
    (run / "tokenizer" / "tokenizer.json").write_text('{"version": "1.0", "trunc')  # left by an older sinklens
    assert tokenizer_problem(run) is not None
    with pytest.warns(UserWarning, match="does not load"):
        train(_text_cfg(tmp_path, steps=3), out_dir=run, resume=True, progress=False)
    assert tokenizer_problem(run) is None and _vocab_matches(run)


# ------------------------------------------------------------------ 7. file modes


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_written_files_get_the_mode_open_would_give_them(tmp_path, mask):
    old = os.umask(mask)
    try:
        path = write_text_atomic(tmp_path / "a.json", "{}\n")
        cfg = build_cfg(steps=1)
        from sinklens.sinklm.model import SinkLM

        final = save_checkpoint(tmp_path / "run", model=SinkLM(cfg.model), optimizer=None, cfg=cfg, step=1)
    finally:
        os.umask(old)
    expected = 0o666 & ~mask
    assert path.stat().st_mode & 0o777 == expected
    for name in ("model.safetensors", "manifest.json", "config.json"):
        assert (final / name).stat().st_mode & 0o777 == expected, name
    assert (tmp_path / "run" / "checkpoint.json").stat().st_mode & 0o777 == expected


# ------------------------------------------------------------------ 8. metrics lines of the wrong shape


@pytest.mark.parametrize("bad, what", [('{"note": 1}', 'no string "kind"'), ('{"kind": "train", "step": null}', 'no whole'),
                                       ('{"kind": 3, "step": 1}', 'no string "kind"'),
                                       ('{"kind": "train", "step": 1.5}', "no whole"),
                                       ('{"kind": "train", "step": true}', "no whole")])
def test_a_metrics_line_of_the_wrong_shape_is_a_named_error(tmp_path, bad, what, capsys):
    from sinklens.cli import main

    train(build_cfg(steps=3), out_dir=tmp_path, progress=False)
    path = tmp_path / "metrics.jsonl"
    rows = path.read_text().splitlines()
    path.write_text("\n".join([rows[0], bad, rows[2]]) + "\n")
    with pytest.raises(CorruptFileError, match=f"metrics.jsonl: line 2 has {what}"):
        read_metrics(tmp_path)
    capsys.readouterr()
    for argv in (["compare", str(tmp_path)], ["train", "--out", str(tmp_path), "--resume", "--steps", "5", "--no-progress"]):
        assert main(argv) in (1, 2), argv
        err = capsys.readouterr().err
        assert "line 2 has" in err and "internal error" not in err, argv


# ------------------------------------------------------------------ 9. keep_every without checkpoints


def test_keep_every_without_a_checkpoint_interval_is_warned_about(tmp_path):
    with pytest.warns(UserWarning, match=r"keep_every=2 .* checkpoint_interval=0 writes none"):
        train(build_cfg(steps=2, keep_every=2), out_dir=tmp_path, progress=False)


def test_an_unlocked_existing_run_still_gives_run_exists(tmp_path):
    train(build_cfg(steps=2), out_dir=tmp_path, progress=False)
    with pytest.raises(OutputExistsError, match="already holds a training run"):
        train(build_cfg(steps=2), out_dir=tmp_path, progress=False)
    assert not (tmp_path / ".lock").exists()


# ------------------------------------------------------------------ 10. interventions and the persistence probe


def test_an_intervention_valid_for_the_training_sequences_is_accepted_and_persistence_runs_without_it(tmp_path):
    persistence = {"eval": {"interval": 1, "persistence_sequences": 2, "persistence_seq_len": 8}}
    cfg = build_cfg(steps=2, **persistence)
    with pytest.warns(UserWarning, match=r"persistence probe's 8-token sequences \(eval.persistence_seq_len=8\): "
                                         r"Position 12 is out of range.*measured without them"):
        result = train(cfg, out_dir=tmp_path / "run", interventions=["restart:positions=12"], progress=False)
    evals = result.evals()
    assert len(evals) == 3 and evals[0]["persistence_spearman"] == pytest.approx(1.0)
    assert all(isinstance(line["persistence_spearman"], float) for line in evals)
    # a resume makes the same choice, so the reference and later measures stay comparable
    with pytest.warns(UserWarning, match="measured without them"):
        again = train(cfg.replace(steps=3), out_dir=tmp_path / "run", resume=True,
                      interventions=["restart:positions=12"], progress=False)
    assert again.evals()[-1]["step"] == 3
    with pytest.raises(ValueError, match=r"run's 10-token training sequences \(data.seq_len=10\): Position 12"):
        train(build_cfg(steps=2, data={"seq_len": 10}, **persistence), out_dir=tmp_path / "bad",
              interventions=["restart:positions=12"], progress=False)
