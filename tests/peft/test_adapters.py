"""Planted answers for the hook-based adapters: prefix-tuning equals a real token prefix, a distilled prefix
finds that known optimum, LoRA and Prefix-Tuning+ start as the identity and match their formulas."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sinklens.errors import InvalidArgumentError, UnsupportedArchitectureError
from sinklens.peft import LoRA, PrefixTuning, PrefixTuningPlus, adapted, make_adapter
from sinklens.testing import tiny_model, transformer_lens_major
from support.checks import no_hooks_left

pytestmark = pytest.mark.models  # also run under TransformerLens 3.x (tests/test_tl3_compat.py)

ZERO_POS = ("hook_pos_embed", lambda x, hook: torch.zeros_like(x))  # no absolute positions: shifting x changes nothing
P = 4


def _real_prefix(model, tokens):
    """Keys and values of ``tokens[0, :P]`` at every layer, and the logits of the full run."""
    kv: dict[tuple[int, str], torch.Tensor] = {}

    def take(name):
        def hook(x, hook):
            kv[name] = x.detach()
        return hook

    hooks = [(f"blocks.{l}.attn.hook_{s}", take((l, s))) for l in range(model.cfg.n_layers) for s in "kv"]
    with model.hooks(fwd_hooks=[ZERO_POS]):
        logits = model.run_with_hooks(tokens, fwd_hooks=hooks)
    stacked = torch.stack([torch.stack([kv[l, "k"][0, :P], kv[l, "v"][0, :P]]) for l in range(model.cfg.n_layers)])
    return stacked, logits


@pytest.fixture(scope="module")
def gpt2():
    return tiny_model("gpt2", n_layers=2, d_model=16, n_heads=4)


def test_prefix_tuning_equals_a_real_token_prefix(gpt2):
    """Attention over [prefix; input] computed at hook_z is exactly the model run on real prefix tokens."""
    tokens = torch.randint(8, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    kv, full = _real_prefix(gpt2, tokens)
    prefix = PrefixTuning(gpt2, P, reparam=False)
    with torch.no_grad():
        prefix.kv.copy_(kv)
    with gpt2.hooks(fwd_hooks=[ZERO_POS]), adapted(gpt2, prefix):
        out = gpt2(tokens[:, P:])
    torch.testing.assert_close(out, full[:, P:], atol=1e-5, rtol=1e-5)
    assert no_hooks_left(gpt2)


def test_prefix_training_finds_the_known_optimum(gpt2):
    """Distilling the real-token run from a perturbed prefix: the KL (0 at the planted prefix) falls by 10x."""
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(8, 64, (1, 12), generator=gen)
    kv, _ = _real_prefix(gpt2, tokens)
    inputs = torch.randint(8, 64, (16, 8), generator=gen)
    with torch.no_grad(), gpt2.hooks(fwd_hooks=[ZERO_POS]):
        teacher = F.log_softmax(gpt2(torch.cat([tokens[:, :P].expand(16, P), inputs], 1))[:, P:], -1)
    prefix = PrefixTuning(gpt2, P, reparam=False)
    with torch.no_grad():
        prefix.kv.copy_(kv + 0.5 * torch.randn(kv.shape, generator=gen))
    opt = torch.optim.Adam(prefix.parameters(), lr=0.02)
    kls = []
    for p in gpt2.parameters():
        p.requires_grad_(False)
    try:
        with gpt2.hooks(fwd_hooks=[ZERO_POS]), adapted(gpt2, prefix):
            for _ in range(60):
                student = F.log_softmax(gpt2(inputs), -1)
                kl = F.kl_div(student, teacher, log_target=True, reduction="batchmean")
                opt.zero_grad()
                kl.backward()
                opt.step()
                kls.append(float(kl.detach()))
    finally:
        for p in gpt2.parameters():
            p.requires_grad_(True)
    assert kls[-1] < kls[0] / 10, kls[::10]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_prefix_plus_and_lora_start_as_the_frozen_model(arch):
    model = tiny_model(arch, n_kv_heads=2 if arch == "llama" else None)
    tokens = torch.randint(8, 64, (2, 9))
    base = model(tokens)
    for adapter in (PrefixTuningPlus(model), LoRA(model, 2)):
        with adapted(model, adapter):
            torch.testing.assert_close(model(tokens), base)


def test_prefix_plus_adds_phi_q_times_m_to_hook_z():
    model = tiny_model("llama")
    tokens = torch.randint(8, 64, (1, 7))
    plus = PrefixTuningPlus(model, init_std=0.3, seed=3)
    seen = {}
    q_name, z_name = "blocks.0.attn.hook_q", "blocks.0.attn.hook_z"  # layer 0: its inputs do not see the adapter
    with model.hooks(fwd_hooks=[(q_name, lambda x, hook: seen.__setitem__("q", x.detach()))]):
        model(tokens)
        with model.hooks(fwd_hooks=[(z_name, lambda x, hook: seen.__setitem__("z0", x.detach()))]):
            model(tokens)
    with adapted(model, plus), model.hooks(fwd_hooks=[(z_name, lambda x, hook: seen.__setitem__("z1", x.detach()))]):
        model(tokens)
    expected = seen["z0"] + torch.einsum("bqhd,hde->bqhe", F.elu(seen["q"]) + 1, plus.memory[0].detach())
    torch.testing.assert_close(seen["z1"], expected)


def test_lora_on_w_o_adds_z_a_b_to_attn_out():
    model = tiny_model("gpt2")
    tokens = torch.randint(8, 64, (1, 6))
    lora = LoRA(model, 2, layers=[0], targets=["W_O"])
    with torch.no_grad():
        lora.B["0_W_O"].normal_()
    seen = {}
    rec = [(f"blocks.0.{s}", lambda x, hook, s=s: seen.__setitem__(s, x.detach())) for s in ("attn.hook_z", "hook_attn_out")]
    with model.hooks(fwd_hooks=rec):
        model(tokens)
    base = dict(seen)
    with adapted(model, lora), model.hooks(fwd_hooks=rec):  # recorders after the adapter's hooks
        model(tokens)
    z = base["attn.hook_z"].flatten(2)
    torch.testing.assert_close(seen["hook_attn_out"], base["hook_attn_out"] + z @ lora.A["0_W_O"] @ lora.B["0_W_O"] * lora.alpha / lora.rank)


def test_bad_adapter_arguments_are_named():
    model = tiny_model()
    with pytest.raises(InvalidArgumentError, match="W_X"):
        LoRA(model, 2, targets=["W_X"])
    with pytest.raises(InvalidArgumentError, match="prefix-minus"):
        make_adapter(model, "prefix-minus")
    with pytest.raises(InvalidArgumentError, match="Layer"):
        PrefixTuning(model, 2, layers=[5])


def test_hooks_are_removed_after_an_error():
    model = tiny_model()
    with pytest.raises(RuntimeError, match="boom"), adapted(model, PrefixTuning(model, 2)):
        raise RuntimeError("boom")
    assert no_hooks_left(model)


@pytest.mark.skipif(transformer_lens_major() < 4, reason="the 4.x bridges of these families")
@pytest.mark.parametrize("family", ["neox", "bert", "gemma2", "gptoss"])
def test_prefix_tuning_refuses_models_whose_softmax_its_hooks_cannot_join(family):
    """GPT-NeoX never runs hook_rot_q, BERT fires its scores after the attention, Gemma 2 soft-caps them and
    gpt-oss adds sink logits: each is refused by name before any hook runs (it crashed or was inexact)."""
    from support.zoo import zoo_model

    model = zoo_model(family)
    with pytest.raises(UnsupportedArchitectureError, match="prefix-tuning cannot run on this model"):
        PrefixTuning(model, n_prefix=2)
    with adapted(model, PrefixTuningPlus(model)):  # outside the softmax: runs
        model(torch.tensor([[2, 3, 4]]))

