"""``TrainConfig.log``: the metrics lines reach TensorBoard and Weights & Biases (offline), beside metrics.jsonl."""

from __future__ import annotations

import importlib.util
import json

import pytest
from _train_cfg import build_cfg

from sinklens.errors import InvalidArgumentError
from sinklens.sinklm.config import apply_overrides
from sinklens.train.loop import train


def _lines(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_gets_every_train_and_eval_number(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(build_cfg(steps=4, log="tensorboard", eval={"interval": 2}), out_dir=tmp_path / "run", progress=False)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    lines = _lines(tmp_path / "run")
    for kind, key in (("train", "loss"), ("train", "lr"), ("train", "grad_norm"), ("eval", "val_loss")):
        want = [(x["step"], x[key]) for x in lines if x["kind"] == kind]
        got = [(e.step, e.value) for e in events.Scalars(f"{kind}/{key}")]
        assert [s for s, _ in got] == [s for s, _ in want] and len(want) >= 2, (kind, key)
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)  # stored as float32
    assert "train/mfu" not in events.Tags()["scalars"]  # None on a CPU: not sent


def test_wandb_offline_run_gets_the_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sent = []
    real = wandb.sdk.wandb_run.Run.log
    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", lambda self, data, step=None, **kw: sent.append((step, data))
                        or real(self, data, step=step, **kw))
    train(build_cfg(steps=3, log="wandb", eval={"interval": 2}), out_dir=tmp_path / "run", progress=False)
    lines = _lines(tmp_path / "run")
    losses = [(x["step"], x["loss"]) for x in lines if x["kind"] == "train"]
    assert [(step, data["train/loss"]) for step, data in sent if "train/loss" in data] == losses
    assert [step for step, data in sent if "eval/val_loss" in data] == [0, 2, 3]
    assert len(list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))) == 1  # wandb's own record


def test_a_missing_library_is_a_named_error_before_anything_is_written(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(InvalidArgumentError, match=r"log='wandb' needs the wandb package.*pip install 'sinklens\[wandb\]'"):
        train(build_cfg(steps=2, log="wandb"), out_dir=tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
    with pytest.raises(InvalidArgumentError, match=r"log must be one of \['none', 'wandb', 'tensorboard'\], got 'mlflow'"):
        apply_overrides(build_cfg(), ["log=mlflow"])
