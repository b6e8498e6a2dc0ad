"""The trainer's fast paths compute what the explicit, hookable paths and plain products compute."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from sinklens.errors import InvalidArgumentError
from sinklens.sinklm import matmul as matmul_mod
from sinklens.train.allocator import _glibc
from sinklens.sinklm.config import ModelConfig
from sinklens.train.loop import train
from sinklens.sinklm.model import LayerNorm, RMSNorm, SinkLM, next_token_loss
from sinklens.sinklm import rms_norm as rms_norm_mod
from sinklens.sinklm import rotary as rotary_mod
from sinklens.sinklm.rms_norm import rms_norm
from sinklens.sinklm.rotary import RotaryTables, rope
from _train_cfg import build_cfg


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


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_hook_normalized_is_before_the_gain_as_in_transformerlens(kind):
    """``hook_normalized`` holds the normalised vector before ``w`` (and ``b``), as TransformerLens' norms do, so
    analyzers that read it (normalized disparity, weight-based super neurons) see the same site on a SinkLM; hooking
    it alone takes the explicit path, whose output equals the fast one."""
    torch.manual_seed(3)
    norm = RMSNorm(32, 1e-6) if kind == "rms" else LayerNorm(32, 1e-5)
    with torch.no_grad():
        norm.w.copy_(torch.rand(32) + 0.5)
        if kind == "layer":
            norm.b.normal_()
    x = torch.randn(3, 5, 32) * 4 + 1.0
    fast = norm(x)
    seen = []
    norm.hook_normalized.add_hook(lambda n, hook: seen.append(n) or n)
    hooked = norm(x)
    norm.hook_normalized.remove_hooks()
    xd = x.double() - (x.double().mean(-1, keepdim=True) if kind == "layer" else 0)
    normalised = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + norm.eps)  # independent, float64
    (got,) = seen
    torch.testing.assert_close(got.double(), normalised, rtol=1e-5, atol=1e-5)
    output = normalised * norm.w.detach().double() + (norm.b.detach().double() if kind == "layer" else 0)
    torch.testing.assert_close(hooked.double(), output, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast.double(), output, rtol=1e-5, atol=1e-5)


def test_head_rms_norm_matches_the_authors_formula():
    # HeadRMSNorm of Siquan-Li/Head-wise-RMSNorm: x * rsqrt(mean(x², -1) + eps), per head over d_head
    torch.manual_seed(1)
    z = torch.randn(2, 7, 4, 16) * 3
    ref = z.double() * torch.rsqrt(z.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms_norm(z, None, 1e-6).double(), ref, rtol=1e-6, atol=1e-6)


def test_model_logits_do_not_depend_on_the_norm_path():
    torch.manual_seed(2)
    model = SinkLM(ModelConfig.from_preset("tiny", variant="headwise_rms", n_ctx=16, d_vocab=32))
    tokens = torch.randint(0, 32, (2, 12))
    fast = model(tokens)
    hooks = [(f"blocks.{l}.ln{i}.hook_scale", lambda s, hook: s) for l in range(2) for i in (1, 2)]
    slow = model.run_with_hooks(tokens, fwd_hooks=hooks + [("ln_final.hook_scale", lambda s, hook: s)])
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- CPU kernels: RMSNorm, rotary


def _rms_reference(x, w, eps):
    """float64 ``w ⊙ x / sqrt(mean(x²) + eps)`` over the last axis (independent of sinklens)."""
    x = x.double()
    out = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return out if w is None else out * w.double()


def _rotate_half_reference(x, cos, sin):
    """float64 RoPE as Llama / TransformerLens write it: ``x·cos + rotate_half(x)·sin``."""
    x1, x2 = x.double().chunk(2, dim=-1)
    return x.double() * cos + torch.cat([-x2, x1], dim=-1) * sin


@pytest.mark.parametrize("w_shape", [None, (16,), (3, 16)], ids=["no-gain", "gain-d", "gain-per-head"])
def test_rms_norm_backward_is_the_exact_gradient(w_shape):
    # the closed-form backward against autograd's numerical Jacobian, in float64
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(2, 4, 3, 16, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    w = None if w_shape is None else (torch.rand(*w_shape, generator=gen, dtype=torch.float64) + 0.5).requires_grad_()
    inputs = (x,) if w is None else (x, w)
    assert torch.autograd.gradcheck(lambda *t: rms_norm_mod._RMSNormFunction.apply(t[0], t[1] if len(t) > 1 else None, 1e-6), inputs)


@pytest.mark.parametrize("w_shape", [None, (16,), (3, 16)], ids=["no-gain", "gain-d", "gain-per-head"])
def test_rms_norm_fast_path_matches_float64_and_f_rms_norm(w_shape, monkeypatch):
    calls = []
    real = rms_norm_mod._RMSNormFunction.apply
    monkeypatch.setattr(rms_norm_mod._RMSNormFunction, "apply", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(6)
    x0 = torch.randn(2, 5, 3, 16, generator=gen) * 4
    w0 = None if w_shape is None else torch.rand(*w_shape, generator=gen) + 0.5
    dy = torch.randn(2, 5, 3, 16, generator=gen)
    grads = {}
    for path in ("fast", "plain"):
        x = x0.clone().requires_grad_()
        w = None if w0 is None else w0.clone().requires_grad_()
        if path == "plain":  # the same call with the CPU kernel switched off: F.rms_norm and autograd
            monkeypatch.setattr(rms_norm_mod, "eager_cpu_float32", lambda *t: False)
        y = rms_norm(x, w, 1e-6)
        y.backward(dy)
        grads[path] = (y.detach(), x.grad, None if w is None else w.grad)
    assert len(calls) == 1  # the fast path ran once, the plain one did not
    (y, gx, gw), (y_ref, gx_ref, gw_ref) = grads["fast"], grads["plain"]
    torch.testing.assert_close(y.double(), _rms_reference(x0, w0, 1e-6), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-6)
    x64 = x0.double().requires_grad_()
    _rms_reference(x64, w0, 1e-6).backward(dy.double())
    torch.testing.assert_close(gx.double(), x64.grad, rtol=1e-5, atol=1e-6)
    if w0 is not None:
        torch.testing.assert_close(gw, gw_ref, rtol=1e-5, atol=1e-5)


def test_rms_norm_second_derivative_raises_instead_of_being_wrong():
    # the closed-form backward is computed from saved x̂, 1/rms: differentiating it again would miss
    # their dependence on x, so it must refuse; float64 (F.rms_norm) gives the true second derivative
    x = torch.randn(3, 8, requires_grad=True)
    (g,) = torch.autograd.grad(rms_norm(x, None, 1e-6).pow(3).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()
    x64 = x.detach().double().requires_grad_()
    (g64,) = torch.autograd.grad(rms_norm(x64, None, 1e-6).pow(3).sum(), x64, create_graph=True)
    g64.sum().backward()
    ref = x.detach().double().requires_grad_()
    (g_ref,) = torch.autograd.grad(_rms_reference(ref, None, 1e-6).pow(3).sum(), ref, create_graph=True)
    g_ref.sum().backward()
    torch.testing.assert_close(x64.grad, ref.grad, rtol=1e-5, atol=1e-6)


def test_rotary_backward_is_the_exact_gradient_and_matches_rotate_half():
    tables = RotaryTables(n_ctx=8, d_head=6, base=10000.0)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 8, 3, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    cos, sin, back = (t[:, None, :].double() for t in (tables.cos, tables.signed_sin, tables.signed_sin_back))
    assert torch.autograd.gradcheck(lambda t: rotary_mod._RotaryFunction.apply(t, cos, sin, back), (x,))
    # the fast path (float32, with a gradient) and the plain one against the rotate-half formula
    angles = torch.outer(torch.arange(8, dtype=torch.float64), 1.0 / 10000.0 ** (torch.arange(0, 6, 2, dtype=torch.float64) / 6))
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]
    x32 = x.detach().float().requires_grad_()
    dy = torch.randn(2, 8, 3, 6, generator=gen)
    fast = rope(x32, tables.cos, tables.signed_sin, tables.signed_sin_back)
    assert fast.grad_fn.name().startswith("_RotaryFunction")
    fast.backward(dy)
    with torch.no_grad():
        plain = rope(x32, tables.cos, tables.signed_sin, tables.signed_sin_back)
    x64 = x.detach().clone().requires_grad_()
    ref = _rotate_half_reference(x64, angles.cos(), angles.sin())
    ref.backward(dy.double())
    torch.testing.assert_close(fast.detach().double(), ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(plain.double(), ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x32.grad.double(), x64.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("variant", ["baseline", "headwise_rms", "qk_norm"])
def test_model_gradients_do_not_depend_on_the_cpu_kernels(variant, monkeypatch):
    # the whole model with the RMSNorm and rotary kernels on, then off (F.rms_norm and autograd)
    counts = {"rms": 0, "rope": 0}
    for mod, cls, key in ((rms_norm_mod, rms_norm_mod._RMSNormFunction, "rms"), (rotary_mod, rotary_mod._RotaryFunction, "rope")):
        real = cls.apply
        monkeypatch.setattr(cls, "apply", lambda *a, _real=real, _key=key: counts.__setitem__(_key, counts[_key] + 1) or _real(*a))
    torch.manual_seed(8)
    options = {"init": "ones"} if variant == "headwise_rms" else {}
    model = SinkLM(ModelConfig.from_preset("tiny", variant=variant, variant_options=options, n_ctx=16, d_vocab=32))
    with torch.no_grad():  # gains away from 1, so a wrong gain gradient shows
        for name, p in model.named_parameters():
            if p.ndim <= 2 and ("ln" in name or "gain" in name):
                p.mul_(torch.rand_like(p) + 0.5)
    tokens = torch.randint(0, 32, (3, 12))
    results = {}
    for path in ("fast", "plain"):
        if path == "plain":
            for mod in (rms_norm_mod, rotary_mod):
                monkeypatch.setattr(mod, "eager_cpu_float32", lambda *t: False)
        model.zero_grad()
        logits = model(tokens)
        next_token_loss(logits[:, :-1], tokens[:, 1:]).backward()
        results[path] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        if path == "fast":
            n = model.cfg.n_layers
            extra = {"baseline": 0, "headwise_rms": n, "qk_norm": 2 * n}[variant]
            assert counts == {"rms": 2 * n + 1 + extra, "rope": 2 * n}, counts
    (got, grads), (ref, ref_grads) = results["fast"], results["plain"]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # torch's vmap fallback for SDPA
def test_torch_func_transforms_run_through_the_plain_ops():
    # torch.func.grad / vmap cannot run autograd functions without setup_context: the CPU kernels
    # (oneDNN matmul, RMSNorm, RoPE) must stand aside there, and the gradients must be the same
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(9)
    model = SinkLM(ModelConfig.from_preset("tiny", variant="headwise_rms", n_ctx=16, d_vocab=32))
    params = {name: p.detach() for name, p in model.named_parameters()}
    tokens = torch.randint(0, 32, (3, 8))

    def loss(p, rows):
        return next_token_loss(functional_call(model, p, (rows,))[:, :-1], rows[:, 1:])

    got = grad(loss)(params, tokens)
    next_token_loss(model(tokens)[:, :-1], tokens[:, 1:]).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    per_sequence = vmap(grad(loss), in_dims=(None, 0))(params, tokens[:, None])  # per-example gradients
    for name in params:
        torch.testing.assert_close(per_sequence[name].mean(0), got[name], rtol=1e-4, atol=1e-6, msg=name)


def test_cpu_kernels_stand_aside_without_a_gradient_or_under_autocast(monkeypatch):
    calls = []
    for cls in (rms_norm_mod._RMSNormFunction, rotary_mod._RotaryFunction):
        real = cls.apply
        monkeypatch.setattr(cls, "apply", lambda *a, _real=real: calls.append(1) or _real(*a))
    model = SinkLM(ModelConfig.from_preset("tiny", n_ctx=16, d_vocab=32))
    tokens = torch.randint(0, 32, (2, 8))
    with torch.no_grad():
        model(tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens)
    assert calls == []
    model(tokens)
    assert calls  # and with a gradient they run


# ---------------------------------------------------------------- oneDNN matmul (sinklens.sinklm.matmul)


@pytest.fixture
def restore_backend():
    before = matmul_mod.cpu_matmul_backend()["requested"]
    yield
    matmul_mod.set_cpu_matmul(before)


def _count_onednn_calls(monkeypatch) -> list[int]:
    calls = [0]
    real = matmul_mod._linear

    def spy(x, weight):
        calls[0] += 1
        return real(x, weight)

    monkeypatch.setattr(matmul_mod, "_linear", spy)
    return calls


def test_auto_uses_onednn_where_torch_has_it(restore_backend):
    # the CI machine is x86-64 Linux with a oneDNN build of torch: auto must pick it there
    has_it = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    assert matmul_mod.set_cpu_matmul("auto") == ("onednn" if has_it else "aten")
    assert matmul_mod.cpu_matmul_backend()["reason"] is None if has_it else "oneDNN" in matmul_mod.cpu_matmul_backend()["reason"]


@pytest.mark.parametrize("shape", [(5, 24), (2, 7, 24)])
def test_onednn_matmul_and_its_gradients_match_a_float64_product(shape, restore_backend, monkeypatch):
    if matmul_mod.set_cpu_matmul("auto") != "onednn":
        pytest.skip("this torch build has no oneDNN inner product")
    calls = _count_onednn_calls(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(*shape, generator=gen, requires_grad=True)
    w_t = torch.randn(40, 24, generator=gen, requires_grad=True)  # w = w_tᵀ: a transposed (strided) weight
    g = torch.randn(*shape[:-1], 40, generator=gen)
    out = matmul_mod.matmul(x, w_t.T)
    out.backward(g)
    assert calls[0] == 2  # forward and input gradient went through oneDNN
    x64, w64 = x.detach().double(), w_t.detach().double().T
    torch.testing.assert_close(out.detach().double(), x64 @ w64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), g.double() @ w64.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w_t.grad.double(), (x64.reshape(-1, 24).T @ g.double().reshape(-1, 40)).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt2"])
def test_model_logits_and_gradients_do_not_depend_on_the_matmul_backend(preset, restore_backend, monkeypatch):
    if matmul_mod.set_cpu_matmul("auto") != "onednn":
        pytest.skip("this torch build has no oneDNN inner product")
    calls = _count_onednn_calls(monkeypatch)
    torch.manual_seed(4)
    model = SinkLM(ModelConfig.from_preset(preset, variant="headwise_rms", n_ctx=16, d_vocab=32))
    tokens = torch.randint(0, 32, (3, 12))
    results = {}
    for backend in ("aten", "onednn"):
        matmul_mod.set_cpu_matmul(backend)
        calls[0] = 0
        model.zero_grad()
        logits = model(tokens)
        next_token_loss(logits[:, :-1], tokens[:, 1:]).backward()
        results[backend] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, calls[0])
    (ref, ref_grads, aten_calls), (got, grads, onednn_calls) = results["aten"], results["onednn"]
    assert aten_calls == 0
    # per layer: qkv, W_O, the MLP's products (W_gate, W_in, W_out or W_in, W_out); plus the
    # unembedding — the forward and the input gradient of each
    per_layer = 5 if preset == "tiny" else 4
    assert onednn_calls == 2 * (per_layer * model.cfg.n_layers + 1)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_cpu_matmul_errors_name_the_value_and_the_reason(restore_backend, monkeypatch):
    with pytest.raises(InvalidArgumentError, match=r"cpu_matmul must be one of .*'mkl'"):
        matmul_mod.set_cpu_matmul("mkl")
    monkeypatch.setattr(matmul_mod, "_onednn_problem", lambda: "this torch build has no oneDNN (mkldnn)")
    with pytest.raises(InvalidArgumentError, match=r"cpu_matmul='onednn' is not available: this torch build has no oneDNN"):
        matmul_mod.set_cpu_matmul("onednn")
    assert matmul_mod.set_cpu_matmul("auto") == "aten"  # auto falls back and says why
    assert matmul_mod.cpu_matmul_backend()["reason"] == "this torch build has no oneDNN (mkldnn)"
    x, w = torch.randn(3, 8), torch.randn(8, 5)
    torch.testing.assert_close(matmul_mod.matmul(x, w), x @ w)


def test_train_runs_on_the_configured_backend_and_restores_the_previous_one(restore_backend, monkeypatch):
    matmul_mod.set_cpu_matmul("auto")
    calls = _count_onednn_calls(monkeypatch)
    result = train(build_cfg(steps=2, cpu_matmul="aten"), progress=False)
    assert result.cpu["matmul"] == "aten" and calls[0] == 0
    assert result.cpu["retained_memory"] == (_glibc() is not None)
    assert matmul_mod.cpu_matmul_backend()["requested"] == "auto"  # restored after the run
    if matmul_mod.cpu_matmul_backend()["resolved"] == "onednn":
        result = train(build_cfg(steps=2), progress=False)
        assert result.cpu["matmul"] == "onednn" and calls[0] > 0


# ---------------------------------------------------------------- kept heap memory (sinklens.train.allocator)

_FAULTS = """
import resource, torch
from sinklens.train.allocator import retained_cpu_memory
from sinklens.sinklm.config import ModelConfig
from sinklens.sinklm.model import SinkLM
torch.manual_seed(0)
model = SinkLM(ModelConfig.from_preset("tiny", n_ctx=256, d_vocab=64))
tokens = torch.randint(0, 64, (32, 256))
def faults():  # minor page faults of one training step's forward and backward
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    model(tokens, return_type="loss").backward()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults()
plain = min(faults() for _ in range(3))  # the steadiest of three steps
with retained_cpu_memory() as active:
    faults()  # the first step maps the heap once
    kept = min(faults() for _ in range(3))
print(active, plain, kept)
"""


@pytest.mark.skipif(_glibc() is None, reason="glibc only")
def test_retained_memory_stops_the_per_step_page_faults():
    # glibc's default threshold, fixed (its dynamic raise depends on the order of earlier frees): every
    # freed block of >= 128 KiB is unmapped, as in a long CPU run's steady state
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    out = subprocess.run([sys.executable, "-c", _FAULTS], capture_output=True, text=True, check=True, env=env).stdout.split()
    active, plain, kept = out[0] == "True", int(out[1]), int(out[2])
    assert active
    assert plain > 2000, plain  # freed activations are unmapped, so every step faults them in again
    assert kept < plain / 20, (plain, kept)  # kept mapped: a step takes ~1 fault (92,500 without)



_COMPILED_PRODUCTS = r"""
import json
import torch
from sinklens.sinklm import matmul as mm
from sinklens.sinklm.config import ModelConfig
from sinklens.sinklm.model import SinkLM, next_token_loss

out = {"resolved_at_import": mm._backend["resolved"]}
ops = []
def backend(gm, example_inputs):  # dynamo's graph as traced, run as it is (no inductor)
    ops.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
    return gm.forward

torch.manual_seed(5)
model = SinkLM(ModelConfig.from_preset("tiny", variant="headwise_rms", n_ctx=16, d_vocab=32))
tokens = torch.randint(0, 32, (3, 12))
out["has_onednn"] = mm._onednn_problem() is None and mm._onednn_mm is not None
grads = {}
for name in ("onednn", "aten"):  # first as a fresh process compiles, before anything set a backend
    if name == "aten":
        mm.set_cpu_matmul("aten")
    torch._dynamo.reset()
    ops.clear()
    model.zero_grad()
    logits = torch.compile(model, backend=backend)(tokens)
    next_token_loss(logits[:, :-1], tokens[:, 1:]).backward()
    out[name] = {"graphs": len(ops), "onednn_ops": sum(g.count("sinklens.onednn_mm.default") for g in ops)}
    grads[name] = [logits.detach()] + [p.grad.clone() for p in model.parameters()]
mm.set_cpu_matmul("auto")
exported = torch.export.export(model.eval(), (tokens,))  # a program that loads without sinklens
out["exported_ops"] = sorted({str(n.target) for n in exported.graph.nodes if "sinklens" in str(n.target)})
out["max_diff"] = max(float((a - b).abs().max() / (b.abs().max() + 1e-6)) for a, b in zip(grads["aten"], grads["onednn"]))
mm.set_cpu_matmul("auto")
ops.clear()
torch._dynamo.reset()
f = torch.compile(mm.matmul, backend=backend)
x, w = torch.randn(4, 8), torch.randn(8, 3)
with torch.autocast("cpu", dtype=torch.bfloat16):
    f(x, w)
f(x.double(), w.double())
out["other_dtypes_ops"] = sum(g.count("sinklens.onednn_mm.default") for g in ops)
out["other_dtypes_graphs"] = len(ops)
print(json.dumps(out))
"""


def test_a_compiled_model_keeps_the_onednn_products_in_one_graph():
    # torch.compile must see each oneDNN product as one custom operator (not trace it back to aten::mm),
    # in a single graph with no break (also in a fresh process, where the backend's self-check must not
    # run inside the trace), and give the aten backend's logits and gradients; under autocast, for
    # float64 and in torch.export the products stay on aten. In a subprocess: pytest's jaxtyping/beartype
    # instrumentation of sinklens is not traceable by dynamo.
    import json

    done = subprocess.run([sys.executable, "-c", _COMPILED_PRODUCTS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if not out["has_onednn"]:
        pytest.skip("no oneDNN inner product or no torch.library.custom_op in this torch")
    assert out["resolved_at_import"] == "onednn"  # resolved at import, never by a self-check inside a trace
    assert out["aten"] == {"graphs": 1, "onednn_ops": 0}
    # qkv, W_O, gate, in, out per layer (2 layers) and the unembedding
    assert out["onednn"] == {"graphs": 1, "onednn_ops": 5 * 2 + 1}
    assert out["max_diff"] < 1e-4
    assert out["other_dtypes_graphs"] >= 2 and out["other_dtypes_ops"] == 0
    assert out["exported_ops"] == []  # torch.export keeps aten's products
