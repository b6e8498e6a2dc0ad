"""Activation patching on every family of the zoo: each site patches what it names, or is refused.

Two checks. On every family and site, a known answer: the intervention offsets one component (one position,
or one head) of layer 0 at the very hook the site is patched at, so patching that component back restores the
clean run bit for bit (``restored`` exactly 1) and patching any other component of layer 0 leaves the
intervened run (exactly 0); a hook that is only a report, or an index on the wrong axis, fails it. Then, on the
post-LN BERT, *where* the patch lands: the 4.x bridge fires ``hook_attn_out`` with ``ln1``'s output (residual
included) and ``hook_resid_mid`` after the MLP, so there the reference patches the plain Hugging Face modules
(``attention.output.dense``, the write, and ``attention.output.LayerNorm``, the residual after attention) with
torch forward hooks, and reads the metric from the patterns (the bridge's ``hook_resid_mid`` patches the
same thing as the residual after attention, since everything between them acts on one position at a time); under
3.x the ``HookedEncoder``'s own ``hook_attn_out`` and ``hook_resid_mid`` (which fire before ``ln1``) are the
reference. A parallel block (GPT-NeoX/Pythia) has no residual between attention and MLP: ``resid_mid`` is refused.
"""

from __future__ import annotations

import pytest
import torch

from sinklens.errors import UnsupportedArchitectureError
from sinklens.probes import resid_mid_is_a_copy
from sinklens.interventions.patching import patch_hook_names, patch_sink
from support.zoo import FAMILIES, FamilyUnavailableError, zoo_model

from _zoo_reference import TL4
from support.models import tl3_encoder

pytestmark = pytest.mark.models

TARGET = 0
POS_SITES = ("resid_pre", "resid_mid", "attn_out", "mlp_out")
PARALLEL = {"neox"}


def _model(family: str):
    try:
        return zoo_model(family)
    except FamilyUnavailableError as err:
        pytest.skip(str(err))


def _tokens(model, n_batch: int = 2, n_pos: int = 6) -> torch.Tensor:
    gen = torch.Generator().manual_seed(4)
    return torch.randint(5, model.cfg.d_vocab, (n_batch, n_pos), generator=gen)


def _offset_hook(index: tuple, scale: float = 3.0):
    """A hook that adds ``scale`` times the activation's own std at ``act[:, *index]`` (a sign pattern over the last axis)."""

    def hook(act, hook):
        out = act.clone()
        signs = torch.ones(act.shape[-1], dtype=act.dtype, device=act.device)
        signs[::2] = -1.0
        out[(slice(None), *index)] += scale * act.std() * signs
        return out

    return hook


@pytest.mark.parametrize("site", [*POS_SITES, "z", "z_pos"])
@pytest.mark.parametrize("family", FAMILIES)
def test_patching_the_offset_component_restores_the_clean_run_exactly(family, site):
    model = _model(family)
    tokens = _tokens(model)
    if site == "resid_mid" and family in PARALLEL:
        with pytest.raises(UnsupportedArchitectureError, match="parallel block"):
            patch_sink(model, tokens, [], site=site, layers=0)
        return
    (name,) = patch_hook_names(model, site, [0]).values()
    pos, head = 2, 1
    index = {"z": (slice(None), head), "z_pos": (pos, head)}.get(site, (pos,))
    result = patch_sink(model, tokens, [(name, _offset_hook(index))], target=TARGET, site=site, layers=0,
                        positions=[1, pos, 4] if site != "z" else None, heads=[0, head, 2] if "z" in site else None)
    assert result.clean != result.intervened
    hit = {"z": (0, 1), "z_pos": (0, 1, 1)}.get(site, (0, 1))
    clean, intervened = (torch.tensor(v, dtype=result.values.dtype) for v in (result.clean, result.intervened))
    if site == "resid_mid" and resid_mid_is_a_copy(model):  # patched through the attention write: float rounding
        assert float(result.values[hit]) == pytest.approx(result.clean, rel=1e-5)
    else:  # the clean run, bit for bit: values are float64 like clean (float32 values gave restored 0.99363)
        assert result.values[hit] == clean and float(result.restored[hit]) == 1.0
    others = torch.ones_like(result.values, dtype=torch.bool)
    others[hit] = False
    assert bool((result.values[others] == intervened).all()), (result.values, intervened)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in PARALLEL and f != "bert"])
def test_a_resid_mid_patch_patches_the_residual_stream(family):
    """Offset layer 0's attention write at position 2: patching ``resid_mid`` there gives back the clean run, since
    the residual after the attention carries the patch on. On the 4.x bridges ``hook_resid_mid`` is a copy the block
    does not carry on from (``resid_mid_is_a_copy``), where a patch at the hook itself only reached the MLP (restored
    −0.15 on the tiny Llama), so patch_sink applies it through the write; other positions stay as intervened."""
    model = _model(family)
    tokens = _tokens(model)
    offset = [("blocks.0.hook_attn_out", _offset_hook((2,)))]
    result = patch_sink(model, tokens, offset, target=TARGET, site="resid_mid", layers=0, positions=[1, 2, 4])
    assert result.clean != result.intervened
    assert result.restored[0].tolist() == pytest.approx([0.0, 1.0, 0.0], abs=1e-4)
    attn_out = patch_sink(model, tokens, offset, target=TARGET, site="attn_out", layers=0, positions=[1, 2, 4])
    assert result.values[0].tolist() == pytest.approx(attn_out.values[0].tolist(), rel=1e-5)


def _metric(patterns: list[torch.Tensor], target: int) -> float:
    """Mean attention the target receives from the queries after it: over batch and queries, then heads and layers."""
    return float(torch.stack([p[:, :, target + 1:, target].double().mean((0, 2)) for p in patterns]).mean())


def _patched_metric(model, tokens, intervention, patch, target: int) -> float:
    """Run with ``intervention`` (TransformerLens hooks) and ``patch`` (a callable attaching, and returning handles
    of, whatever patch the reference makes), and read the metric from every layer's ``hook_pattern``."""
    patterns: list[torch.Tensor] = []
    keep = [(f"blocks.{i}.attn.hook_pattern", lambda act, hook: patterns.append(act.detach().clone()))
            for i in range(model.cfg.n_layers)]
    handles = patch()
    try:
        with torch.no_grad():
            model.run_with_hooks(tokens, return_type=None, fwd_hooks=intervention + keep)
    finally:
        for handle in handles:
            handle.remove()
    return _metric(patterns, target)


def _capture(model, tokens, modules: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_hook(lambda mod, args, o, key=key: out.__setitem__(key, o.detach().clone()))
               for key, m in modules.items()]
    try:
        with torch.no_grad():
            model(tokens, return_type=None)
    finally:
        for h in handles:
            h.remove()
    return out


@pytest.mark.skipif(not TL4, reason="the 4.x bridge's BERT (3.x: the HookedEncoder test below)")
@pytest.mark.parametrize("site", ["attn_out", "resid_mid"])
def test_bert_bridge_patches_the_attention_write_and_the_residual_after_it(site):
    model = _model("bert")
    tokens = _tokens(model, n_batch=3, n_pos=7)
    layer_modules = model.original_model.bert.encoder.layer
    module_of = {"attn_out": lambda i: layer_modules[i].attention.output.dense,
                 "resid_mid": lambda i: layer_modules[i].attention.output.LayerNorm}[site]
    intervention = [("blocks.0.hook_resid_pre", _offset_hook((TARGET,), scale=4.0))]
    layers = list(range(model.cfg.n_layers))
    positions = [0, 1, 3]
    clean = _capture(model, tokens, {str(i): module_of(i) for i in layers})
    result = patch_sink(model, tokens, intervention, target=TARGET, site=site, positions=positions)
    for li, layer in enumerate(layers):
        for pi, pos in enumerate(positions):
            def patch(layer=layer, pos=pos):
                def replace(mod, args, out):
                    out = out.clone()
                    out[:, pos] = clean[str(layer)][:, pos]
                    return out

                return [module_of(layer).register_forward_hook(replace)]

            expected = _patched_metric(model, tokens, intervention, patch, TARGET)
            assert result.values[li, pi].item() == pytest.approx(expected, rel=1e-5, abs=1e-7), (layer, pos)
    assert result.clean == pytest.approx(_patched_metric(model, tokens, [], lambda: [], TARGET), rel=1e-5)


@pytest.mark.skipif(TL4, reason="TransformerLens 3.x HookedEncoder (the 4.x bridge's BERT is checked above)")
@pytest.mark.parametrize("site", ["attn_out", "resid_mid"])
def test_tl3_encoder_patches_the_same_as_its_own_hooks(site):
    """3.x fires ``hook_attn_out`` (the write) and ``hook_resid_mid`` (``resid_pre`` plus it) before ``ln1``; patching
    them there must give what ``patch_sink`` gives (it patches the write at ``attn.hook_z`` on every post-LN model)."""
    model = tl3_encoder()
    tokens = _tokens(model, n_batch=3, n_pos=7)
    intervention = [("blocks.0.hook_resid_pre", _offset_hook((TARGET,), scale=4.0))]
    positions = [0, 1, 3]
    result = patch_sink(model, tokens, intervention, target=TARGET, site=site, positions=positions)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    for layer in range(model.cfg.n_layers):
        name = f"blocks.{layer}.hook_{site}"
        for pi, pos in enumerate(positions):
            def set_clean(act, hook, pos=pos, name=name):
                act = act.clone()
                act[:, pos] = cache[name][:, pos]
                return act

            expected = _patched_metric(model, tokens, intervention + [(name, set_clean)], lambda: [], TARGET)
            assert result.values[layer, pi].item() == pytest.approx(expected, rel=1e-5, abs=1e-7), (layer, pos)
