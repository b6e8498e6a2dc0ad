"""The training loop: it learns, data order is variant-independent, accumulation and interventions work."""

from __future__ import annotations

import json
import re

import pytest
import torch
from _train_cfg import build_cfg

import sinklens.train.loop as loop
from sinklens.errors import InvalidArgumentError
from sinklens.hooks import SCORES, hook_name
from sinklens.train.interventions import resolve_interventions
from sinklens.train.loop import train
from sinklens.train.optim import configure_optimizer

pytestmark = pytest.mark.models


def test_tiny_run_lowers_loss_and_logs(tmp_path):
    cfg = build_cfg(steps=30, eval={"interval": 15})
    result = train(cfg, out_dir=tmp_path, progress=False)
    losses = result.losses()
    assert len(losses) == 30
    # the backcopy task with peaked transitions is learnable far below the uniform loss ln(23)
    assert losses[0] > 3.0 and sum(losses[-5:]) / 5 < losses[0] - 0.5
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == result.history
    train_line = next(line for line in lines if line["kind"] == "train")
    assert set(train_line) >= {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"} and train_line["mfu"] is None
    evals = result.evals()
    assert [e["step"] for e in evals] == [0, 15, 30]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    for e in evals:
        assert 0 <= e["sink_rate"] <= 1 and 0 <= e["sinklens_sink_rate"] <= 1 and e["first_token_norm_ratio"] > 0 and e["variance_ratio"] > 0


def _record_batches(monkeypatch) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    original = loop.build_source

    def recording(*args, **kwargs):
        source = original(*args, **kwargs)
        batch = source.batch

        def record(split, step, n):
            rows = batch(split, step, n)
            if split == "train":
                seen.append(rows.clone())
            return rows

        source.batch = record
        return source

    monkeypatch.setattr(loop, "build_source", recording)
    return seen


def test_two_variants_see_identical_batches(monkeypatch):
    seen = _record_batches(monkeypatch)
    base = train(build_cfg(steps=4, seed=0), progress=False)
    n = len(seen)
    other = train(build_cfg(steps=4, seed=7, model={"variant": "headwise_rms"}), progress=False)
    assert n == 4 and len(seen) == 8
    assert all(torch.equal(a, b) for a, b in zip(seen[:4], seen[4:]))
    assert len({tuple(s.flatten().tolist()) for s in seen[:4]}) == 4  # but a new batch every step
    assert base.losses() != other.losses()


def test_grad_accumulation_matches_one_big_batch():
    one = train(build_cfg(steps=3), progress=False)
    acc = train(build_cfg(steps=3, grad_accum=4), progress=False)
    assert acc.losses() == pytest.approx(one.losses(), abs=1e-5)
    for (name, p), q in zip(one.model.named_parameters(), acc.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=name)


def test_interventions_are_applied_during_training():
    calls = {"n": 0}

    def counting(model):
        def fn(scores, hook):
            calls["n"] += 1
            return scores

        return [(hook_name(0, SCORES), fn)]

    train(build_cfg(steps=3), interventions=[counting], progress=False)
    assert calls["n"] == 3  # one forward per step

    plain = train(build_cfg(steps=4), progress=False).losses()
    by_name = train(build_cfg(steps=4, interventions=["restart:positions=8"]), progress=False)
    from sinklens.interventions.masks import restart

    by_callable = train(build_cfg(steps=4), interventions=[lambda m: restart(m, positions=8)], progress=False)
    assert by_name.losses() == by_callable.losses()  # the spec string resolves to masks.restart
    assert by_name.losses()[1:] != plain[1:]


def test_spec_interventions_passed_to_train_are_stored_and_a_resume_applies_them(tmp_path):
    """``train(cfg, interventions=["restart:..."])`` trained with the spec but left it out of config.json: a resume
    from the run's own config went on without it (losses off from step 6) and recorded no change."""
    from sinklens.sinklm.checkpoint import read_metrics
    from sinklens.sinklm.run_folder import resume_config

    spec = ["restart:positions=8"]
    whole = train(build_cfg(steps=8), out_dir=tmp_path / "whole", interventions=spec, progress=False)
    assert json.loads((tmp_path / "whole" / "config.json").read_text())["interventions"] == spec
    train(build_cfg(steps=8), out_dir=tmp_path / "cut", interventions=spec, until=4, progress=False)
    train(resume_config(tmp_path / "cut"), out_dir=tmp_path / "cut", resume=True, progress=False)
    resumed = [m["loss"] for m in read_metrics(tmp_path / "cut") if m["kind"] == "train"]
    assert resumed == whole.losses()
    assert train(build_cfg(steps=8), progress=False).losses()[5:] != resumed[5:]  # the spec matters after step 4
    with pytest.raises(InvalidArgumentError, match=r"intervention 'restart:positions=8' is given twice"):
        train(resume_config(tmp_path / "cut").replace(steps=10), out_dir=tmp_path / "cut", resume=True,
              interventions=spec, progress=False)


@pytest.mark.parametrize("until, words", [(-3, "until must be an integer >= 0, got -3"),
                                          (2.7, "until must be an integer, got 2.7"),
                                          ("5", "until must be an integer, got '5'")])
def test_until_is_checked_before_anything_runs(tmp_path, until, words):
    """``until=-3`` wrote a checkpoint ``step--00003`` that later refused the run; 2.7 was cut to 2."""
    import inspect

    with pytest.raises(InvalidArgumentError, match=re.escape(words)):
        inspect.unwrap(train)(build_cfg(steps=4), out_dir=tmp_path / "run", until=until, progress=False)
    assert not (tmp_path / "run").exists()


def test_resolve_interventions_errors(tmp_path):
    from sinklens.sinklm.model import SinkLM

    model = SinkLM(build_cfg().model)
    hooks = resolve_interventions(model, ["restart:positions=4,layers=[1]"])  # the one intervention registry
    assert [name for name, _ in hooks] == [hook_name(1, SCORES)]
    with pytest.raises(ValueError, match="Unknown intervention 'explode'"):
        resolve_interventions(model, ["explode:k=1"])
    with pytest.raises(ValueError, match="not of the form key=value"):
        resolve_interventions(model, ["restart:16"])


def test_vocab_and_batch_errors():
    with pytest.raises(ValueError, match="set model.d_vocab=40"):
        train(build_cfg(data={"vocab_size": 40}), progress=False)


def test_auto_vocab_is_resolved_once_from_the_data(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the sink is the first token. " * 200)
    built = []
    original = loop.build_source
    monkeypatch.setattr(loop, "build_source", lambda *a, **k: built.append(1) or original(*a, **k))
    cfg = build_cfg(steps=2, model={"d_vocab": "auto"},
                    data={"source": "text", "path": str(corpus), "cache_dir": str(tmp_path / "c"), "vocab_size": None})
    result = train(cfg, out_dir=tmp_path / "run", progress=False)
    assert len(built) == 1  # the data source (which may train a BPE) is built once
    assert result.model.cfg.d_vocab == 257  # 256 bytes + <|endoftext|>
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"]["d_vocab"] == 257
    with pytest.raises(ValueError, match="d_vocab='auto' must be resolved"):
        from sinklens.sinklm.model import SinkLM

        SinkLM(cfg.model)


def test_adamw_is_fused_on_the_cpu_by_default_and_trains_as_the_foreach_one_does():
    """``optim.fused=None`` takes the fused AdamW kernel on the CPU (one pass per parameter, about 10x faster a step
    at the authors' configuration); it is the same update as the multi-tensor one, to float32 rounding."""
    from sinklens.sinklm.config import OptimConfig
    from sinklens.sinklm.model import SinkLM

    cfg = build_cfg()
    for fused, want in ((None, True), (True, True), (False, None)):
        opt = configure_optimizer(SinkLM(cfg.model), OptimConfig(fused=fused), torch.device("cpu"))
        assert opt.defaults["fused"] is want and opt.defaults["foreach"] is (None if want else True)
    default = train(build_cfg(steps=20), progress=False)
    foreach = train(build_cfg(steps=20, optim={"fused": False}), progress=False)
    assert default.losses() == pytest.approx(foreach.losses(), rel=1e-5, abs=1e-6)
    for p, q in zip(default.model.parameters(), foreach.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
