"""Result reprs: a notebook cell that ends with a result shows its fields, tensors as shape and dtype."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import sinklens
from sinklens.display import CompactRepr, compact_repr, short_value
from support.checks import public_dataclasses


def _public_result_classes() -> list[type]:
    """Every public dataclass in sinklens with a tensor-typed field (the objects a user prints)."""
    return public_dataclasses(lambda cls: any("Tensor" in str(f.type) for f in dataclasses.fields(cls)))


def test_every_public_result_class_has_the_compact_repr():
    classes = _public_result_classes()
    assert len(classes) >= 20  # the analyzers', interventions', origins' and trainer's results at least
    names = {c.__name__ for c in classes}
    assert {"SinkResult", "VarianceResult", "SuperNeurons", "InterventionResult", "FingerprintResult", "SinkMetrics"} <= names
    plain = [c.__qualname__ for c in classes if c.__repr__ is not CompactRepr.__repr__]
    assert plain == [], f"declare these @dataclass(repr=False) with the CompactRepr mixin: {plain}"


@pytest.mark.models
def test_a_sink_result_prints_shapes_not_values(tiny_llama):
    tokens = torch.randint(1, tiny_llama.cfg.d_vocab, (3, 12))
    result = sinklens.find_sinks(tiny_llama, tokens, options=sinklens.RunOptions(progress=False))
    text = repr(result)
    shown = [f for f in dataclasses.fields(result) if f.repr]
    assert text.splitlines()[0] == "SinkResult(" and len(text.splitlines()) == len(shown) + 2
    assert "tensor(" not in text and max(len(line) for line in text.splitlines()) < 200
    for f in shown:  # each tensor field by its real shape and dtype
        value = getattr(result, f.name)
        if isinstance(value, torch.Tensor):
            shape = ", ".join(str(n) for n in value.shape)
            assert f"    {f.name}=Tensor[{shape}] {str(value.dtype)[6:]}," in text
    assert f"    n_sequences={result.n_sequences}," in text
    assert re.search(r"    settings=SinkSettings\(sink_threshold=0\.3, ", text)


def test_short_values():
    assert short_value(torch.zeros(2, 0, 5, dtype=torch.int64)) == "Tensor[2, 0, 5] int64"
    assert short_value(torch.tensor(3)) == "Tensor[] int64 = 3"
    assert short_value(torch.tensor(1 / 3)) == "Tensor[] float32 = 0.333333"
    assert short_value("x" * 100) == repr("x" * 57 + "...")
    assert short_value({"a": 1, "b": None}) == "{'a': 1, 'b': None}"
    assert short_value({"a": [1, 2]}) == "dict of 1 keys"
    assert short_value((1, 2.5, "c")) == "(1, 2.5, 'c')"
    assert short_value([torch.zeros(1)] * 3) == "list of 3 Tensor"
    assert short_value(object()) == "<object>"

    @dataclasses.dataclass(repr=False)
    class Result(CompactRepr):
        values: torch.Tensor
        names: list = dataclasses.field(default_factory=list)
        hidden: int = dataclasses.field(default=0, repr=False)

    assert repr(Result(torch.ones(4, 2), ["a"])) == "Result(\n    values=Tensor[4, 2] float32,\n    names=['a'],\n)"
    assert compact_repr(Result(torch.ones(1))) == repr(Result(torch.ones(1)))
