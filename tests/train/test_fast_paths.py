"""The trainer's fused fast paths compute what the explicit, hookable paths compute."""

from __future__ import annotations

import torch

from sinklens.train.config import ModelConfig
from sinklens.train.model import RMSNorm, SinkLM
from sinklens.train.variants import _rms_norm


def _explicit_rms(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_rms_norm_fast_path_matches_the_formula_and_hooked_path():
    torch.manual_seed(0)
    norm = RMSNorm(32, 1e-6)
    with torch.no_grad():
        norm.w.copy_(torch.rand(32) + 0.5)
    x = torch.randn(3, 5, 32) * 4
    fast_in = x.clone().requires_grad_()
    fast = norm(fast_in)
    fast.square().sum().backward()

    scales = []
    norm.hook_scale.add_hook(lambda s, hook: scales.append(s) or s)  # a hook on hook_scale: explicit path
    slow_in = x.clone().requires_grad_()
    slow = norm(slow_in)
    slow.square().sum().backward()
    norm.hook_scale.remove_hooks()

    ref = _explicit_rms(x.double(), norm.w.detach().double(), 1e-6)
    torch.testing.assert_close(fast.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(slow.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fast_in.grad, slow_in.grad, rtol=1e-5, atol=1e-6)
    (scale,) = scales
    torch.testing.assert_close(scale.double(), x.double().pow(2).mean(-1, keepdim=True).add(1e-6).sqrt(), rtol=1e-6, atol=0)


def test_head_rms_norm_matches_the_authors_formula():
    # HeadRMSNorm of Siquan-Li/Head-wise-RMSNorm: x * rsqrt(mean(x², -1) + eps), per head over d_head
    torch.manual_seed(1)
    z = torch.randn(2, 7, 4, 16) * 3
    ref = z.double() * torch.rsqrt(z.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(_rms_norm(z, 1e-6).double(), ref, rtol=1e-6, atol=1e-6)


def test_model_logits_do_not_depend_on_the_norm_path():
    torch.manual_seed(2)
    model = SinkLM(ModelConfig.from_preset("tiny", variant="headwise_rms", n_ctx=16, d_vocab=32))
    tokens = torch.randint(0, 32, (2, 12))
    fast = model(tokens)
    hooks = [(f"blocks.{l}.ln{i}.hook_scale", lambda s, hook: s) for l in range(2) for i in (1, 2)]
    slow = model.run_with_hooks(tokens, fwd_hooks=hooks + [("ln_final.hook_scale", lambda s, hook: s)])
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
