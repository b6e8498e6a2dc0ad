"""Behaviour the documentation promises.

* ``load_model(model, device=..., dtype=...)`` checks and applies both for an already-built model, and
  leaves the model alone when they are not given (docs/models.md);
* ``sinklens analyze --max-length L`` beyond the model's context is refused by name (exit code 2), as
  ``--seq-len`` is (docs/cli.md, "Shared flags and rules").
"""

from __future__ import annotations

import pytest
import torch

from sinklens import loading
from sinklens.errors import EXIT_USAGE, InvalidArgumentError
from support.zoo import zoo_model


def _dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def _sink_lm():
    from sinklens.sinklm.model import ModelConfig, SinkLM

    torch.manual_seed(0)
    return SinkLM(ModelConfig.from_preset("tiny", n_ctx=16, d_vocab=32))


@pytest.fixture
def built():
    """A fresh tiny TransformerLens model (TransformerBridge on 4.x, HookedTransformer on 3.x): tests cast it."""
    return zoo_model("llama")


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"device": "bogus"}, InvalidArgumentError, "Unknown device 'bogus'"),
        ({"dtype": "nonsense"}, InvalidArgumentError, "Unknown dtype 'nonsense'"),
        ({"dtype": "int64"}, InvalidArgumentError, "floating dtype"),
        ({"device": ""}, InvalidArgumentError, "device"),
    ],
)
def test_built_model_refuses_a_bad_device_or_dtype(built, kwargs, error, words):
    with pytest.raises(error, match=words):
        loading.load_model(built, **kwargs)
    assert _dtype(built) == torch.float32  # nothing was changed on the way to the error


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_built_model_refuses_a_device_this_machine_lacks(built):
    with pytest.raises(InvalidArgumentError, match="cuda"):
        loading.load_model(built, device="cuda")


@pytest.mark.parametrize("dtype", ["float16", torch.float64, "bf16"])
def test_built_model_is_cast_to_an_explicit_dtype(built, dtype, capsys):
    want = {"float16": torch.float16, "bf16": torch.bfloat16}.get(dtype, dtype)
    model = loading.load_model(built, dtype=dtype, device="cpu")  # check_patterns runs a forward in that dtype
    assert model is built  # moved in place, like nn.Module.to
    assert {p.dtype for p in model.parameters() if p.is_floating_point()} == {want}
    assert model.cfg.dtype == want  # TransformerLens' own .to keeps cfg in step
    assert next(model.parameters()).device.type == "cpu"
    assert "Changing model dtype" not in capsys.readouterr().out  # TransformerLens' print is silenced


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_built_model_keeps_its_own_dtype_by_default(built, dtype):
    built.to(dtype)
    assert loading.load_model(built) is built
    assert _dtype(built) == dtype  # no float32 default forced on a user's model
    assert _dtype(loading.load_model(built, device="cpu")) == dtype  # a device alone does not cast


def test_sinklens_model_is_cast_to_an_explicit_dtype():
    model = _sink_lm()
    assert _dtype(model) == torch.float32
    assert loading.load_model(model, dtype="float64", device="cpu") is model
    assert _dtype(model) == torch.float64
    assert model(torch.zeros((1, 3), dtype=torch.long)).dtype == torch.float64
    with pytest.raises(InvalidArgumentError, match="Unknown device"):
        loading.load_model(model, device="gpu0")


def test_analyze_refuses_a_max_length_beyond_the_context(tmp_path, monkeypatch, capsys):
    from sinklens.cli import main

    model = zoo_model("llama", n_ctx=32)
    monkeypatch.setattr(loading, "load_model", lambda *args, **kwargs: model)
    out = tmp_path / "report"
    code = main(["analyze", "--model", "zoo-llama", "--text", "t5 t6 t7 t8", "--max-length", "100",
                 "--out", str(out), "--no-figures"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE, err
    assert "--max-length 100 is longer than the model's context of 32 tokens" in err
    assert "Traceback" not in err
    assert not out.exists()  # no empty --out left behind
    # at the context itself it runs
    assert main(["analyze", "--model", "zoo-llama", "--text", "t5 t6 t7 t8", "--max-length", "32",
                 "--out", str(out), "--no-figures"]) == 0
    assert (out / "report.json").exists()
