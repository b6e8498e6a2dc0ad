"""SinkLM: TransformerLens hook/weight contract, loss, configs, training helpers, analyzers on it."""

from __future__ import annotations

import math

import pytest
import torch

from sinklens.analysis.attention import AttentionReceivedReducer
from sinklens.errors import InvalidArgumentError
from sinklens.inputs import random_token_batches
from sinklens.options import RunOptions
from sinklens.streaming import stream
from sinklens.sinklm.functional import next_token_loss, rope, rotary_tables
from sinklens.sinklm.model import LayerNorm, RMSNorm, SinkLM
from sinklens.sinklm.variants import rms_norm
from sinklens.sinklm.config import PRESETS, ModelConfig

TINY = dict(n_layers=2, d_model=16, n_heads=4, n_kv_heads=2, d_mlp=32, n_ctx=16, d_vocab=32)


def build(family="llama", seed=0, **overrides) -> SinkLM:
    torch.manual_seed(seed)
    return SinkLM(ModelConfig(family=family, **{**TINY, **overrides}))


def tokens(batch=3, pos=12, d_vocab=32, seed=1):
    return torch.randint(0, d_vocab, (batch, pos), generator=torch.Generator().manual_seed(seed))


PER_LAYER = [
    "hook_resid_pre", "ln1.hook_normalized", "ln1.hook_scale", "attn.hook_q", "attn.hook_k", "attn.hook_v",
    "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z", "hook_attn_out", "hook_resid_mid",
    "ln2.hook_normalized", "ln2.hook_scale", "mlp.hook_pre", "mlp.hook_post", "hook_mlp_out", "hook_resid_post",
]  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hook_names_and_cache_shapes_follow_transformerlens(family):
    model = build(family)
    B, T = 3, 12
    H, Hkv, dh, D, M = 4, 2, 4, 16, 32
    expected = {"hook_embed": (B, T, D), "ln_final.hook_normalized": (B, T, D), "ln_final.hook_scale": (B, T, 1)}
    if family == "gpt2":
        expected["hook_pos_embed"] = (B, T, D)
    else:
        expected |= {f"blocks.{l}.{s}": (B, T, H if s.endswith("q") else Hkv, dh) for l in range(2) for s in ("attn.hook_rot_q", "attn.hook_rot_k")}
        expected |= {f"blocks.{l}.mlp.hook_pre_linear": (B, T, M) for l in range(2)}
    shapes = {
        "attn.hook_q": (B, T, H, dh), "attn.hook_k": (B, T, Hkv, dh), "attn.hook_v": (B, T, Hkv, dh),
        "attn.hook_attn_scores": (B, H, T, T), "attn.hook_pattern": (B, H, T, T), "attn.hook_z": (B, T, H, dh),
        "mlp.hook_pre": (B, T, M), "mlp.hook_post": (B, T, M), "ln1.hook_scale": (B, T, 1), "ln2.hook_scale": (B, T, 1),
    }  # fmt: skip
    for layer in range(2):
        for site in PER_LAYER:
            expected[f"blocks.{layer}.{site}"] = shapes.get(site, (B, T, D))
    assert set(expected) == set(model.hook_dict)
    _, cache = model.run_with_cache(tokens(B, T))
    assert {name: tuple(cache[name].shape) for name in expected} == expected


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_weight_properties_have_transformerlens_shapes_and_drive_the_hooks(family):
    model = build(family)
    L, H, Hkv, dh, D, M, V = 2, 4, 2, 4, 16, 32, 32
    assert model.W_Q.shape == (L, H, D, dh) and model.W_O.shape == (L, H, dh, D)
    assert model.W_K.shape == model.W_V.shape == (L, Hkv, D, dh)
    assert model.W_in.shape == (L, D, M) and model.W_out.shape == (L, M, D)
    assert model.W_E.shape == (V, D) and model.W_U.shape == (D, V)
    assert model.b_O.shape == model.b_out.shape == (L, D) and model.b_V.shape == (L, Hkv, dh)
    assert (model.W_gate is None) == (family == "gpt2")
    if family == "llama":
        assert model.W_gate.shape == (L, D, M)
    with torch.no_grad():  # gains and biases away from 1 and 0: the attention reads w ⊙ hook_normalized (+ b)
        for block in model.blocks:
            block.ln1.w.uniform_(0.5, 2.0)
            if family == "gpt2":
                block.ln1.b.normal_()
    _, cache = model.run_with_cache(tokens())
    for layer in range(L):
        ln1 = model.blocks[layer].ln1
        x = cache[f"blocks.{layer}.ln1.hook_normalized"] * ln1.w + (ln1.b if family == "gpt2" else 0)
        q = torch.einsum("bpd,hdk->bphk", x, model.W_Q[layer]) + model.b_Q[layer]
        v = torch.einsum("bpd,hdk->bphk", x, model.W_V[layer]) + model.b_V[layer]
        torch.testing.assert_close(cache[f"blocks.{layer}.attn.hook_q"], q)
        torch.testing.assert_close(cache[f"blocks.{layer}.attn.hook_v"], v)
        # z is the value aggregation: query head h reads kv head h // 2
        z = torch.einsum("bhqk,bkhd->bqhd", cache[f"blocks.{layer}.attn.hook_pattern"], v.repeat_interleave(2, dim=2))
        torch.testing.assert_close(cache[f"blocks.{layer}.attn.hook_z"], z)
        out = torch.einsum("bphk,hkd->bpd", z, model.W_O[layer]) + model.b_O[layer]
        torch.testing.assert_close(cache[f"blocks.{layer}.hook_attn_out"], out)
        post = cache[f"blocks.{layer}.mlp.hook_post"]
        torch.testing.assert_close(cache[f"blocks.{layer}.hook_mlp_out"], post @ model.W_out[layer] + model.b_out[layer])
    torch.testing.assert_close(cache["hook_embed"], model.W_E[tokens()])


def test_loss_is_mean_next_token_cross_entropy():
    model = build()
    toks = tokens()
    logits, loss = model(toks, return_type="both")
    manual = -torch.log_softmax(logits, -1)[:, :-1].gather(-1, toks[:, 1:, None]).mean()
    torch.testing.assert_close(loss, manual)
    torch.testing.assert_close(model(toks, return_type="loss"), manual)
    assert model(toks, return_type=None) is None


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_initialisation_scales(family):
    model = build(family, n_layers=8, d_model=64, n_heads=4, n_kv_heads=4, d_mlp=256, d_vocab=256, init_std=0.05)
    torch.testing.assert_close(model.W_Q.std(), torch.tensor(0.05), rtol=0.05, atol=0)
    torch.testing.assert_close(model.W_out.std(), torch.tensor(0.05 / math.sqrt(16)), rtol=0.05, atol=0)
    torch.testing.assert_close(model.W_O.std(), torch.tensor(0.05 / math.sqrt(16)), rtol=0.05, atol=0)


def test_intervention_on_scores_masks_the_first_key_during_training():
    model = build()
    model.train()
    toks = tokens()

    def no_first_key(scores, hook):
        scores[:, :, 1:, 0] = float("-inf")
        return scores

    hooks = [(f"blocks.{l}.attn.hook_attn_scores", no_first_key) for l in range(2)]
    with model.hooks(fwd_hooks=hooks):
        _, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_pattern"))
        loss = model(toks, return_type="loss")
    loss.backward()
    assert model.blocks[0].attn.W_Q.grad is not None and torch.isfinite(loss)
    for layer in range(2):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
        assert (pattern[:, :, 1:, 0] == 0).all()
        torch.testing.assert_close(pattern.sum(-1), torch.ones(3, 4, 12))
    assert not torch.allclose(loss, model(toks, return_type="loss"))
    assert all(not hp.fwd_hooks for hp in model.hook_dict.values())


def test_hooks_are_removed_when_a_hook_raises():
    model = build()

    def boom(act, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model.run_with_hooks(tokens(), fwd_hooks=[("blocks.1.attn.hook_pattern", boom)])
    assert all(not hp.fwd_hooks for hp in model.hook_dict.values())


def test_bad_configs_raise_clear_errors():
    with pytest.raises(ValueError, match="n_heads=5 does not divide d_model=16"):
        ModelConfig(d_model=16, n_heads=5)
    with pytest.raises(ValueError, match="n_kv_heads=3 must divide n_heads=4"):
        ModelConfig(d_model=16, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match=r"Unknown attention variant 'softmax2'.*'baseline'.*'headwise_rms'"):
        ModelConfig(variant="softmax2")
    with pytest.raises(ValueError, match=r"Unknown option\(s\) \['gian'\]"):
        ModelConfig(variant="headwise_rms", variant_options={"gian": "shared"})
    with pytest.raises(ValueError, match="Unknown model preset 'huge'"):
        ModelConfig.from_preset("huge")
    with pytest.raises(TypeError, match="ModelConfig"):
        SinkLM({"d_model": 16})
    with pytest.raises(InvalidArgumentError, match="exceeds the model's context window n_ctx=16"):
        build()(tokens(1, 17))


def test_config_roundtrip_and_state_dict_reload_reproduce_logits():
    model = build(variant="headwise_rms", variant_options={"gain": "shared"})
    cfg = ModelConfig.from_dict(model.cfg.to_dict())
    assert cfg == model.cfg and cfg.n_key_value_heads == 2 and cfg.d_head == 4
    torch.manual_seed(123)
    clone = SinkLM(cfg)
    assert not torch.allclose(clone(tokens()), model(tokens()))
    clone.load_state_dict(model.state_dict())
    torch.testing.assert_close(clone(tokens()), model(tokens()))


def test_presets():
    cfg = ModelConfig.from_preset("124m")
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_ctx, cfg.d_vocab) == (12, 768, 12, 1024, 50304)
    assert ModelConfig.from_preset("tiny", n_layers=3).n_layers == 3
    assert set(PRESETS) >= {"tiny", "small", "124m"}
    # a 124M-class llama: 12 × (4·768² attention + 3·768·2048 SwiGLU + 2·768 norms) + 50304·768 + 768
    d, m = 768, cfg.d_mlp
    assert m == 2048
    expected = 12 * (4 * d * d + 3 * d * m + 2 * d) + 50304 * d + d
    assert 120e6 < expected < 130e6
    torch.manual_seed(0)
    with torch.device("meta"):
        big = SinkLM(ModelConfig.from_preset("124m", variant="baseline"))
    assert big.num_params() == expected


def test_param_groups_num_params_and_flops():
    model = build(variant="headwise_rms")
    decay, no_decay = model.param_groups(0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = lambda group: {id(p) for p in group["params"]}  # noqa: E731
    assert ids(decay) | ids(no_decay) == {id(p) for p in model.parameters()}
    assert not ids(decay) & ids(no_decay)
    assert all(p.ndim >= 2 for p in decay["params"])
    gain = model.blocks[0].attn.variant.gain
    assert gain.ndim == 2 and id(gain) in ids(no_decay)  # head-wise gains are never decayed
    assert id(model.W_E) in ids(decay) and id(model.blocks[0].ln1.w) in ids(no_decay)
    n = sum(p.numel() for p in model.parameters())
    assert model.num_params() == n
    assert model.flops_per_token() == 6 * n + 12 * 2 * 4 * 4 * 16
    assert model.flops_per_token(8) == 6 * n + 12 * 2 * 4 * 4 * 8


def test_gpt2_flops_leave_out_the_position_table():
    model = build("gpt2")
    n = sum(p.numel() for p in model.parameters())
    assert model.flops_per_token() == 6 * (n - 16 * 16) + 12 * 2 * 4 * 4 * 16


def test_bf16_autocast_forward_and_backward():
    model = build(variant="gated")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens(), return_type="loss")
    loss.backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, model(tokens(), return_type="loss"), atol=0.02, rtol=0)


@pytest.mark.parametrize("variant", ["baseline", "sink_logit"])
def test_attention_received_reducer_streams_on_sinklm(variant):
    model = build(variant=variant)
    batches = random_token_batches(model, n_sequences=5, seq_len=10, batch_size=2, seed=3)
    (got,) = stream(model, batches, [AttentionReceivedReducer(model, min_query=2)], options=RunOptions(progress=False))
    toks = torch.cat([b.tokens for b in batches])
    _, cache = model.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_pattern"))
    for layer in range(2):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"].double()  # [batch, head, q, k]
        for k in range(10):
            queries = range(max(k, 2), 10)
            ref = torch.stack([pattern[:, :, q, k] for q in queries]).mean(dim=(0, 1))
            torch.testing.assert_close(got.received[layer, :, k], ref.float(), rtol=1e-5, atol=1e-6)


_COMPILE_SCRIPT = """
import torch
from sinklens.sinklm.model import SinkLM
from sinklens.sinklm.config import ModelConfig
torch.manual_seed(0)
model = SinkLM(ModelConfig(variant="headwise_rms", n_layers=2, d_model=16, n_heads=4, n_kv_heads=2, n_ctx=16, d_vocab=32))
toks = torch.randint(0, 32, (2, 12))
compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # fullgraph: fails on any graph break
loss = compiled(toks, return_type="loss")
loss.backward()
assert model.blocks[0].attn.variant.gain.grad is not None
assert torch.allclose(loss, model(toks, return_type="loss"))
# the trainer's call: the loss (float32 upcast and all) inside the one graph, under bf16 autocast too
with torch.autocast("cpu", dtype=torch.bfloat16):
    step = compiled(toks[:, :-1], return_type="loss", targets=toks[:, 1:])
    explained = torch._dynamo.explain(model)(toks[:, :-1], return_type="loss", targets=toks[:, 1:])
assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained
assert any("cross_entropy" in str(n.target) for n in explained.graphs[0].graph.nodes)
assert step.dtype == torch.float32
print("ok")
"""


@pytest.mark.slow
def test_torch_compile_captures_one_graph():
    # in a subprocess: pytest's jaxtyping/beartype instrumentation of sinklens is not traceable by dynamo
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


# ---------------------------------------------------------------- norms, RoPE: fast and hooked paths


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


def test_loss_with_targets_is_the_mean_cross_entropy_of_every_position():
    model = build(seed=4)
    rows = tokens(batch=2, pos=9)
    inputs, targets = rows[:, :-1], rows[:, 1:]
    got = model(inputs, return_type="loss", targets=targets)
    logp = torch.log_softmax(model(inputs).double(), dim=-1)  # independent float64 reference
    ref = -logp.gather(-1, targets[..., None]).mean()
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(got, next_token_loss(model(inputs), targets))  # the same number the evaluation reports


def test_rope_matches_the_rotate_half_formula_in_float64():
    # Llama / TransformerLens RoPE: x·cos(tθ) + rotate_half(x)·sin(tθ), θ_i = base^(-2i/d), independent float64
    cos, sin = rotary_tables(n_ctx=8, d_head=6, base=10000.0)
    x = torch.randn(2, 8, 3, 6, generator=torch.Generator().manual_seed(7))
    angles = torch.outer(torch.arange(8, dtype=torch.float64), 1.0 / 10000.0 ** (torch.arange(0, 6, 2, dtype=torch.float64) / 6))
    x1, x2 = x.double().chunk(2, dim=-1)
    c, s = angles.cos()[:, None], angles.sin()[:, None]
    ref = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    torch.testing.assert_close(rope(x, cos, sin).double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rope(x.double(), cos, sin), ref, rtol=0, atol=1e-12)


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # torch's vmap fallback for SDPA
def test_torch_func_transforms_run_through_the_plain_ops():
    # torch.func.grad / vmap run through the model and give autograd's gradients
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
