"""Checkpoints: exact resume, and trained models load back for analysis (token ids and strings)."""

from __future__ import annotations

import pytest
import torch
from _train_cfg import build_cfg

from sinklens.analysis.attention import AttentionReceivedReducer
from sinklens.errors import NotFoundError
from sinklens.inputs import tokenize_prompts
from sinklens.options import RunOptions
from sinklens.streaming import stream
from sinklens.sinklm.checkpoint import load_trained_model
from sinklens.train.loop import eval_batches, train
from sinklens.train.data import build_source

pytestmark = pytest.mark.models


def test_resume_reproduces_the_uninterrupted_curve(tmp_path):
    cfg = build_cfg(steps=8, eval={"interval": 4}, model={"dropout": 0.1})  # dropout: the RNG state must resume too
    full = train(cfg, out_dir=tmp_path / "full", progress=False)
    first = train(cfg, out_dir=tmp_path / "cut", progress=False, until=4)
    assert len(first.losses()) == 4
    resumed = train(cfg, out_dir=tmp_path / "cut", progress=False, resume=True)
    assert resumed.losses() == pytest.approx(full.losses(), abs=1e-6)  # history re-read from metrics.jsonl
    assert [e["val_loss"] for e in resumed.evals()] == pytest.approx([e["val_loss"] for e in full.evals()], abs=1e-6)
    for p, q in zip(full.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


def test_trained_model_loads_and_streams(tmp_path):
    cfg = build_cfg(steps=3)
    result = train(cfg, out_dir=tmp_path, progress=False)
    model = load_trained_model(tmp_path)
    assert not model.training and model.tokenizer is None and model.train_config == cfg
    batches, _ = eval_batches(build_source(cfg.data), cfg, torch.device("cpu"))
    with torch.no_grad():
        torch.testing.assert_close(model(batches[0].tokens), result.model.eval()(batches[0].tokens))
    (received,) = stream(model, batches, [AttentionReceivedReducer(model)], options=RunOptions(progress=False))
    assert received.received.shape == (2, 4, cfg.data.seq_len)
    assert torch.isfinite(received.received).all() and (received.received[:, :, 0] > 0).all()
    with pytest.raises(NotFoundError, match="not a sinklens run directory"):
        load_trained_model(tmp_path / "nothing")


def test_text_run_ships_its_tokenizer(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the sink is the first token. " * 200)
    cfg = build_cfg(steps=2, model={"d_vocab": 257}, data={"source": "text", "path": str(corpus), "cache_dir": str(tmp_path / "c")})
    train(cfg, out_dir=tmp_path / "run", progress=False)
    model = load_trained_model(tmp_path / "run")
    tok = model.tokenizer
    assert tok.bos_token_id == 256 and tok.pad_token_id == 256
    assert tok("sink", add_special_tokens=False)["input_ids"] == list(b"sink")
    (batch,) = tokenize_prompts(model, ["the sink is", "first"])
    assert batch.tokens[0, 0] == 256 and batch.tokens[0, 1:].tolist() == list(b"the sink is")
    assert model(batch.tokens).shape == (2, 12, 257)


def test_run_directory_loads_with_load_model_and_passes_through_analyze(tmp_path):
    import sinklens

    cfg = build_cfg(steps=3)
    trained = train(cfg, out_dir=tmp_path, progress=False).model
    model = sinklens.load_model(tmp_path, device="cpu")
    tokens = torch.randint(2, 24, (4, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), trained.to("cpu").eval()(tokens))
    report = sinklens.analyze(model, tokens, abs_threshold=None, rel_threshold=3.0,
                              options=RunOptions(batch_size=2, progress=False))
    assert report.n_sequences == 4 and report.n_tokens == 48
    assert report.sinks.received.shape == (2, 4, 12)
    assert torch.isfinite(report.variance.z_var).all()
