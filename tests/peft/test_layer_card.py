"""Layer Card with planted answers: resnorm against its closed form, zero gradient gives 0, decoupled
layers have coupling 0, and the model-level G is the gradient of a real adapter."""

from __future__ import annotations

import json

import pytest
import torch

from sinklens.errors import InvalidArgumentError
from sinklens.export import dumps
from sinklens.peft.layer_card import coupling_from_hessian, layer_card, resnorm_from_moments
from sinklens.peft.train import keyword_task
from sinklens.testing import tiny_model

pytestmark = pytest.mark.models  # also run under TransformerLens 3.x (tests/test_tl3_compat.py)


def test_resnorm_is_the_whitened_gradient_norm():
    """G = W Σ (the gradient a planted correctable error W leaves): Res = ‖W Σ^{1/2}‖_F, direction = W."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(400, 5, generator=gen) * torch.tensor([3.0, 1.0, 0.5, 2.0, 1.0])
    cov = x.T @ x / 400
    w = torch.randn(3, 5, generator=gen)
    res, direction, cond = resnorm_from_moments(w @ cov, cov, ridge=0.0)
    evals, evecs = torch.linalg.eigh(cov.double())
    expected = (w.double() @ evecs @ torch.diag(evals.sqrt()) @ evecs.T).norm()
    torch.testing.assert_close(res, expected)
    torch.testing.assert_close(direction.float(), w, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cond, evals[-1] / evals[0])


def test_zero_gradient_gives_resnorm_zero():
    cov = torch.eye(4) * 2
    res, direction, _ = resnorm_from_moments(torch.zeros(4, 4), cov)
    assert float(res) == 0.0 and not direction.any()


def test_decoupled_layers_have_coupling_zero():
    """A loss f(t0) + g(t1): no cross term. A planted cross term 0.5 with unit diagonal gives rho = 0.5."""
    t = torch.zeros(2, requires_grad=True)
    hessian = torch.autograd.functional.hessian(lambda t: (t[0] - 1) ** 2 + torch.cosh(t[1]), t)
    rho = coupling_from_hessian(hessian.double())
    torch.testing.assert_close(rho, torch.eye(2, dtype=torch.float64))
    planted = torch.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
    torch.testing.assert_close(coupling_from_hessian(planted)[0, 1], torch.tensor(0.5, dtype=torch.float64))
    assert coupling_from_hessian(torch.tensor([[0.0, 0.0], [0.0, 1.0]]))[0].abs().sum() == 0  # a layer with D = 0


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("llama", n_layers=3)
    return model, keyword_task(model, n_rows=32, seq_len=8)


def test_card_gradient_is_a_real_adapters_gradient(setup):
    """Independent reference: a d×d adapter at resid_post fed by ln1.hook_normalized, through plain autograd."""
    model, task = setup
    card = layer_card(model, task, n_rows=4, ridge=0.0, coupling=False)
    tokens = task.train[:4]
    d = model.cfg.d_model
    w = torch.zeros(d, d, requires_grad=True)
    acts = {}
    hooks = [("blocks.1.ln1.hook_normalized", lambda x, hook: acts.__setitem__(1, x.detach())),
             ("blocks.1.hook_resid_post", lambda r, hook: r + acts[1] @ w.T)]
    from sinklens.peft.train import task_loss

    with model.hooks(fwd_hooks=hooks):
        loss = task_loss(model(tokens), tokens, task.loss_mask)
    (g,) = torch.autograd.grad(loss, w)
    a = acts[1].reshape(-1, d)
    res, _, _ = resnorm_from_moments(g, a.T @ a / a.shape[0], ridge=0.0)
    torch.testing.assert_close(card.resnorm[1], res.float(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(card.activation_energy[1], torch.trace(a.T @ a / a.shape[0]) / d, rtol=1e-5, atol=0)


def test_card_coupling_placement_and_json(setup):
    model, task = setup
    card = layer_card(model, task, n_rows=4)
    assert card.coupling.shape == (3, 3)
    torch.testing.assert_close(card.coupling, card.coupling.T)
    torch.testing.assert_close(card.coupling.diagonal().abs(), torch.ones(3))  # the sign of each layer's curvature
    assert card.place(1) == [int(torch.argmax(card.resnorm))]
    assert card.lora_params == [card.lora_params[0]] * 3 and card.lora_train_flops_per_token[0] == 6 * card.lora_params[0]
    assert json.loads(dumps(card.to_dict()))["layers"] == [0, 1, 2]
    with pytest.raises(InvalidArgumentError, match="k=4"):
        card.place(4)
    with pytest.raises(InvalidArgumentError, match="speed"):
        card.place(1, "speed")


def test_gain_per_param_prefers_the_cheaper_layer():
    """Res²/2 per LoRA parameter: 2²/2/400 = 0.005 for layer 3 against 1²/2/10 = 0.05 for layer 7."""
    from sinklens.peft.layer_card import LayerCard

    t = torch.tensor
    card = LayerCard([3, 7], t([2.0, 1.0]), t([1.0, 1.0]), t([1.0, 1.0]), torch.eye(2), [400, 10], [2400, 60],
                     8, 16, 1e-3, "planted", 1.0)
    assert card.place(1, "resnorm") == [3] and card.place(1, "gain_per_param") == [7]
