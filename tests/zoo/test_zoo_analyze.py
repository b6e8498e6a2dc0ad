"""``sinklens.analyze`` on every family of the zoo: it runs, writes strict JSON, and its
architecture-independent numbers equal an independent computation (see ``conftest.py``).

Where sinklens refuses a section on a family (neurons of a mixture-of-experts or post-LN model), the
test checks the refusal and its stated reason instead of a number.
"""

from __future__ import annotations

import json

import pytest
import torch

from sinklens.analysis.neurons import find_super_neurons
from sinklens.errors import UnsupportedArchitectureError
from sinklens.inputs import as_batches
from sinklens.options import RunOptions
from sinklens.plotting.report import save_report
from support.zoo import FAMILIES, FamilyUnavailableError, zoo_model

from _zoo_reference import PROMPTS, TL4, visible

pytestmark = pytest.mark.models

TOL = dict(rtol=1e-4, atol=1e-5)  # float32 models, reductions in float32/float64


#: Families whose neurons sinklens refuses to attribute in residual units, and the word the refusal uses.
NO_NEURONS = {"gptoss": "mixture of experts", "bert": "post-LN"}


def _strict(text: str) -> object:
    def refuse(constant: str) -> None:
        raise ValueError(f"non-strict JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("family", FAMILIES)
def test_analyze_runs_and_writes_strict_json(analysed, family, tmp_path):
    """End to end: every analyzer runs, ``report.json`` parses as strict JSON (no NaN/Infinity) and
    counts every prompt and real token."""
    a = analysed(family)
    written = save_report(a.report, tmp_path, figures=False)
    assert tmp_path / "report.json" in written
    data = _strict((tmp_path / "report.json").read_text())
    assert data["n_sequences"] == len(PROMPTS)
    assert data["n_tokens"] == sum(int(b.valid.sum()) for b in a.batches)
    assert a.report.sinks.received.shape[:2] == (a.model.cfg.n_layers, a.model.cfg.n_heads)


@pytest.mark.parametrize("family", FAMILIES)
def test_tokens_follow_the_model(family):
    """Decoders: BOS (id 0) then the words (``t{i}`` is id ``i``); encoders: ``[CLS]`` (2), the words, ``[SEP]`` (3)."""
    try:
        model = zoo_model(family)
    except FamilyUnavailableError as err:
        pytest.skip(str(err))
    first = as_batches(model, PROMPTS, batch_size=2)[0]
    got = first.tokens[0][first.valid[0]].tolist()
    words = [int(w[1:]) for w in PROMPTS[0].split()]
    assert got == ([2, *words, 3] if family == "bert" else [0, *words])


@pytest.mark.parametrize("family", FAMILIES)
def test_residual_stream_at_the_sink_matches_reference(analysed, family):
    """Massive activations and the sink's mean residual vector, per residual stream (every layer input
    and the last layer's output), equal the reference's: ``max_abs_sink[s, d]`` = max over sequences of
    ``|x_s[b, 0, d]|`` with ``value_sink`` its signed value, ``max_abs_by_pos[s, p]`` = max over sequences
    reaching ``p`` and dimensions, ``norm_mean[s, p]`` = mean over those sequences of ``‖x_s[b, p]‖``,
    ``neurons.resid_sink[s]`` = mean over sequences of ``x_s[b, 0]``."""
    a = analysed(family)
    resid = a.reference.resid  # per sequence [stream, pos, d]
    n_pos = max(r.shape[1] for r in resid)
    sink = torch.stack([r[:, 0] for r in resid])  # [seq, stream, d]
    massive = a.report.massive
    torch.testing.assert_close(massive.max_abs_sink, sink.abs().amax(0), **TOL)
    at = sink.abs().argmax(0, keepdim=True)
    torch.testing.assert_close(massive.value_sink, sink.gather(0, at)[0], **TOL)
    by_pos = torch.zeros(sink.shape[1], n_pos)
    norm_sum, count = torch.zeros(sink.shape[1], n_pos), torch.zeros(n_pos)
    for r in resid:
        n = r.shape[1]
        by_pos[:, :n] = torch.maximum(by_pos[:, :n], r.abs().amax(-1))
        norm_sum[:, :n] += r.norm(dim=-1)
        count[:n] += 1
    torch.testing.assert_close(massive.max_abs_by_pos, by_pos, **TOL)
    torch.testing.assert_close(massive.norm_mean, norm_sum / count, **TOL)
    if family in NO_NEURONS:  # the neuron section is refused (see test_block_outputs_...)
        assert a.report.neurons is None
    else:
        torch.testing.assert_close(a.report.neurons.resid_sink, sink.mean(0), **TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_received_attention_matches_reference(analysed, family):
    """``sinks.received[l, h, k]`` = mean of the reference pattern ``A[l, h, q, k]`` over every (sequence,
    query) pair with a real query ``q >= min_query`` that can see ``k`` in layer ``l`` (causal, the
    sliding window where the layer has one, every key in an encoder); NaN where no query can."""
    a = analysed(family)
    received = a.report.sinks.received
    n_layers, n_heads, n_pos = received.shape
    min_query = a.report.sinks.settings.min_query
    total = torch.zeros(n_layers, n_heads, n_pos, dtype=torch.float64)
    count = torch.zeros(n_layers, n_pos, dtype=torch.float64)
    for pattern in a.reference.pattern:  # [layer, head, q, k]
        n = pattern.shape[-1]
        for layer in range(n_layers):
            counted = visible(family, layer, n) & (torch.arange(n)[:, None] >= min_query)
            total[layer, :, :n] += (pattern[layer].double() * counted).sum(1)
            count[layer, :n] += counted.sum(0)
    expected = (total / count[:, None]).float()
    torch.testing.assert_close(received, expected, **TOL, equal_nan=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_block_outputs_add_up_to_the_residual_update(analysed, family):
    """At the sink, each block's attention and MLP outputs as analysed are what reaches the residual
    stream: ``attn_out_sink[l] + mlp_out_sink[l] = resid_sink[l + 1] - resid_sink[l]`` (means over sequences)."""
    report = analysed(family).report
    if family in NO_NEURONS:  # refused, with the reason in the report, rather than a number that means something else
        assert report.neurons is None and NO_NEURONS[family] in report.skipped["super_neurons"]
        return
    neurons = report.neurons
    update = neurons.resid_sink[1:] - neurons.resid_sink[:-1]
    scale = float(neurons.resid_sink.abs().max())
    torch.testing.assert_close(neurons.attn_out_sink + neurons.mlp_out_sink, update, rtol=1e-4, atol=1e-5 * scale)



@pytest.mark.parametrize("family", FAMILIES)
def test_neuron_contributions_add_up_to_the_mlp_output(analysed, family):
    """Summed over neurons, the super-neuron contributions at the sink (every residual dimension) are what
    the MLP adds to the residual stream there, less its output bias: ``Σ_n contribution[l, n, d] =
    mlp_out_sink[l, d] - b_out[l, d]``, exact for a pre-norm MLP and, in residual units, through a post-norm."""
    model = analysed(family).model
    d_model = model.cfg.d_model
    if family in NO_NEURONS:
        with pytest.raises(UnsupportedArchitectureError, match=NO_NEURONS[family]):
            find_super_neurons(model, PROMPTS, options=RunOptions(batch_size=2, progress=False))
        return
    found = find_super_neurons(model, PROMPTS, dims=list(range(d_model)), options=RunOptions(batch_size=2, progress=False))
    try:
        bias = model.b_out.detach().float().cpu()
    except AttributeError:  # a bias-free MLP (TransformerBridge raises for a missing parameter)
        bias = torch.zeros(model.cfg.n_layers, d_model)
    expected = found.mlp_out_sink - bias
    scale = float(found.mlp_out_sink.abs().max())
    torch.testing.assert_close(found.contribution.sum(1), expected, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("family", FAMILIES)
def test_query_key_locking_runs_or_says_why_not(analysed, family):
    """Locking needs the rotated queries/keys of a rotary model and pre-softmax scores; the TransformerLens
    4.x NeoX bridge lists ``hook_rot_q`` but never runs it, and its BERT bridge fires ``hook_attn_scores``
    with the post-softmax weights, so there (only) the section is skipped with that reason."""
    report = analysed(family).report
    reasons = {"neox": "never runs them", "bert": "post-softmax"}
    if family in reasons and TL4:
        assert report.locking is None and reasons[family] in report.skipped["query_key_locking"]
        assert "Query-key locking skipped" in report.summary()
    else:
        assert report.locking is not None and "query_key_locking" not in report.skipped
