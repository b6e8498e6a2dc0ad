"""TransformerLens 3.x ``HookedTransformer`` configurations researchers build by hand: each runs with the
meaning sinklens documents, or is refused by name (these used to end in a bare ``AttributeError``,
``RuntimeError`` or ``IndexError``, or a refusal naming the wrong cause).

Skipped on TransformerLens 4.x (no ``HookedTransformer``); ``test_tl3_compat`` runs them under 3.x.
"""

from __future__ import annotations

import importlib.metadata
import json

import pytest
import torch

import sinklens
from sinklens.errors import InvalidArgumentError, UnsupportedArchitectureError
from sinklens.interventions import create_sink
from sinklens.options import RunOptions
from sinklens.origins import contraction, token_preference

TL3 = importlib.metadata.version("transformer-lens").startswith("3.")
pytestmark = [pytest.mark.models, pytest.mark.skipif(not TL3, reason="HookedTransformer is TransformerLens 3.x")]

QUIET = RunOptions(progress=False)


def _model(**cfg):
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    base = dict(n_layers=2, d_model=32, n_ctx=32, d_head=8, n_heads=4, d_mlp=64, d_vocab=50, act_fn="gelu",
                normalization_type="LN", seed=0, device="cpu")
    torch.manual_seed(0)
    model = HookedTransformer(HookedTransformerConfig(**{**base, **cfg}))
    with torch.no_grad():  # weights large enough for attention to vary with position
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    return model


def _tokens(n_batch: int = 3, n_pos: int = 10) -> torch.Tensor:
    return torch.randint(2, 40, (n_batch, n_pos), generator=torch.Generator().manual_seed(1))


def test_an_attention_only_model_is_analysed_without_its_missing_neurons():
    """TransformerLens keeps ``cfg.d_mlp`` at its default on an ``attn_only`` model; sinklens reads it as no MLP."""
    model = _model(attn_only=True)
    report = sinklens.analyze(model, _tokens(), options=QUIET)
    assert report.skipped["super_neurons"].startswith("skipped: the model has no MLP (attention-only")
    assert float(report.sinks.received.sum()) > 0
    with pytest.raises(InvalidArgumentError, match=r"This model has no MLP \(attention-only"):
        sinklens.find_super_neurons(model, _tokens(), options=QUIET)


def test_an_attention_only_model_refuses_neuron_edits_and_mlp_patches_by_their_cause():
    """These ended in ``AttributeError: ... no weight property 'W_in'``, "neuron 0 is out of range: expected an
    integer in 0..-1", and a ``resid_mid`` refusal that blamed a parallel block and suggested ``mlp_out``."""
    from sinklens.interventions import block_keys, edit_neurons, patch_sink, remove_sink

    model, tokens = _model(attn_only=True), _tokens()
    no_mlp = r"no MLP \(attention-only: cfg.attn_only, or cfg.d_mlp 0\)"
    with pytest.raises(UnsupportedArchitectureError, match="super_neurons_from_weights cannot rank neurons .*" + no_mlp):
        sinklens.super_neurons_from_weights(model)
    with pytest.raises(UnsupportedArchitectureError, match="Neuron edits are not supported .*" + no_mlp):
        edit_neurons(model, [0], layers=[0])
    with pytest.raises(UnsupportedArchitectureError, match="Neuron edits are not supported .*" + no_mlp):
        remove_sink(model, tokens, method="edit_neurons", neurons=[0], layers=[0])
    hooks = block_keys(model, positions=0, layers=[0])
    for site in ("resid_mid", "mlp_out"):
        with pytest.raises(UnsupportedArchitectureError, match=rf"site '{site}': this model has no MLP .*Patch 'attn_out'"):
            patch_sink(model, tokens, hooks, site=site)
    patched = patch_sink(model, tokens, hooks, site="attn_out", layers=[0])  # what the refusal suggests runs
    assert patched.coords["layer"] == [0] and patched.values.shape[0] == 1


def test_analyze_on_a_model_without_normalization_skips_only_what_reads_a_norm():
    """``analyze`` refused the whole model for its normalized-disparity section; every other section runs as alone."""
    model, tokens = _model(normalization_type=None), _tokens()
    report = sinklens.analyze(model, tokens, options=QUIET)
    assert set(report.skipped) == {"normalized_disparity", "mlp_input_alignment"}
    assert report.skipped["normalized_disparity"].startswith("skipped: This model has no normalization")
    assert report.normalized is None
    assert report.weight_neurons is not None and report.weight_neurons.align_in is None
    alone = sinklens.find_sinks(model, tokens, options=QUIET)
    assert torch.equal(report.sinks.received, alone.received)
    neurons = sinklens.find_super_neurons(model, tokens, options=QUIET)
    assert torch.equal(report.neurons.contribution, neurons.contribution)
    drain = sinklens.measure_value_drain(model, tokens, options=QUIET)
    assert torch.equal(report.value_drain.attn_sink, drain.attn_sink)
    exported = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert exported["normalized_disparity"] == {"skipped": report.skipped["normalized_disparity"]}
    assert "Normalised disparity skipped: This model has no normalization" in report.summary()


def test_a_model_without_normalization_runs_the_origins_and_names_what_it_lacks():
    model = _model(normalization_type=None)
    pref = token_preference(model, n_sequences=6, seq_len=6, options=QUIET)
    assert torch.allclose(pref.mean_probs.sum(-1), torch.ones(6, dtype=pref.mean_probs.dtype), atol=1e-5)
    sites = contraction(model, n_sequences=6, seq_len=6, options=QUIET).sites
    assert sites[-1].name == "final" and torch.isfinite(torch.tensor(sites[-1].inter_mean))
    with pytest.raises(UnsupportedArchitectureError, match=r"no normalization \(cfg.normalization_type=None\)"):
        sinklens.normalized_disparity(model, _tokens(), options=QUIET)


def test_an_output_vocabulary_smaller_than_the_input_one():
    """``d_vocab_out`` 40 < ``d_vocab`` 50: preferences are over the 40 logits; the next-token loss, undefined for
    inputs past the output vocabulary, is skipped by default and refused when asked for."""
    model = _model(d_vocab_out=40)
    pref = token_preference(model, n_sequences=6, seq_len=6, options=QUIET)
    assert pref.mean_probs.shape[-1] == 40
    result = create_sink(model, _tokens(), 3)
    assert result.loss_before != result.loss_before and float(result.received_after.sum()) > 0  # NaN: not computed
    with pytest.raises(UnsupportedArchitectureError, match="reads 50 tokens but predicts 40"):
        create_sink(model, _tokens(), 3, loss=True)


def test_split_qkv_inputs_give_the_normalized_disparity_of_the_same_model_without_them():
    """``use_split_qkv_input`` fires ``ln1.hook_normalized`` per head (equal copies) and computes the same function."""
    plain = _model()
    split = _model(use_split_qkv_input=True)
    split.load_state_dict(plain.state_dict())
    a, b = (sinklens.normalized_disparity(m, _tokens(), options=QUIET) for m in (plain, split))
    assert torch.allclose(a.ratio_sink, b.ratio_sink, rtol=1e-5) and torch.allclose(a.ratio_other, b.ratio_other, rtol=1e-5)


def test_normalized_disparity_warns_when_the_gain_was_folded_away():
    """After ``fold_ln`` (``LNPre``) the paper's after-gain site equals the before-gain one: said, not hidden."""
    model = _model()
    model.process_weights_(fold_ln=True, center_writing_weights=False, center_unembed=False)
    assert model.cfg.normalization_type == "LNPre"
    with pytest.warns(RuntimeWarning, match="norms have no gain .*'LNPre'"):
        result = sinklens.normalized_disparity(model, _tokens(), options=QUIET)
    assert torch.equal(result.ratio_sink, result.ratio_sink_after_gain)
