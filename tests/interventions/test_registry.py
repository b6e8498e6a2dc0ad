"""The one intervention registry: names, uniform calls, required options, and its users."""

import pytest
import torch

from sinklens.errors import InvalidArgumentError
from sinklens.interventions import (
    amplify, clamp_dims, create_sink, measure_intervention, registry, remove_sink, restart,
)
from sinklens.options import RunOptions

pytestmark = pytest.mark.models

QUIET = RunOptions(progress=False)


def test_canonical_names_and_roles():
    assert registry.names("create") == ["amplify", "restart", "self_only", "transplant_dims"]
    assert registry.names("remove") == ["block_keys", "calibrate", "clamp_dims", "edit_neurons", "variance_calibration"]
    spelled = {"transplant-dims": "transplant_dims", "block_keys": "block_keys", "edit-neurons": "edit_neurons",
               "self-only": "self_only", "Transplant_Dims": None}
    for name, canonical in spelled.items():
        if canonical is None:  # names are case-sensitive identifiers
            with pytest.raises(InvalidArgumentError, match="Did you mean 'transplant_dims'"):
                registry.get(name)
        else:
            assert registry.get(name).name == canonical
    with pytest.raises(InvalidArgumentError, match="'self-only' is a create intervention, not a remove one"):
        registry.get("self-only", role="remove")


def test_spec_string_builds_the_same_hooks_as_the_factory(tiny, toks):
    spec = registry.build(tiny, "amplify:positions=[3, 5],alpha=2.5,layers=[1],reference=batch")
    direct = amplify(tiny, positions=[3, 5], alpha=2.5, layers=[1], reference="batch")
    assert [n for n, _ in spec] == [n for n, _ in direct] == ["blocks.1.attn.hook_z"]
    with torch.inference_mode():
        torch.testing.assert_close(tiny.run_with_hooks(toks, fwd_hooks=spec), tiny.run_with_hooks(toks, fwd_hooks=direct))
        assert not torch.equal(tiny.run_with_hooks(toks, fwd_hooks=spec), tiny(toks))


def test_required_and_unknown_options_get_clear_errors(tiny):
    with pytest.raises(InvalidArgumentError, match=r"'clamp_dims' needs dims=\[\.\.\.\]"):
        registry.get("clamp_dims")(tiny, positions=0)
    with pytest.raises(InvalidArgumentError, match=r"'transplant_dims' needs dims="):
        registry.build(tiny, "transplant_dims:positions=4")
    with pytest.raises(InvalidArgumentError, match=r"'edit_neurons' needs neurons="):
        registry.get("edit_neurons")(tiny, positions=0, layers=[0])
    with pytest.raises(InvalidArgumentError, match="needs explicit layers"):
        registry.get("edit_neurons")(tiny, positions=0, neurons=[1])
    with pytest.raises(InvalidArgumentError, match="'restart' has no option 'alpha'"):
        registry.get("restart")(tiny, positions=3, alpha=2.0)
    with pytest.raises(InvalidArgumentError, match="amplify has no option 'bogus'"):
        registry.get("amplify")(tiny, positions=3, bogus=1)
    hooks = registry.get("clamp_dims")(tiny, positions=0, dims=[1], layers=[0])
    assert [n for n, _ in hooks] == [n for n, _ in clamp_dims(tiny, [1], positions=0, layers=[0])]


def test_registry_defaults_and_names_in_experiments(tiny, toks):
    default = create_sink(tiny, toks, 4, method="amplify", reference="batch", options=QUIET)  # default alpha 8
    new = create_sink(tiny, toks, 4, method="amplify", alpha=8.0, reference="batch", options=QUIET)
    assert default.method == new.method == "amplify"
    torch.testing.assert_close(default.received_after, new.received_after)
    assert not torch.allclose(new.received_after, new.received_before)
    removed = remove_sink(tiny, toks, method="block-keys", loss=False, options=QUIET)
    assert removed.method == "block_keys" and float(removed.received_after.abs().max()) == 0.0


def test_measure_intervention_takes_a_spec_string(tiny, toks):
    by_spec = measure_intervention(tiny, toks, "restart:positions=5", target=5, loss=False, options=QUIET)
    by_hooks = measure_intervention(tiny, toks, restart(tiny, positions=5), target=5, loss=False, options=QUIET)
    assert by_spec.method == "restart" and by_hooks.method == "custom"
    torch.testing.assert_close(by_spec.received_after, by_hooks.received_after)
    assert float(by_spec.sink_after.abs().max()) == 0.0
