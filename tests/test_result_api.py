"""The result objects' API: structural ``==`` (no crash on tensors, NaN equal to NaN), no hash, strict-JSON
``to_dict()`` on every result, and sweep's error for a keyword it does not take."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import sinklens
from sinklens.display import CompactRepr, StructuralEq, same_value
from sinklens.errors import InvalidArgumentError
from sinklens.interventions import block_keys
from sinklens.testing import QUIET, tiny_model
from support.checks import TINY_PROMPTS, public_dataclasses

OTHER_PROMPTS = ["t2 t3 t4 t5 t6 t7 t8", "t8 t7 t6 t5", "t1 t1 t2 t3 t4 t5 t6 t7 t8 t9"]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _patch(m, prompts):
    return sinklens.patch_sink(m, prompts[0], block_keys(m, positions=0, layers=[0]), metric_layers=[1])


def _seed(prompts):
    """The origins results' "inputs": random sequences, seed 0 for TINY_PROMPTS and 1 for the others."""
    return 0 if prompts is TINY_PROMPTS else 1


def _weights(m, prompts):
    """A result from weights alone: the "other inputs" are another model's weights."""
    return sinklens.super_neurons_from_weights(m if prompts is TINY_PROMPTS else tiny_model("llama", seed=1))


#: name -> (model, prompts) -> result; the origins results take a seed instead of prompts.
PRODUCERS = {
    "find_sinks": lambda m, p: sinklens.find_sinks(m, p, options=QUIET),
    "find_massive_activations": lambda m, p: sinklens.find_massive_activations(m, p, options=QUIET),
    "measure_variance": lambda m, p: sinklens.measure_variance(m, p, options=QUIET),
    "find_super_neurons": lambda m, p: sinklens.find_super_neurons(m, p, options=QUIET),
    "super_neurons_from_weights": _weights,
    "measure_value_drain": lambda m, p: sinklens.measure_value_drain(m, p, options=QUIET),
    "normalized_disparity": lambda m, p: sinklens.normalized_disparity(m, p, options=QUIET),
    "query_key_locking": lambda m, p: sinklens.query_key_locking(m, p, options=QUIET),
    "analyze": lambda m, p: sinklens.analyze(m, p, options=QUIET),
    "create_sink": lambda m, p: sinklens.create_sink(m, p, 3, loss=False, options=QUIET),
    "patch_sink": _patch,
    "token_preference": lambda m, p: sinklens.token_preference(m, n_sequences=8, seq_len=8, seed=_seed(p)),
    "contraction": lambda m, p: sinklens.contraction(m, n_sequences=8, seq_len=8, seed=_seed(p)),
    "positional_discrepancy": lambda m, p: sinklens.positional_discrepancy(m, n_sequences=8, seq_len=8, seed=_seed(p)),
}


@pytest.fixture(scope="module")
def results(model):
    """Each producer run twice on TINY_PROMPTS and once on OTHER_PROMPTS."""
    return {name: (make(model, TINY_PROMPTS), make(model, TINY_PROMPTS), make(model, OTHER_PROMPTS))
            for name, make in PRODUCERS.items()}


# ---------------------------------------------------------------------------------------------- equality


@pytest.mark.parametrize("name", list(PRODUCERS))
def test_two_runs_on_the_same_inputs_are_equal(results, name):
    a, b, _ = results[name]
    assert isinstance(a, StructuralEq)
    assert a == b and b == a and not (a != b)
    assert a == a and a == copy.deepcopy(a)


@pytest.mark.parametrize("name", list(PRODUCERS))
def test_runs_on_different_inputs_are_not_equal(results, name):
    a, _, other = results[name]
    assert a != other and not (a == other)


@pytest.mark.parametrize("name", list(PRODUCERS))
def test_results_are_unhashable(results, name):
    with pytest.raises(TypeError):
        hash(results[name][0])


def test_nested_results_are_compared_structurally(results):
    report = results["analyze"][0]
    assert isinstance(report.sinks, sinklens.SinkResult)
    changed = copy.deepcopy(report)
    changed.sinks.received[0, 0, 0] += 1e-3
    assert changed != report
    sinks = copy.deepcopy(results["find_sinks"][0])
    sinks.top_occurrences[0].received += 1.0  # a SinkOccurrence in a list
    assert sinks != results["find_sinks"][0]


def test_nan_equals_nan(results):
    sinks = copy.deepcopy(results["find_sinks"][0])
    sinks.received[0, 0, 0] = math.nan
    assert sinks == sinks and sinks == copy.deepcopy(sinks)
    other = copy.deepcopy(sinks)
    other.received[0, 0, 1] = math.nan
    assert other != sinks
    created = results["create_sink"][0]
    assert math.isnan(created.loss_before)  # loss=False: a NaN float field
    assert created == results["create_sink"][1]


def test_shape_dtype_class_and_other_objects(results):
    a = results["find_sinks"][0]
    as_double = copy.deepcopy(a)
    as_double.received = as_double.received.double()
    assert as_double != a  # same values, another dtype
    longer = copy.deepcopy(a)
    longer.layers = [*longer.layers, 99]
    assert longer != a
    assert a != results["measure_variance"][0] and a != 3 and a is not None


def test_same_value_rules():
    nan = math.nan
    assert same_value(torch.tensor([1.0, nan]), torch.tensor([1.0, nan]))
    assert not same_value(torch.tensor([1.0, nan]), torch.tensor([nan, 1.0]))
    assert not same_value(torch.zeros(2), torch.zeros(1, 2))
    assert same_value({"a": [nan, (1, torch.ones(2))]}, {"a": [nan, (1, torch.ones(2))]})
    assert not same_value({"a": 1}, {"b": 1}) and not same_value([1, 2], (1, 2))
    assert same_value(nan, float("nan")) and not same_value(nan, 0.0) and not same_value(torch.zeros(1), 0.0)


def _structural_classes() -> list[type]:
    """Every public dataclass in sinklens with the CompactRepr mixin, and the result dataclasses nested in them."""
    return public_dataclasses(lambda cls: issubclass(cls, (StructuralEq, CompactRepr)))


@pytest.mark.parametrize("cls", _structural_classes(), ids=lambda c: c.__name__)
def test_every_result_class_uses_the_structural_eq(cls):
    assert cls.__eq__ is StructuralEq.__eq__, f"declare {cls.__qualname__} @dataclass(..., eq=False)"
    frozen = cls.__dataclass_params__.frozen
    assert (cls.__hash__ is None) != frozen, "a mutable result is unhashable; a frozen one keeps a hash"


def test_a_frozen_norm_map_hashes_consistently_with_its_equality():
    from sinklens.residual_units import NormMap

    a = NormMap(1, "attn", "ln1_post", torch.tensor([1.0, float("nan")]), torch.zeros(2), False, "w", "blocks.1.ln1_post")
    b = copy.deepcopy(a)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != NormMap(1, "attn", "ln1_post", torch.tensor([2.0, 0.0]), torch.zeros(2), False, "w", "blocks.1.ln1_post")


def test_the_small_result_records_compare_structurally():
    from sinklens.analysis.neurons import BlockStep
    from sinklens.analysis.sinks import SinkOccurrence
    from sinklens.analysis.verify import Ablation, CausalCheck, DimCheck
    from sinklens.origins.positional import PositionalTrajectory

    for cls in (BlockStep, SinkOccurrence, Ablation, DimCheck, CausalCheck, PositionalTrajectory):
        assert cls.__eq__ is StructuralEq.__eq__ and cls.__hash__ is None
    check = DimCheck(1, 2, 1.0, 0.5, [Ablation("direct", [(0, 1, math.nan)], math.nan, math.nan, 0.5, 0.0)], False,
                     False, False)
    assert CausalCheck(0, [check]) == CausalCheck(0, [copy.deepcopy(check)])


# ---------------------------------------------------------------------------------------------- to_dict


def _strict(data):
    return json.loads(json.dumps(data, allow_nan=False))


def _same(exported, tensor):
    """Nested lists from ``to_dict()`` hold exactly ``tensor``'s values (full precision, no NaN here)."""
    return same_value(torch.tensor(exported, dtype=tensor.dtype), tensor.cpu())


def test_token_preference_to_dict(results):
    pref = results["token_preference"][0]
    d = _strict(pref.to_dict())
    assert d["n_sequences"] == pref.n_sequences and d["prepend_bos"] == pref.prepend_bos
    assert d["max_median_ratio"] == pref.max_median_ratio
    assert d["argmax_gini"] == pref.argmax_gini
    assert _same(d["probs"], pref.probs)
    assert d["argmax_total"] == pref.argmax_total.tolist()
    assert [t["token"] for t in d["top"]] == [t["token"] for t in pref.top(10)]


def test_contraction_to_dict(results):
    con = results["contraction"][0]
    d = _strict(con.to_dict())
    assert [s["site"] for s in d["sites"]] == [s.name for s in con.sites]
    for row, site in zip(d["sites"], con.sites):
        assert row["inter"] == site.inter_mean and row["intra"] == site.intra
        assert _same(row["inter_by_position"], site.inter)
    assert d["n_layers"] == con.n_layers and d["n_sequences"] == con.n_sequences
    assert _same(d["alignment"], con.alignment)
    assert _same(d["share_inter"], con.share("inter_mean"))


def test_positional_to_dict(results):
    pos = results["positional_discrepancy"][0]
    d = _strict(pos.to_dict())
    for name in ("attn_out_var", "attn_out_norm", "resid_var", "resid_norm", "head_var"):
        assert _same(d[name], getattr(pos, name))
    for name in ("attn_out_var", "resid_norm"):
        assert _same(d["first_token_ratio"][name], pos.first_token_ratio(name))
    assert d["n_sequences"] == pos.n_sequences and d["position"] == pos.first_counted


def test_positional_to_dict_nan_is_null():
    layer_pos = torch.tensor([[math.nan, 1.0, 1.0, 1.0]])
    pos = sinklens.PositionalDiscrepancy(layer_pos, layer_pos, layer_pos, layer_pos, layer_pos[None], 4)
    d = _strict(pos.to_dict())
    assert d["attn_out_var"] == [[None, 1.0, 1.0, 1.0]] and d["first_token_ratio"]["attn_out_var"] == [None]


def test_sink_patch_result_to_dict(results):
    patch = results["patch_sink"][0]
    d = _strict(patch.to_dict())
    assert d["site"] == patch.site and d["axes"] == list(patch.axes) and d["target"] == patch.target
    assert d["coords"] == patch.coords and d["metric_layers"] == patch.metric_layers
    assert _same(d["values"], patch.values)
    assert d["clean"] == patch.clean and d["intervened"] == patch.intervened
    assert d["has_effect"] == patch.has_effect
    if patch.has_effect:
        assert _same(d["restored"], patch.restored)
    rows = patch.to_rows()
    assert [r["value"] for r in rows] == torch.tensor(d["values"], dtype=torch.float64).flatten().tolist()


def test_sink_patch_result_without_effect_to_dict():
    patch = sinklens.SinkPatchResult("resid_pre", ("layer", "pos"), {"layer": [0], "pos": [0, 1]},
                                     torch.tensor([[0.5, math.nan]], dtype=torch.float64), 0.5, 0.5, 0, [1])
    d = _strict(patch.to_dict())
    assert d["has_effect"] is False and d["restored"] is None and d["values"] == [[0.5, None]]


# ---------------------------------------------------------------------------------------------- sweep


def test_sweep_names_alphas_for_a_keyword_it_does_not_take(model):
    with pytest.raises(InvalidArgumentError, match="alphas") as caught:
        sinklens.sweep(model, TINY_PROMPTS, method="amplify", positions=2, values=[1.0, 2.0])
    assert "'values'" in str(caught.value) and "sweep" in str(caught.value)
    with pytest.raises(InvalidArgumentError, match="alphas"):
        sinklens.sweep(model, TINY_PROMPTS, method="self_only", positions=2, values=[1.0])


def test_amplify_names_its_own_options(model):
    from sinklens.interventions.variance import amplify

    with pytest.raises(InvalidArgumentError, match=r"'values'.*'alpha'.*'n_sequences'"):
        amplify(model, positions=2, alpha=2.0, values=[1.0])
