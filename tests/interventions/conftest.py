"""Fixtures for the intervention tests: token batches and a capture helper."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def toks():
    """Two seeded random sequences of 12 tokens (ids 2..63, no BOS/EOS ids)."""
    gen = torch.Generator().manual_seed(1)
    return torch.randint(2, 64, (2, 12), generator=gen)


def _capture(model, toks, names, hooks=()):
    """Run with ``hooks`` and return {name: activation} as seen *after* the hooks at each name."""
    store = {}

    def grabber(name):
        def grab(act, hook):  # keyed by the requested name: the bridge may report an alias as hook.name
            store[name] = act.detach().clone()

        return grab

    with torch.inference_mode(), model.hooks(fwd_hooks=list(hooks) + [(n, grabber(n)) for n in names]):
        model(toks, return_type=None)
    return store


def _no_hooks_left(model) -> bool:
    """True if no hook point of the model carries a forward or backward hook."""
    return all(not hp.fwd_hooks and not hp.bwd_hooks for hp in model.hook_dict.values())


@pytest.fixture
def capture():
    """``capture(model, toks, names, hooks=())`` -> {name: activation after the hooks}."""
    return _capture


@pytest.fixture
def no_hooks_left():
    """``no_hooks_left(model)`` -> True if no hook point carries a hook."""
    return _no_hooks_left


@pytest.fixture(scope="session", params=["llama", "gpt2"])
def sharp(request):
    """A tiny model whose attention is far from uniform.

    Hugging Face initialises weights with std 0.02, so the TransformerLens 4.x tiny models attend
    almost uniformly and interventions barely move the attention; their 2-D weights are scaled by 8
    here. TransformerLens 3.x initialisation is already sharp enough and is left as is.
    """
    from sinklens.testing import tiny_model, transformer_lens_major

    model = tiny_model(request.param, n_layers=2, d_model=16, n_heads=4, d_mlp=32, n_ctx=64, d_vocab=64, seed=3)
    if transformer_lens_major() >= 4:
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 2:
                    p.mul_(8.0)
    return model
