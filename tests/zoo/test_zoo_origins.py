"""The init-time measures on every family of the zoo: the residual after each attention write.

``contraction``'s ``attn l`` sites and ``positional_discrepancy``'s ``resid`` are the residual right after
layer ``l``'s attention write. Sequential blocks expose it as ``hook_resid_mid``; parallel blocks
(GPT-NeoX/Pythia) have no such hook and ``sinklens origins`` used to stop there with "Unknown hook
'blocks.0.hook_resid_mid'". There it is ``resid_pre + attn_out``, checked here against the plain Hugging
Face model (its layer input plus a hook on its attention module's output) under TransformerLens 4.x.
"""

from __future__ import annotations

import pytest
import torch

from sinklens.inputs import random_token_batches
from sinklens.options import RunOptions
from sinklens.origins.contraction import contraction
from sinklens.origins.positional import positional_discrepancy
from support.zoo import FAMILIES, FamilyUnavailableError, zoo_hf_model, zoo_model

from _zoo_reference import TL4

pytestmark = pytest.mark.models

N, T, SEED = 10, 6, 5
OPTS = RunOptions(batch_size=4, progress=False)


def _bert_reference(model, tokens: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Post-LN BERT, from the Hugging Face modules behind the bridge: per layer the residual after the attention
    (the output of the LayerNorm of ``hidden + dense(context)``) and the attention write where it reaches it,
    ``weight ⊙ (w − mean w) / sqrt(var(LayerNorm input) + eps)`` with ``w`` the dense output (bias included)."""
    layers = model.original_model.bert.encoder.layer
    got: dict[tuple[str, int], torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(layers):
        out = layer.attention.output
        handles.append(out.dense.register_forward_hook(lambda m, a, o, i=i: got.__setitem__(("dense", i), o.detach())))
        handles.append(out.LayerNorm.register_forward_hook(
            lambda m, a, o, i=i: got.update({("ln_in", i): a[0].detach(), ("ln_out", i): o.detach()})))
    try:
        with torch.no_grad():
            model.original_model(tokens)
    finally:
        for h in handles:
            h.remove()
    resid, writes = [], []
    for i, layer in enumerate(layers):
        norm, w = layer.attention.output.LayerNorm, got[("dense", i)]
        s = (got[("ln_in", i)].var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt()
        resid.append(got[("ln_out", i)])
        writes.append((w - w.mean(-1, keepdim=True)) / s * norm.weight.detach())
    return resid, writes


def _after_attention_reference(family: str, model, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Per layer ``[N, T, d_model]``: the residual right after the attention write, computed without sinklens."""
    n_layers = model.cfg.n_layers
    if family == "bert":
        return _bert_reference(model, tokens)[0]
    if family == "neox" and TL4:
        assert "blocks.0.hook_resid_mid" not in model.hook_dict  # the premise: no such hook on a parallel block
        hf = zoo_hf_model(family)
        attn_out: dict[int, torch.Tensor] = {}
        handles = [layer.attention.register_forward_hook(
            lambda mod, args, out, i=i: attn_out.__setitem__(i, out[0].detach()))
            for i, layer in enumerate(hf.gpt_neox.layers)]
        try:
            with torch.no_grad():
                hidden = hf(tokens, output_hidden_states=True).hidden_states
        finally:
            for h in handles:
                h.remove()
        return [hidden[i] + attn_out[i] for i in range(n_layers)]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    if family == "neox":  # TransformerLens 3.x parallel block: its own hooks, and the block's bookkeeping
        for i in range(n_layers):
            total = cache[f"blocks.{i}.hook_resid_pre"] + cache[f"blocks.{i}.hook_attn_out"] + cache[f"blocks.{i}.hook_mlp_out"]
            torch.testing.assert_close(total, cache[f"blocks.{i}.hook_resid_post"], rtol=1e-5, atol=1e-6)
        return [cache[f"blocks.{i}.hook_resid_pre"] + cache[f"blocks.{i}.hook_attn_out"] for i in range(n_layers)]
    return [cache[f"blocks.{i}.hook_resid_mid"] for i in range(n_layers)]


@pytest.mark.parametrize("family", FAMILIES)
def test_after_attention_sites_match_an_independent_residual(family):
    """``attn l`` inter-sequence concentration (pairwise cosines) and the ``resid`` variance across
    sequences equal those of the reference residual after attention, on every family; on post-LN BERT the
    reference comes from the Hugging Face modules, and the ``attn_out`` variance is checked too."""
    try:
        model = zoo_model(family)
    except FamilyUnavailableError as err:
        pytest.skip(str(err))
    res = contraction(model, n_sequences=N, seq_len=T, seed=SEED, options=OPTS)
    pd = positional_discrepancy(model, n_sequences=N, seq_len=T, seed=SEED, options=OPTS)
    tokens = torch.cat([b.tokens for b in random_token_batches(model, n_sequences=N, seq_len=T, batch_size=N, seed=SEED)])
    eye = torch.eye(N, dtype=torch.bool)
    for layer, x in enumerate(_after_attention_reference(family, model, tokens)):
        h = torch.nn.functional.normalize(x.double(), dim=-1)
        inter = torch.stack([(h[:, t] @ h[:, t].T)[~eye].mean() for t in range(T)])
        torch.testing.assert_close(res.site(f"attn {layer}").inter, inter.float(), rtol=1e-4, atol=1e-5)
        var = x.double().var(dim=0, unbiased=False).mean(-1)
        torch.testing.assert_close(pd.resid_var[layer], var.float(), rtol=1e-4, atol=1e-9)
    if family == "bert":  # post-LN: the attention write as it reaches the stream, not the 4.x hook_attn_out
        for layer, w in enumerate(_bert_reference(model, tokens)[1]):
            var = w.double().var(dim=0, unbiased=False).mean(-1)
            torch.testing.assert_close(pd.attn_out_var[layer], var.float(), rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("family", FAMILIES)
def test_mlp_asymmetry_is_per_neuron_or_not_claimed(family):
    """``mlp_post_mean[l]`` is the mean of the per-neuron ``mlp.hook_post`` (``[..., d_mlp]``) over sequences,
    positions and neurons, as a full cache gives it. A mixture of experts has no such activations (the 4.x
    gpt-oss bridge fires ``hook_post`` with the ``d_model`` output, and its experts' GLU is not ``cfg.act_fn``):
    there the numbers are NaN, ``null`` in JSON, and ``mlp_skipped`` says why."""
    try:
        model = zoo_model(family)
    except FamilyUnavailableError as err:
        pytest.skip(str(err))
    res = contraction(model, n_sequences=N, seq_len=T, seed=SEED, options=OPTS)
    if family == "gptoss":
        assert "mixture of experts" in res.mlp_skipped and "not measured" in res.asymmetry_text()
        assert bool(res.mlp_post_mean.isnan().all()) and res.activation_mean_at_zero != res.activation_mean_at_zero
        summary = res.summary()
        assert summary["mlp_skipped"] == res.mlp_skipped and summary["activation"] is None
        return
    assert res.mlp_skipped is None and "E[f(z)]" in res.asymmetry_text()
    tokens = torch.cat([b.tokens for b in random_token_batches(model, n_sequences=N, seq_len=T, batch_size=N, seed=SEED)])
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("mlp.hook_post"))
    for layer in range(model.cfg.n_layers):
        post = cache[f"blocks.{layer}.mlp.hook_post"]
        assert post.shape[-1] == model.cfg.d_mlp
        assert float(res.mlp_post_mean[layer]) == pytest.approx(float(post.double().mean()), rel=1e-4, abs=1e-7)
