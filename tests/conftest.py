"""Shared fixtures: tiny seeded models on whichever TransformerLens is installed."""

from __future__ import annotations

import os

import matplotlib
import pytest
import torch

matplotlib.use("Agg")
# Tiny models run fastest single-threaded; the SmolLM2 tests are few and short.
torch.set_num_threads(1)
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under ``pytest -n logical`` each worker keeps one core busy, so the notebook kernels and command-line
    # processes a test starts run single-threaded too: two OpenMP threads on a core that another worker
    # holds spin-wait (tutorial 01 took 147 s instead of 23 on 2 cores).
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_addoption(parser):
    parser.addoption(
        "--device", default="cpu",
        help="device of the GPU lane (tests/devices): cpu (default: the lane runs on sinklens.testing.fake_cuda's "
             "pretend CUDA device), fake-cuda, cuda or cuda:N (skipped when CUDA is absent)")


def pytest_collection_modifyitems(config, items):
    """Run the long items first: those marked ``slow`` and the tutorials (each executed notebook takes
    10-90 s). With ``pytest -n logical`` (the README's test command) the workers then share out the short
    tests behind them and finish together, instead of one starting a four-minute test at the end."""
    def long_first(item) -> int:
        return 0 if item.get_closest_marker("slow") or item.path.suffix == ".ipynb" else 1

    items.sort(key=long_first)  # stable: the collection order within each group is kept


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _close_figures():
    """Plot functions leave their figure open, as pyplot does (a notebook shows it); tests close them."""
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


@pytest.fixture(scope="session")
def tiny_llama():
    from sinklens.testing import tiny_model

    return tiny_model("llama", n_layers=2, d_model=16, n_heads=4, n_kv_heads=2, d_mlp=32, n_ctx=64, d_vocab=64)


@pytest.fixture(scope="session")
def tiny_gpt2():
    from sinklens.testing import tiny_model

    return tiny_model("gpt2", n_layers=2, d_model=16, n_heads=4, d_mlp=32, n_ctx=64, d_vocab=64)


@pytest.fixture(params=["llama", "gpt2"])
def tiny(request, tiny_llama, tiny_gpt2):
    """Both tiny architectures, one after the other."""
    return tiny_llama if request.param == "llama" else tiny_gpt2


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct as a TransformerBridge, loaded once per test session."""
    from sinklens.loading import load_model

    return load_model("smollm2-135m", device="cpu")


@pytest.fixture
def fused_attention_model():
    """A model that has a ``hook_pattern`` (like one with fused SDPA attention) but never runs it."""
    from transformer_lens import HookedRootModule
    from transformer_lens.hook_points import HookPoint

    class FusedAttentionModel(HookedRootModule):
        def __init__(self):
            super().__init__()
            self.cfg = type("Cfg", (), {"n_layers": 1, "n_heads": 1, "d_head": 2, "d_model": 2, "n_ctx": 8, "d_vocab": 4})()
            self.embed = torch.nn.Embedding(4, 2)
            self.blocks = torch.nn.ModuleList([torch.nn.Module()])
            self.blocks[0].attn = torch.nn.Module()
            self.blocks[0].attn.hook_pattern = HookPoint()
            self.setup()

        def forward(self, tokens, return_type=None):
            return self.embed(tokens)

    return FusedAttentionModel()


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def planted_mechanisms(request):
    """A planted super neuron (layer 0, neuron 7) writing dim 5 at the BOS, and query-key locking on it
    in layer 2, head 1; grouped-query attention on the Llama variant."""
    from sinklens.testing.planted import planted_model

    kv = 2 if request.param == "llama" else None
    return planted_model(request.param, n_layers=3, n_kv_heads=kv, layer=0, neuron=7, dim=5, bos_dim=2,
                         qk_layer=2, qk_head=1, common_dim=9)
