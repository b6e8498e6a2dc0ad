"""Contributions in residual units: exact through post norms (Gemma 2/3), act × W_out on pre-norm models."""

import warnings

import pytest
import torch

from sinklens.analysis.neurons import find_super_neurons, mlp_offset, mlp_out_bias, neuron_contributions
from sinklens.errors import UnsupportedArchitectureError
from sinklens.interventions.neurons import edit_neurons
from sinklens.plotting.report import save_report
from sinklens.residual_units import post_norm_map
from sinklens.testing import QUIET
from support.checks import PLANTED_PROMPTS
from support.zoo import POST_NORM_FAMILIES, FamilyUnavailableError, zoo_model

pytestmark = pytest.mark.models

TOKENS = torch.tensor([[0, 5, 9, 13, 17, 21, 25], [0, 30, 8, 8, 40, 2, 3]])


def _zoo(family):
    try:
        return zoo_model(family)
    except FamilyUnavailableError as err:
        pytest.skip(str(err))


def _randomise_post_norms(model, seed=1):
    """Give every post norm a random Gemma weight ``w`` (gain ``1 + w`` far from 1) and W_out large rows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.original_model.model.layers:
            for norm in (block.post_attention_layernorm, block.post_feedforward_layernorm):
                norm.weight.copy_(torch.randn(norm.weight.shape, generator=gen) * 3.0)
    return model


@pytest.fixture(scope="module", params=POST_NORM_FAMILIES)
def post_norm_model(request):
    model = _zoo(request.param)
    if not hasattr(model, "original_model"):  # the references below are the Hugging Face norms themselves
        pytest.skip("HF-reference post-norm tests need a TransformerBridge; on TransformerLens 3.x the post-norm "
                    "map is checked against hook outputs in tests/analysis/test_variance.py")
    return _randomise_post_norms(model)


#: Block hooks a TransformerBridge keeps gated off unless asked (run_with_cache would warn it skipped them).
_GATED_OFF = ("_input", "hook_result", "hook_attn_in", "hook_mlp_in")


def _cache(model, tokens=TOKENS):
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.startswith("blocks.") and not n.endswith(_GATED_OFF))
    return cache


#: Prompts and the super-neuron search shared by the streamed-vs-cache tests of the post-norm contributions.
PROMPTS = ["t5 t9 t13 t17", "t30 t8 t8 t40 t2", "t11 t12"]


def _find_all_dims(model):
    return find_super_neurons(model, PROMPTS, dims=list(range(model.cfg.d_model)), options=QUIET.replace(batch_size=2))


def _hf_post_norm(model, layer, site):
    """The Hugging Face post norm after block ``layer``'s attention (``site="attn"``) or MLP (``"mlp"``)."""
    return getattr(model.original_model.model.layers[layer],
                   "post_attention_layernorm" if site == "attn" else "post_feedforward_layernorm")


def _post_norm_scale_at_sink(model, cache, layer, site):
    """Gemma's ``(1 + w) / rms(x)`` of that post norm at position 0 of one cached sequence (eps from the HF config)."""
    x = cache[f"blocks.{layer}.{'ln1_post' if site == 'attn' else 'ln2_post'}.hook_in"][0, 0]
    rms = (x.pow(2).mean() + model.original_model.config.rms_norm_eps).sqrt()
    return (1.0 + _hf_post_norm(model, layer, site).weight.detach()) / rms


def test_post_norm_map_reproduces_the_norm_output(post_norm_model):
    """gain ⊙ x / hook_scale, with Gemma's gain = 1 + w, is the post norm's hook_out (and hook_attn/mlp_out)."""
    cache = _cache(post_norm_model)
    for layer in range(post_norm_model.cfg.n_layers):
        for site, norm, out in (("attn", "ln1_post", "hook_attn_out"), ("mlp", "ln2_post", "hook_mlp_out")):
            pm = post_norm_map(post_norm_model, layer, site)
            assert pm.convention == "1+w" and not pm.center
            hf_norm = _hf_post_norm(post_norm_model, layer, site)
            torch.testing.assert_close(pm.gain, 1.0 + hf_norm.weight.detach())
            x = cache[f"blocks.{layer}.{norm}.hook_in"]
            # an independent RMS (eps from the HF config), not the hook_scale value
            rms = (x.pow(2).mean(-1, keepdim=True) + post_norm_model.original_model.config.rms_norm_eps).sqrt()
            torch.testing.assert_close(cache[pm.scale_hook], rms)
            torch.testing.assert_close(pm(x, cache[pm.scale_hook]), cache[f"blocks.{layer}.{norm}.hook_out"],
                                       rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(cache[f"blocks.{layer}.{out}"], cache[f"blocks.{layer}.{norm}.hook_out"])


def test_neuron_contributions_add_up_to_the_post_norm_output(post_norm_model):
    """Σ_n contribution[n] + offset == ln2_post.hook_out (== hook_mlp_out) at every position, exactly."""
    cache = _cache(post_norm_model)
    for layer in range(post_norm_model.cfg.n_layers):
        scale = cache[f"blocks.{layer}.ln2_post.hook_scale"]
        post = cache[f"blocks.{layer}.mlp.hook_post"]
        contrib = neuron_contributions(post_norm_model, layer, post, scale=scale)
        assert contrib.shape == (*post.shape, post_norm_model.cfg.d_model)
        rebuilt = contrib.sum(-2) + mlp_offset(post_norm_model, layer, scale)
        torch.testing.assert_close(rebuilt, cache[f"blocks.{layer}.ln2_post.hook_out"], rtol=1e-5, atol=1e-5)
        # and it is not the raw act × W_out (the gain matters)
        raw = post[..., None] * post_norm_model.W_out[layer].detach()
        assert (raw.sum(-2) - cache[f"blocks.{layer}.hook_mlp_out"]).abs().max() > 0.5
        with pytest.raises(ValueError, match="ln2_post.hook_scale"):
            neuron_contributions(post_norm_model, layer, post)


@pytest.mark.parametrize("family", ["llama", "gpt2", "neox", "qwen2"])
def test_pre_norm_contributions_are_act_times_w_out(family):
    model = _zoo(family)
    cache = _cache(model)
    for layer in range(model.cfg.n_layers):
        assert post_norm_map(model, layer, "mlp").is_identity
        post = cache[f"blocks.{layer}.mlp.hook_post"]
        contrib = neuron_contributions(model, layer, post)
        torch.testing.assert_close(contrib, post[..., None] * model.W_out[layer].detach())
        torch.testing.assert_close(contrib.sum(-2) + mlp_offset(model, layer), cache[f"blocks.{layer}.hook_mlp_out"],
                                   rtol=1e-5, atol=1e-5)


def test_streamed_contributions_equal_a_full_cache_reference(post_norm_model):
    """The reducer's residual-unit contributions (mean over sequences at the sink) vs per-sequence hook maths."""
    model = post_norm_model
    found = _find_all_dims(model)
    L, d = model.cfg.n_layers, model.cfg.d_model
    ref = torch.zeros(L, model.cfg.d_mlp, d)
    for prompt in PROMPTS:
        cache = _cache(model, model.to_tokens(prompt))
        for layer in range(L):
            scale = _post_norm_scale_at_sink(model, cache, layer, "mlp")
            ref[layer] += cache[f"blocks.{layer}.mlp.hook_post"][0, 0][:, None] * model.W_out[layer].detach() * scale
    ref /= len(PROMPTS)
    torch.testing.assert_close(found.contribution, ref, rtol=1e-4, atol=1e-4)
    assert found.post_norm_blocks == list(range(L))
    torch.testing.assert_close(found.contribution.sum(1) + found.mlp_offset_sink, found.mlp_out_sink, rtol=1e-4, atol=1e-4)


def test_head_contributions_through_the_post_attention_norm(post_norm_model):
    """Per head: mean over sequences of z_h W_O[h] × (1 + w) / rms(attention output) at the sink (full cache)."""
    model = post_norm_model
    found = _find_all_dims(model)
    L, H, d = model.cfg.n_layers, model.cfg.n_heads, model.cfg.d_model
    ref = torch.zeros(L, H, d)
    for prompt in PROMPTS:
        cache = _cache(model, model.to_tokens(prompt))
        for layer in range(L):
            z = cache[f"blocks.{layer}.attn.hook_z"][0, 0]  # [head, d_head]
            ref[layer] += torch.einsum("hk,hkd->hd", z, model.W_O[layer].detach()) * _post_norm_scale_at_sink(model, cache, layer, "attn")
    torch.testing.assert_close(found.head_contribution, ref / len(PROMPTS), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(found.head_contribution.sum(1) + found.attn_offset_sink, found.attn_out_sink,
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_head_contributions_add_up_on_pre_norm_models(family):
    """GQA (llama: 4 query heads on 2 KV heads) and biases (gpt2): Σ_h z_h W_O[h] + b_O == hook_attn_out at the sink."""
    model = _zoo(family)
    found = find_super_neurons(model, ["t5 t9 t13 t17", "t30 t8 t8 t40 t2"], dims=list(range(model.cfg.d_model)),
                               options=QUIET)
    torch.testing.assert_close(found.head_contribution.sum(1) + found.attn_offset_sink, found.attn_out_sink,
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("variant", "options"), [("headwise_rms", {}), ("gated", {"granularity": "elementwise"}),
                                                  ("variance_calibrated", {"mode": "attenuate"})])
def test_head_contributions_of_a_sinklens_variant_are_what_its_w_o_reads(variant, options):
    """A SinkLM variant transforms the aggregation before W_O: per head, the mean over sequences of
    out_h W_O[h] at the sink with ``out`` its own head output site, and they add up to hook_attn_out, with no
    "approximate" warning (hook_z there missed it by about the whole output)."""
    from sinklens.testing import tiny_sinklm

    model = tiny_sinklm(variant, **options)
    tokens = torch.randint(0, 512, (6, 12), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = find_super_neurons(model, tokens, dims=list(range(32)), options=QUIET)
    _, cache = model.run_with_cache(tokens)
    w_o = model.W_O.detach()
    ref = torch.stack([torch.einsum("bhk,hkd->hd", cache[f"blocks.{layer}.{model.head_output_site}"][:, 0], w_o[layer])
                       for layer in range(2)]) / tokens.shape[0]
    torch.testing.assert_close(found.head_contribution, ref, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(found.head_contribution.sum(1) + found.attn_offset_sink, found.attn_out_sink,
                               rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", POST_NORM_FAMILIES)
def test_planted_super_neuron_behind_a_post_norm_is_ranked_first_and_is_causal(family):
    """The key test: a neuron whose small write a post norm multiplies by 250 is ranked first; a decoy with a
    10x bigger raw act × W_out behind a 0.01 gain is not, and zeroing it leaves the dimension in place."""
    from support.models import planted_post_norm_model

    try:
        model, spec = planted_post_norm_model(family)
    except FamilyUnavailableError as err:
        pytest.skip(str(err))
    found = find_super_neurons(model, PLANTED_PROMPTS, options=QUIET.replace(batch_size=2))
    assert found.dims == [spec.dim]  # detected
    top = found.top(spec.dim, 2)
    assert [(l, n) for l, n, _ in top] == [(spec.layer, spec.neuron), (spec.decoy_layer, spec.decoy_neuron)]
    assert found.super_neurons()[0] == (spec.layer, spec.neuron)
    assert (spec.decoy_layer, spec.decoy_neuron) not in found.super_neurons()
    # the raw act × W_out ranking would have put the decoy first, by the planted factor
    raw = lambda l, n: float(found.sink_act[l, n] * model.W_out[l][n, spec.dim].detach())  # noqa: E731
    assert raw(spec.decoy_layer, spec.decoy_neuron) == pytest.approx(10 * raw(spec.layer, spec.neuron), rel=1e-3)
    # the planted contribution is the whole residual value it leaves behind
    assert top[0][2] == pytest.approx(float(found.resid_sink[spec.layer + 1, spec.dim]), rel=1e-4)
    path = found.path(spec.dim)
    assert [w.block for w in path.writers] == [spec.layer] and path.erasers == []
    assert path.writers[0].top_neurons[0][:2] == (spec.layer, spec.neuron)
    peak = path.peak_layer
    names = f"blocks.{peak}.hook_resid_pre" if peak < model.cfg.n_layers else f"blocks.{peak - 1}.hook_resid_post"
    tokens = model.to_tokens(PLANTED_PROMPTS[0])

    def dim_at_sink(hooks):
        with model.hooks(fwd_hooks=hooks):
            _, cache = model.run_with_cache(tokens, names_filter=names)
        return float(cache[names][0, 0, spec.dim])

    before = dim_at_sink([])
    assert abs(before) > 500
    planted_off = dim_at_sink(edit_neurons(model, {spec.layer: [spec.neuron]}, positions=[0]))
    decoy_off = dim_at_sink(edit_neurons(model, {spec.decoy_layer: [spec.decoy_neuron]}, positions=[0]))
    assert abs(planted_off) < 0.01 * abs(before)
    assert decoy_off == pytest.approx(before, rel=1e-3)


def test_parallel_blocks_neox():
    """GPT-NeoX (attention and MLP both read resid_pre): each block's step is attn_out + mlp_out and the writers
    and erasers above the share add up with the rest to the dimension's final value."""
    model = _zoo("neox")
    found = find_super_neurons(model, ["t5 t9 t13 t17", "t30 t8 t8 t40"], dims=[3, 7], options=QUIET)
    torch.testing.assert_close(found.resid_sink[1:] - found.resid_sink[:-1], found.attn_out_sink + found.mlp_out_sink,
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(found.contribution.sum(1) + torch.stack([mlp_out_bias(model, l) for l in range(2)])[:, [3, 7]],
                               found.mlp_out_sink[:, [3, 7]], rtol=1e-4, atol=1e-5)
    for path in found.paths:
        steps = {s.block: s for s in path.writers + path.erasers}
        for block in range(model.cfg.n_layers):
            delta = float(found.attn_out_sink[block, path.dim] + found.mlp_out_sink[block, path.dim])
            big = abs(delta) >= 0.05 * abs(path.peak_value)
            assert (block in steps) == big
            if big:
                assert steps[block].delta == pytest.approx(delta, rel=1e-5)
                assert steps[block].attn == pytest.approx(float(found.attn_out_sink[block, path.dim]), rel=1e-5)


def test_moe_mlp_is_refused_with_the_reason():
    model = _zoo("gptoss")
    with pytest.raises(UnsupportedArchitectureError, match="mixture of experts"):
        find_super_neurons(model, ["t5 t6 t7"], options=QUIET)


def test_analyze_skips_the_neuron_section_of_a_moe_model_with_a_note(tmp_path):
    from sinklens.analysis.report import analyze

    model = _zoo("gptoss")
    report = analyze(model, ["t5 t6 t7 t8", "t9 t10 t11"], abs_threshold=None, rel_threshold=5.0, verify=True,
                     options=QUIET)
    assert report.neurons is None and report.weight_neurons is None and report.causal is None
    assert "mixture of experts" in report.skipped["super_neurons"] and "causal_check" in report.skipped
    data = report.to_dict()
    assert "mixture of experts" in data["super_neurons"]["skipped"] and data["headline"]["super_writers"] == []
    assert "super neurons and dimension paths skipped: the MLP is a mixture of experts" in report.summary()
    assert "Causal check skipped: the MLP is a mixture of experts" in report.summary()
    written = save_report(report, tmp_path)
    assert not any("neuron" in p.name for p in written)
