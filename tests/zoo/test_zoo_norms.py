"""Which norm each sublayer reads, on every family of the zoo.

A pre-norm block's attention reads ``blocks.{l}.ln1`` and its MLP ``blocks.{l}.ln2``. A post-LN block (BERT)
names its norms after what they follow: its ``ln1`` normalises the attention's *output*. ``normalized_disparity``
used to read ``ln1`` there and report it as "the input layernorm (what queries, keys and values read)", and
``sink_inputs`` read ``ln2``, the norm after the MLP. Here the reference is the input the plain Hugging Face
attention and MLP modules receive (forward pre-hooks on the model behind the bridge, its own forward; under
TransformerLens 3.x the block's own ``ln1`` module applied to ``hook_resid_pre``), with every norm's gain and
bias perturbed so that before and after the gain differ. A TransformerLens 3.x ``HookedEncoder`` (whose
``hook_attn_out`` and ``hook_resid_mid`` fire *before* ``ln1``, unlike the 4.x bridge's) is checked against its
own cache.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from sinklens.analysis.normalized_disparity import normalized_disparity
from sinklens.analysis.report import analyze
from sinklens.analysis.variance import measure_variance
from sinklens.analysis.weight_super_neurons import sink_inputs, super_neurons_from_weights
from sinklens.errors import UnsupportedArchitectureError
from sinklens.options import RunOptions
from sinklens.residual_units import input_norm
from support.zoo import FAMILIES, MOE_FAMILIES, FamilyUnavailableError, zoo_model

from _zoo_reference import TL4
from support.models import tl3_encoder

pytestmark = pytest.mark.models

OPTS = RunOptions(batch_size=3, progress=False)
SINK = 0

#: Module paths (``{i}``: the layer) of each family's Hugging Face attention and MLP modules.
HF_MODULES = {
    "gpt2": ("transformer.h.{i}.attn", "transformer.h.{i}.mlp"),
    "neox": ("gpt_neox.layers.{i}.attention", "gpt_neox.layers.{i}.mlp"),
    "bert": ("bert.encoder.layer.{i}.attention.self", "bert.encoder.layer.{i}.intermediate"),
}
DECODER_MODULES = ("model.layers.{i}.self_attn", "model.layers.{i}.mlp")


def _model(family: str):
    try:
        model = zoo_model(family)
    except FamilyUnavailableError as err:
        pytest.skip(str(err))
    torch_model = model.original_model if TL4 else model
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every norm gets a non-trivial gain (one dimension large) and bias
        for name, module in torch_model.named_modules():
            if "norm" not in type(module).__name__.lower():
                continue
            for pname, p in module.named_parameters(recurse=False):
                p.add_(0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
                if pname in ("weight", "w"):
                    p[3] += 20.0
    return model


def _tokens(model) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    return torch.randint(5, model.cfg.d_vocab, (6, 9), generator=gen)


def _sublayer_inputs(family: str, model, tokens: torch.Tensor) -> dict[tuple[str, int], torch.Tensor]:
    """``{("attn" | "mlp", layer): [batch, pos, d_model]}``: what each sublayer reads, without sinklens."""
    n_layers = model.cfg.n_layers
    if not TL4:
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens)
            return {("attn", i): model.blocks[i].ln1(cache[f"blocks.{i}.hook_resid_pre"]) for i in range(n_layers)}
    hf = model.original_model
    captured: dict[tuple[str, int], torch.Tensor] = {}
    handles = []
    for kind, template in zip(("attn", "mlp"), HF_MODULES.get(family, DECODER_MODULES)):
        for i in range(n_layers):
            def grab(module, args, kwargs, key=(kind, i)):
                captured.setdefault(key, (args[0] if args else kwargs["hidden_states"]).detach())
            handles.append(hf.get_submodule(template.format(i=i)).register_forward_pre_hook(grab, with_kwargs=True))
    try:
        with torch.no_grad():
            hf(tokens)
    finally:
        for h in handles:
            h.remove()
    return captured


def _paper_ratio(x: torch.Tensor, position: int) -> torch.Tensor:
    """The paper's disparity at ``position`` of ``x [batch, pos, d_model]`` (attention_sink.ipynb cell 16): the mean
    over sequences of ``|x_d|`` over the mean over sequences of the other dimensions' mean ``|x_j|``."""
    a = x.double().abs()[:, position]
    return a.mean(0) / ((a.sum(-1, keepdim=True) - a) / (a.shape[-1] - 1)).mean(0)


@pytest.mark.parametrize("family", FAMILIES)
def test_normalized_disparity_reads_what_the_attention_reads(family):
    """After the gain, ``ratio_sink`` is the disparity of the very vector each layer's attention receives."""
    model = _model(family)
    tokens = _tokens(model)
    nd = normalized_disparity(model, tokens, sink_position=SINK, options=OPTS)
    reference = _sublayer_inputs(family, model, tokens)
    for i, layer in enumerate(nd.layers):
        expected = _paper_ratio(reference[("attn", layer)], SINK)
        torch.testing.assert_close(nd.ratio_sink_after_gain[i].double(), expected, rtol=1e-4, atol=1e-5)
    if family == "bert":
        assert nd.norms == ["embed_ln", "blocks.0.ln2"] and nd.site.startswith("post-LN")
    else:
        assert nd.norms == [f"blocks.{layer}.ln1" for layer in nd.layers] and nd.site == "ln1.hook_normalized"


@pytest.mark.skipif(not TL4, reason="the reference hooks the Hugging Face modules behind a TransformerBridge")
@pytest.mark.parametrize("family", FAMILIES)
def test_input_norms_are_the_norms_whose_output_each_sublayer_reads(family):
    """``input_norm``'s path is the norm whose ``hook_out`` is the attention's / MLP's input, and ``sink_inputs``
    is that norm's ``hook_normalized`` at the sink, averaged over sequences."""
    model = _model(family)
    tokens = _tokens(model)
    reference = _sublayer_inputs(family, model, tokens)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    for (kind, layer), x in reference.items():
        if kind == "mlp" and family in MOE_FAMILIES:
            continue  # the router reads the norm too; its experts are not one MLP
        path = input_norm(model, layer, kind).path
        torch.testing.assert_close(cache[f"{path}.hook_out"], x, rtol=1e-5, atol=1e-5)
    if family in MOE_FAMILIES:
        return
    si = sink_inputs(model, tokens, sink_position=SINK, options=OPTS)
    for i, layer in enumerate(si.layers):
        path = input_norm(model, layer, "mlp").path
        torch.testing.assert_close(si.x[i], cache[f"{path}.hook_normalized"][:, SINK].mean(0), rtol=1e-5, atol=1e-6)
    assert si.site == ("ln1.hook_normalized" if family == "bert" else "ln2.hook_normalized")


@pytest.mark.parametrize("family", FAMILIES)
def test_norms_are_identified_the_same_in_bfloat16(family):
    """A bfloat16 norm's output is off by up to 2^-8 of each value: the probe still names the same kind of norm
    (mean removed or not, gain ``w`` or ``1 + w``) as in float32, with the same gain and bias, and the head and
    neuron writes rebuilt in float32 add up to the bfloat16 model's outputs without a warning, and no virtual
    sink is reported where there is none."""
    model = _model(family)
    sites = [(layer, kind) for layer in range(model.cfg.n_layers) for kind in ("attn", "mlp")]
    ref = {key: input_norm(model, *key) for key in sites}
    model.to(torch.bfloat16)
    for key in sites:
        got = input_norm(model, *key)
        assert (got.path, got.center, got.convention) == (ref[key].path, ref[key].center, ref[key].convention), key
        torch.testing.assert_close(got.gain, ref[key].gain, rtol=2**-7, atol=2**-7)  # the weights rounded to bfloat16
        torch.testing.assert_close(got.bias, ref[key].bias, rtol=2**-7, atol=2**-7)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        report = analyze(model, _tokens(model), abs_threshold=None, rel_threshold=3.0, options=OPTS)
    assert report.sinks.received.isfinite().all()
    # Rows of a bfloat16 softmax sum to 1 only within its rounding: no virtual sink unless the model has sink logits.
    assert (report.sinks.virtual_sink is not None) == (family == "gptoss")


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_weight_ranking_refuses_a_mixture_of_experts(family):
    """A mixture of experts has no single ``W_in``/``W_out`` per layer: a named refusal, not an AttributeError."""
    model = _model(family)
    with pytest.raises(UnsupportedArchitectureError, match="mixture of experts"):
        super_neurons_from_weights(model)


@pytest.mark.skipif(TL4, reason="TransformerLens 3.x HookedEncoder (the 4.x bridge's BERT is checked above)")
def test_tl3_encoder_reads_the_post_ln_sites():
    """On a 3.x ``HookedEncoder``: normalised disparity reads ``embed.ln`` / the previous ``ln2`` (whose outputs are
    ``hook_resid_pre``); positional discrepancy's (and variance's ``attn_out``) attention write is
    ``ln1.w ⊙ C(hook_attn_out) / ln1.hook_scale`` and its residual after attention is ``ln1``'s output, computed
    here from the model's own cache."""
    from sinklens.inputs import random_token_batches
    from sinklens.origins.positional import positional_discrepancy

    model = tl3_encoder()
    tokens = _tokens(model)
    nd = normalized_disparity(model, tokens, sink_position=SINK, options=OPTS.replace(prepend_bos=False))
    assert nd.norms == ["embed.ln", "blocks.0.ln2"]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    for layer in nd.layers:
        expected = _paper_ratio(cache[f"blocks.{layer}.hook_resid_pre"], SINK)
        torch.testing.assert_close(nd.ratio_sink_after_gain[layer].double(), expected, rtol=1e-4, atol=1e-4)
    pd = positional_discrepancy(model, n_sequences=8, seq_len=6, seed=3)
    tokens = torch.cat([b.tokens for b in random_token_batches(model, n_sequences=8, seq_len=6, batch_size=8, seed=3)])
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    variance = measure_variance(model, tokens, options=OPTS.replace(prepend_bos=False))
    for layer, block in enumerate(model.blocks):
        w, s = cache[f"blocks.{layer}.hook_attn_out"].double(), cache[f"blocks.{layer}.ln1.hook_scale"].double()
        write = (w - w.mean(-1, keepdim=True)) / s * block.ln1.w.detach().double()
        torch.testing.assert_close(pd.attn_out_var[layer].double(), write.var(0, unbiased=False).mean(-1), rtol=1e-4, atol=1e-9)
        centred = (write - write.mean((0, 1))).square().mean((0, -1))  # about the mean over every (sequence, position)
        torch.testing.assert_close(variance.attn_out_var[layer].double(), centred, rtol=1e-4, atol=1e-9)
        after = block.ln1(cache[f"blocks.{layer}.hook_resid_mid"]).detach().double()
        torch.testing.assert_close(pd.resid_var[layer].double(), after.var(0, unbiased=False).mean(-1), rtol=1e-4, atol=1e-9)


@pytest.mark.skipif(TL4, reason="TransformerLens 3.x HookedEncoder: an encoder whose attention hooks run in order")
def test_tl3_encoder_query_key_locking_counts_queries_on_both_sides_of_the_sink():
    """Query–key locking's encoder branch: every position other than the sink queries it, those before it too.
    Checked against the cache (``hook_q``, ``hook_k``, pre-softmax ``hook_attn_scores``) with the sink inside the
    sequence, so queries on both sides count."""
    from sinklens.analysis.qk_locking import query_key_locking

    model = tl3_encoder()
    tokens = _tokens(model)
    sink = 3
    got = query_key_locking(model, tokens, sink_position=sink, options=OPTS.replace(prepend_bos=False))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    queries = torch.arange(tokens.shape[1]) != sink  # an encoder: every other position sees the sink
    for layer in got.layers:
        q = cache[f"blocks.{layer}.attn.hook_q"].double()[:, queries]  # [batch, query, head, d_head]
        k_sink = torch.nn.functional.normalize(cache[f"blocks.{layer}.attn.hook_k"].double()[:, sink], dim=-1)
        energy = torch.einsum("bqhd,bhd->bqh", q, k_sink).square().sum((0, 1)) / q.square().sum((0, 1, 3))
        torch.testing.assert_close(got.key_query_energy[layer].double(), energy, rtol=1e-4, atol=1e-6)
        scores = cache[f"blocks.{layer}.attn.hook_attn_scores"].double()[:, :, queries]  # [batch, head, query, key]
        to_sink = scores[..., sink]
        others = torch.cat([scores[..., :sink], scores[..., sink + 1:]], dim=-1)
        torch.testing.assert_close(got.mean_score_sink[layer].double(), to_sink.mean((0, 2)), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.pos_share_sink[layer].double(), (to_sink > 0).double().mean((0, 2)), rtol=0, atol=1e-6)
        torch.testing.assert_close(got.mean_score_other[layer].double(), others.mean((0, 2, 3)), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.pos_share_other[layer].double(), (others > 0).double().mean((0, 2, 3)), rtol=0, atol=1e-6)
    assert got.n_queries == tokens.shape[0] * (tokens.shape[1] - 1)
