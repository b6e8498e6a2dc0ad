"""Neuron and residual-dimension interventions edit exactly the chosen entries."""

import pytest
import torch

from sinklens.interventions import clamp_dims, edit_neurons, transplant_dims

pytestmark = pytest.mark.models

POST0 = "blocks.0.mlp.hook_post"
R0 = "blocks.0.hook_resid_post"


@pytest.mark.parametrize("mode,value", [("zero", 0.0), ("scale", 3.0), ("set", 7.5)])
def test_edit_neurons(tiny, toks, capture, mode, value):
    clean = capture(tiny, toks, [POST0])[POST0]
    got = capture(tiny, toks, [POST0], edit_neurons(tiny, {0: [2, 5]}, mode=mode, value=value, positions=[1, 3]))[POST0]
    sel = got[:, [1, 3]][..., [2, 5]]
    expected = {"zero": torch.zeros_like(sel), "scale": clean[:, [1, 3]][..., [2, 5]] * 3.0, "set": torch.full_like(sel, 7.5)}[mode]
    torch.testing.assert_close(sel, expected)
    mask = torch.ones_like(clean, dtype=torch.bool)
    mask[:, 1, 2] = mask[:, 1, 5] = mask[:, 3, 2] = mask[:, 3, 5] = False
    assert torch.equal(got[mask], clean[mask])


def test_clamp_and_transplant(tiny, toks, capture):
    clean = capture(tiny, toks, [R0])[R0]
    got = capture(tiny, toks, [R0], clamp_dims(tiny, [1, 4], positions=0, value=0.0, layers=[0]))[R0]
    assert torch.all(got[:, 0, [1, 4]] == 0)
    got = capture(tiny, toks, [R0], clamp_dims(tiny, [1, 4], positions=None, mode="bound", value=0.01, layers=[0]))[R0]
    torch.testing.assert_close(got[..., [1, 4]], clean[..., [1, 4]].clamp(-0.01, 0.01))
    got = capture(tiny, toks, [R0], transplant_dims(tiny, [3, 6], positions=[5, 8], source=0, layers=[0]))[R0]
    torch.testing.assert_close(got[:, [5, 8]][..., [3, 6]], clean[:, [0, 0]][..., [3, 6]])
    assert torch.equal(got[:, 5, [0, 1, 2]], clean[:, 5, [0, 1, 2]])


def test_errors(tiny):
    with pytest.raises(ValueError, match="out of range"):
        edit_neurons(tiny, [tiny.cfg.d_mlp])
    with pytest.raises((ValueError, TypeError)):  # ValueError; under pytest the Literal type check fires first
        edit_neurons(tiny, [1], mode="double")
    with pytest.raises(ValueError, match="not both"):
        edit_neurons(tiny, {0: [1]}, layers=[0])
    with pytest.raises(ValueError, match="out of range"):
        clamp_dims(tiny, [tiny.cfg.d_model])
    with pytest.raises(ValueError, match=">= 0"):
        clamp_dims(tiny, [0], mode="bound", value=-1.0)
    with pytest.raises(ValueError, match="out of range"):
        transplant_dims(tiny, [0], positions=[3], source=tiny.cfg.n_ctx)
