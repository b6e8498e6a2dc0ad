"""Fixtures shared by the analysis tests."""

import pytest

from sinklens.testing.planted import planted_model


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def planted_mechanisms(request):
    """A planted super neuron (layer 0, neuron 7) writing dim 5 at the BOS, and query-key locking on it
    in layer 2, head 1; grouped-query attention on the Llama variant."""
    kv = 2 if request.param == "llama" else None
    return planted_model(request.param, n_layers=3, n_kv_heads=kv, layer=0, neuron=7, dim=5, bos_dim=2,
                         qk_layer=2, qk_head=1, common_dim=9)
