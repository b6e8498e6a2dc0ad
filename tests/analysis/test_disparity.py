import math

import matplotlib.figure
import pytest
import torch

import sinklens

from sinklens.analysis.disparity import MassiveActivationsReducer, find_massive_activations
from sinklens.inputs import as_batches
from sinklens.plotting.disparity import plot_massive_by_layer, plot_position_profile, plot_top_dims
from sinklens.streaming import stream
from sinklens.testing import QUIET
from support.checks import PLANTED_PROMPTS
from sinklens.testing.planted import planted_model

pytestmark = pytest.mark.models

PROMPTS = PLANTED_PROMPTS


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def planted(request):
    return planted_model(request.param, n_layers=3, layer=0, neuron=7, dim=5, bos_dim=2, erase_layer=2)


def test_planted_massive_activation_found_exactly(planted):
    model, spec = planted
    found = find_massive_activations(model, PROMPTS, abs_threshold=100.0, rel_threshold=300.0, options=QUIET.replace(batch_size=2))
    assert found.massive_dims("sink") == [spec.dim]
    assert found.massive_dims("other") == []
    # Written by block 0's MLP: massive in the inputs of blocks 1 and 2, erased by block 2.
    assert found.first_stream(spec.dim) == spec.layer + 1
    assert found.streams == [0, 1, 2, 3]
    assert found.count_sink[:, spec.dim].tolist() == [0, len(PROMPTS), len(PROMPTS), 0]
    assert found.count_sink.sum() == 2 * len(PROMPTS)
    assert {(r["stream"], r["position"], r["dim"]) for r in found.rows()} == {(1, 0, spec.dim), (2, 0, spec.dim)}
    assert all(r["abs"] > 100 and r["ratio"] > 300 for r in found.rows())
    # The sink token's norm dwarfs the others and sits in one dimension from layer 1 on.
    assert (found.norm_ratio[1:3, 0] > 100).all()
    assert (found.topk_energy[1:3, 0] > 0.999).all()
    assert (found.topk_energy[1:3, 1:] < 0.9).all()


def _reference(model, prompts, abs_thr, rel_thr, k):
    """Per sequence, full cache, plain loops."""
    L = model.cfg.n_layers
    names = [f"blocks.{l}.hook_resid_pre" for l in range(L)] + [f"blocks.{L - 1}.hook_resid_post"]
    D, P = model.cfg.d_model, max(model.to_tokens(p).shape[1] for p in prompts)
    max_abs = torch.full((L + 1, P, D), -1.0)
    count_sink = torch.zeros(L + 1, D, dtype=torch.long)
    count_other = torch.zeros(L + 1, D, dtype=torch.long)
    norm_ratio_sum = torch.zeros(L + 1, P, dtype=torch.float64)
    norm_ratio_n = torch.zeros(L + 1, P)
    energy = torch.zeros(L + 1, P, dtype=torch.float64)
    pos_n = torch.zeros(P)
    medians = torch.zeros(L + 1, dtype=torch.float64)
    for prompt in prompts:
        toks = model.to_tokens(prompt)
        n = toks.shape[1]
        pos_n[:n] += 1
        _, cache = model.run_with_cache(toks, names_filter=lambda name: name in names)
        for s, name in enumerate(names):
            x = cache[name][0].float()
            med = x.abs().flatten().median()
            medians[s] += med
            max_abs[s, :n] = torch.maximum(max_abs[s, :n], x.abs())
            massive = torch.ones_like(x, dtype=torch.bool)
            if abs_thr is not None:
                massive &= x.abs() > abs_thr
            if rel_thr is not None:
                massive &= x.abs() / med > rel_thr
            count_sink[s] += massive[0].long()
            count_other[s] += massive[1:].long().sum(0)
            norms = x.norm(dim=-1)
            for p in range(n):
                others = torch.cat([norms[:p], norms[p + 1 :]])
                if others.numel():
                    norm_ratio_sum[s, p] += norms[p] / others.median()
                    norm_ratio_n[s, p] += 1
                sq = x[p] ** 2
                energy[s, p] += sq.sort(descending=True).values[:k].sum() / sq.sum()
    return dict(max_abs=max_abs, count_sink=count_sink, count_other=count_other, median=medians / len(prompts),
                norm_ratio=(norm_ratio_sum / norm_ratio_n).float(), energy=(energy / pos_n).float())


@pytest.mark.parametrize("thresholds", [(None, 4.0), (0.05, 3.0)])
def test_streaming_equals_full_cache(tiny, thresholds):
    abs_thr, rel_thr = thresholds
    batches = as_batches(tiny, PROMPTS, batch_size=2)
    assert any((~b.valid).any() for b in batches)  # padding is exercised
    reducer = MassiveActivationsReducer(tiny, abs_threshold=abs_thr, rel_threshold=rel_thr, top_k=2)
    (got,) = stream(tiny, batches, [reducer], options=QUIET)
    ref = _reference(tiny, PROMPTS, abs_thr, rel_thr, 2)
    torch.testing.assert_close(got.count_sink, ref["count_sink"])
    torch.testing.assert_close(got.count_other, ref["count_other"])
    assert got.count_sink.sum() + got.count_other.sum() > 0  # the thresholds do select something
    torch.testing.assert_close(got.median_abs, ref["median"].float())
    torch.testing.assert_close(got.max_abs_sink, ref["max_abs"][:, 0])
    torch.testing.assert_close(got.max_abs_other, ref["max_abs"][:, 1:].amax(1))
    torch.testing.assert_close(got.max_abs_by_pos, ref["max_abs"].amax(-1))
    torch.testing.assert_close(got.norm_ratio, ref["norm_ratio"], equal_nan=True)
    torch.testing.assert_close(got.topk_energy, ref["energy"])
    # every event is a real exceedance location of the reference
    for row in got.rows():
        s = got.streams.index(row["stream"])
        assert abs(row["value"]) == pytest.approx(float(ref["max_abs"][s, row["position"], row["dim"]]))
    assert got.n_events == len(got.rows())


def test_result_serialises_and_plots(tiny, tmp_path):
    import json

    found = find_massive_activations(tiny, PROMPTS, abs_threshold=None, rel_threshold=3.0, max_rows=3, options=QUIET)
    assert len(found.rows()) == min(3, found.n_events)
    text = json.dumps(found.to_dict(), allow_nan=False)
    assert "massive_dims_sink" in text
    for i, fig in enumerate([plot_massive_by_layer(found, path=tmp_path / "a.png"),
                             plot_top_dims(found, k=4, path=tmp_path / "b.png"),
                             plot_position_profile(found, path=tmp_path / "c.png")]):
        assert isinstance(fig, matplotlib.figure.Figure)
    assert (tmp_path / "a.png").stat().st_size > 1000 and (tmp_path / "c.png").exists()
    sink_line, other_line, median_line = plot_massive_by_layer(found).axes[0].get_lines()[:3]
    torch.testing.assert_close(torch.as_tensor(sink_line.get_ydata()), found.max_abs_sink.amax(-1).clamp_min(1e-8))
    torch.testing.assert_close(torch.as_tensor(other_line.get_ydata()), found.max_abs_other.amax(-1).clamp_min(1e-8))
    torch.testing.assert_close(torch.as_tensor(median_line.get_ydata()), found.median_abs.clamp_min(1e-8))
    bars = plot_top_dims(found, k=4).axes[0].patches[:4]  # the sink bars come first
    assert [b.get_height() for b in bars] == pytest.approx([v for _, v in found.top_dims(found.streams[-1], 4)])
    ratio_lines = plot_position_profile(found).axes[0].get_lines()
    for i, line in enumerate(ratio_lines):
        torch.testing.assert_close(torch.as_tensor(line.get_ydata()), found.norm_ratio[i], equal_nan=True)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(streams=[7]), "out of range"),
        (dict(abs_threshold=None, rel_threshold=None), "At least one"),
        (dict(rel_threshold=-1.0), "rel_threshold"),
        (dict(abs_threshold=math.nan), "abs_threshold"),
        (dict(sink_position=12), "sink_position=12"),
        (dict(top_k=0), "top_k"),
    ],
)
def test_bad_inputs_raise_clear_errors(tiny_llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        find_massive_activations(tiny_llama, ["t3 t4 t5"], **kwargs)


def test_a_norm_ratio_over_zero_norms_is_inf_not_the_largest_float(tiny_llama):
    """Rotary Llama: stream 0 is the token embedding. With it zeroed at every position but the first,
    position 0's norm over the median of the others is x / 0 = inf in every sequence, and must stay inf
    (a float32 maximum of 3.4e38 printed as a 39-digit ratio was the bug); the others' ratios are 0."""
    def zero_after_first(embed, hook):
        embed = embed.clone()
        embed[:, 1:] = 0.0
        return embed

    options = QUIET.replace(batch_size=2, extra_hooks=[("hook_embed", zero_after_first)])
    found = find_massive_activations(tiny_llama, PROMPTS, options=options)
    assert math.isinf(found.norm_ratio[0, 0]) and found.norm_ratio[0, 0] > 0
    assert (found.norm_ratio[0, 1:].nan_to_num(0.0) == 0).all()
    report = sinklens.analyze(tiny_llama, PROMPTS, options=options)
    assert math.isinf(report.headline()["max_norm_ratio_at_sink"])
    assert "inf" in report.summary() and "3402823" not in report.summary()
