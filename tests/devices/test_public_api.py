"""Every model-facing public function on the lane's device gives the CPU's numbers (fp32 and bf16).

The model is a planted one (:func:`sinklens.testing.planted.planted_model`: a super neuron writing a massive
dimension at the BOS, query-key locking in layer 2), so the paths that run only when a model has massive
dimensions run too, beside those that run on a model without any (a random tiny model).
"""

from __future__ import annotations

import pytest
import torch

import sinklens
from sinklens.interventions import block_keys
from sinklens.loading import load_model
from sinklens.testing import QUIET, tiny_model
from support.checks import PLANTED_PROMPTS
from sinklens.testing.planted import planted_model

OPTIONS = QUIET.replace(batch_size=2)  # several batches, padded


def _verify(m, p):
    return sinklens.verify_attribution(m, p, sinklens.find_super_neurons(m, p, options=OPTIONS), options=OPTIONS)


def _fingerprint(m, p):
    return sinklens.fingerprint(m, m, n_samples=16, seq_len=8, buffer_k=4, options=OPTIONS)


#: name -> (model, prompts) -> result
CALLS = {
    "find_sinks": lambda m, p: sinklens.find_sinks(m, p, options=OPTIONS),
    "find_massive_activations": lambda m, p: sinklens.find_massive_activations(m, p, options=OPTIONS),
    "measure_variance": lambda m, p: sinklens.measure_variance(m, p, options=OPTIONS),
    "find_super_neurons": lambda m, p: sinklens.find_super_neurons(m, p, options=OPTIONS),
    "super_neurons_from_weights": lambda m, p: sinklens.super_neurons_from_weights(m),
    "measure_value_drain": lambda m, p: sinklens.measure_value_drain(m, p, options=OPTIONS),
    "normalized_disparity": lambda m, p: sinklens.normalized_disparity(m, p, options=OPTIONS),
    "query_key_locking": lambda m, p: sinklens.query_key_locking(m, p, options=OPTIONS),
    "attention_visibility": lambda m, p: sinklens.attention_visibility(m),
    "analyze": lambda m, p: sinklens.analyze(m, p, options=OPTIONS),
    "verify_attribution": _verify,
    "patch_sink": lambda m, p: sinklens.patch_sink(m, p[0], block_keys(m, positions=0, layers=[0]), metric_layers=[1]),
    "sweep": lambda m, p: sinklens.sweep(m, p, method="amplify", positions=3, alphas=[1.0, 2.0], options=OPTIONS),
    "token_preference": lambda m, p: sinklens.token_preference(m, n_sequences=8, seq_len=8, seed=0, options=OPTIONS),
    "contraction": lambda m, p: sinklens.contraction(m, n_sequences=8, seq_len=8, seed=0, options=OPTIONS),
    "positional_discrepancy": lambda m, p: sinklens.positional_discrepancy(m, n_sequences=8, seq_len=8, seed=0,
                                                                           options=OPTIONS),
    "fingerprint": _fingerprint,
}
#: Each intervention method of the registry, through the experiment of its role.
for _method, _extra in [("self_only", {}), ("restart", {}), ("amplify", {}), ("transplant_dims", {"dims": [5, 2]})]:
    CALLS[f"create_sink[{_method}]"] = (lambda m, p, method=_method, extra=_extra: sinklens.create_sink(
        m, p, 3, method=method, loss=True, options=OPTIONS, **extra))
for _method, _extra in [("block_keys", {}), ("calibrate", {}), ("clamp_dims", {"dims": [5]}),
                        ("edit_neurons", {"neurons": [7], "layers": [0]}), ("variance_calibration", {})]:
    CALLS[f"remove_sink[{_method}]"] = (lambda m, p, method=_method, extra=_extra: sinklens.remove_sink(
        m, p, method=method, loss=True, options=OPTIONS, **extra))


def _planted(arch: str):
    return planted_model(arch, n_layers=3, n_kv_heads=2 if arch == "llama" else None, layer=0, neuron=7, dim=5,
                         bos_dim=2, qk_layer=2, qk_head=1, common_dim=9)[0]


_BUILD = {"planted-llama": lambda: _planted("llama"), "planted-gpt2": lambda: _planted("gpt2"),
          "random-llama": lambda: tiny_model("llama", n_layers=2, n_kv_heads=2)}
_MODELS: dict = {}


def _model(lane, kind: str, dtype: torch.dtype, on_device: bool):
    """The model ``kind`` in ``dtype``, on the CPU or the lane's device (built once per session)."""
    key = (kind, dtype, on_device)
    if key not in _MODELS:
        _MODELS[key] = load_model(_BUILD[kind](), device=lane.device if on_device else "cpu", dtype=dtype)
    return _MODELS[key]


def _same_on_device(lane, call, kind: str, dtype: torch.dtype) -> None:
    cpu = call(_model(lane, kind, dtype, False), PLANTED_PROMPTS)
    with lane.active():
        device = call(_model(lane, kind, dtype, True), PLANTED_PROMPTS)
    lane.assert_same(cpu, device, dtype)


@pytest.mark.parametrize("name", list(CALLS))
def test_public_function_gives_the_cpu_numbers(lane, dtype, name):
    _same_on_device(lane, CALLS[name], "planted-llama", dtype)


@pytest.mark.parametrize("name", ["analyze", "create_sink[self_only]", "remove_sink[clamp_dims]", "contraction"])
def test_gpt2_gives_the_cpu_numbers(lane, name):
    _same_on_device(lane, CALLS[name], "planted-gpt2", torch.float32)


@pytest.mark.parametrize("name", ["analyze", "verify_attribution", "find_super_neurons"])
def test_model_without_massive_dims_gives_the_cpu_numbers(lane, name):
    """A random-init model has no massive dimension: the empty paths (``find_super_neurons`` crashed there on an H200)."""
    _same_on_device(lane, CALLS[name], "random-llama", torch.float32)
