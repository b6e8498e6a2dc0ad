import json
import re

import matplotlib.figure
import pytest
import torch

from sinklens.analysis.value_drain import ValueDrainReducer, ValueDrainSettings, measure_value_drain
from sinklens.errors import InvalidArgumentError
from sinklens.inputs import as_batches, random_token_batches
from sinklens.plotting.report import save_report
from sinklens.plotting.value_drain import plot_value_drain
from sinklens.streaming import stream
from sinklens.testing import QUIET, transformer_lens_major
from support.planted_values import planted_sink
from support.zoo import zoo_hf_model, zoo_model

from _hf_reference import perturb_post_attention_norms

pytestmark = pytest.mark.models

PROMPTS = ["t5 t6 t7 t8 t9 t10 t11 t12", "t13 t14 t15", "t20 t9 t31 t7 t40 t41", "t3 t4 t5 t6 t7 t8 t9 t10 t11 t12"]
needs_bridge = pytest.mark.skipif(transformer_lens_major() < 4, reason="zoo HF twins share weights only under TL 4.x")
FIELDS = ("attn_sink", "attn_other", "write_sink", "write_other", "write_share",
          "value_norm_sink", "value_norm_other", "out_norm_sink", "out_norm_other")


@pytest.fixture(scope="module")
def llama():
    return zoo_model("llama")


@pytest.mark.parametrize("value", ["zero", "broadcast"])
def test_planted_no_op_and_broadcast_sinks(llama, value):
    """Head (0, 1) gives key 0 exactly 0.8 of every later query's attention. With key 0's value zeroed the
    sink writes nothing (write share 0, "no-op"); with a large value it dominates the head's write ("broadcast")."""
    batches = random_token_batches(llama, n_sequences=16, seq_len=10, batch_size=8, seed=0)
    got = measure_value_drain(llama, batches, options=QUIET.replace(extra_hooks=planted_sink(llama, 0, 1, value=value)))
    assert float(got.attn_sink[0, 1]) == pytest.approx(0.8, abs=1e-5)
    assert float(got.n_queries[0]) == 16 * 9  # every query but the sink's own sees the sink
    if value == "zero":
        assert float(got.write_share[0, 1]) < 1e-6 and float(got.write_sink[0, 1]) < 1e-6
        assert float(got.value_norm_sink[0, 1]) == 0.0 and float(got.value_norm_sink[0, 0]) == 0.0  # kv group of head 1
        assert got.kinds()[0][1] == "no-op"
    else:
        assert float(got.write_share[0, 1]) > 0.9
        assert got.kinds()[0][1] == "broadcast"
    # The unplanted heads spread attention over the keys (mean attention to key 0 ~ 0.21): not sink heads.
    assert got.heads("none") == [(0, 0), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]
    assert got.counts()[value.replace("zero", "no-op")] == 1


def _hf_reference(family, model, hf, prompts):
    """Every ValueDrain field from the plain HF model, one sequence at a time, with explicit loops."""
    cfg = hf.config
    bert = family == "bert"
    n_layers, n_heads = cfg.num_hidden_layers, cfg.num_attention_heads
    n_kv = n_heads if bert else cfg.num_key_value_heads
    blocks = hf.bert.encoder.layer if bert else hf.model.layers
    # v_proj, o_proj and the norm after the attention (post-LN BERT: LayerNorm of resid + o; Gemma 2: RMS of o)
    parts = [(b.attention.self.value, b.attention.output.dense, b.attention.output.LayerNorm) if bert else
             (b.self_attn.v_proj, b.self_attn.o_proj,
              getattr(b, "post_attention_layernorm", None) if family == "gemma2" else None) for b in blocks]
    d_head = cfg.hidden_size // n_heads
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * n_layers
    seqs = [b.tokens[i][b.valid[i]] for b in as_batches(model, prompts, batch_size=3) for i in range(b.tokens.shape[0])]
    sums = {name: torch.zeros(n_layers, n_heads, dtype=torch.float64) for name in
            ("attn_sink", "attn_other", "write_sink", "write_other", "write_total", "vn_sink", "vn_other", "on_sink", "on_other")}
    n_q, n_pairs, n_keys = torch.zeros(n_layers), torch.zeros(n_layers), torch.zeros(n_layers)
    for seq in seqs:
        got = {"v": {}, "o": {}, "ln_in": {}}
        handles = []
        for l, (v_proj, o_proj, post) in enumerate(parts):
            handles.append(v_proj.register_forward_hook(lambda m, a, out, l=l: got["v"].__setitem__(l, out[0].double())))
            handles.append(o_proj.register_forward_hook(lambda m, a, out, l=l: got["o"].__setitem__(l, out[0].double())))
            if bert:
                handles.append(post.register_forward_hook(lambda m, a, out, l=l: got["ln_in"].__setitem__(l, a[0][0].double())))
        with torch.no_grad():
            attentions = hf(seq[None], output_attentions=True).attentions
        for h in handles:
            h.remove()
        T = len(seq)
        for l, (_, o_proj, post) in enumerate(parts):
            A = attentions[l][0].double()  # [head, q, k]
            v = got["v"][l].view(T, n_kv, d_head)
            w = o_proj.weight.double()
            if bert:  # LayerNorm(resid + o): (x - mean x) / sqrt(var x + eps) * weight + bias
                gain = post.weight.double()
                s = (got["ln_in"][l].var(-1, unbiased=False) + post.eps).sqrt()
            elif post is not None:  # Gemma 2: o / sqrt(mean(o²) + eps) * (1 + w)
                gain = 1 + post.weight.double()
                s = (got["o"][l].pow(2).mean(-1) + post.eps).sqrt()
            else:
                gain, s = torch.ones(cfg.hidden_size, dtype=torch.float64), torch.ones(T, dtype=torch.float64)
            window = cfg.sliding_window if layer_types[l] == "sliding_attention" else None
            for h in range(n_heads):
                vh = v[:, h // (n_heads // n_kv)]  # HF repeat_kv: kv head h // r
                out = vh @ w[:, h * d_head:(h + 1) * d_head].T
                centred = out - out.mean(-1, keepdim=True) if bert else out
                vn, on, rn = vh.norm(dim=-1), out.norm(dim=-1), (centred * gain).norm(dim=-1)
                sums["vn_sink"][l, h] += vn[0]
                sums["on_sink"][l, h] += on[0]
                sums["vn_other"][l, h] += vn[1:].sum()
                sums["on_other"][l, h] += on[1:].sum()
                for q in range(1, T):
                    if window is not None and q >= window:
                        continue  # this query cannot see the sink
                    sums["attn_sink"][l, h] += A[h, q, 0]
                    sums["write_sink"][l, h] += A[h, q, 0] * rn[0] / s[q]
                    for k in range(T if bert else q + 1):  # an encoder's query sees every key
                        if window is not None and q - k >= window:
                            continue
                        sums["write_total"][l, h] += A[h, q, k] * rn[k] / s[q]
                        if k:
                            sums["write_other"][l, h] += A[h, q, k] * rn[k] / s[q]
                            sums["attn_other"][l, h] += A[h, q, k]
                            n_pairs[l] += 1 / n_heads
                    n_q[l] += 1 / n_heads
            n_keys[l] += T - 1
    n_seq = len(seqs)
    return {
        "attn_sink": sums["attn_sink"] / n_q[:, None], "write_sink": sums["write_sink"] / n_q[:, None],
        "attn_other": sums["attn_other"] / n_pairs[:, None], "write_other": sums["write_other"] / n_pairs[:, None],
        "write_share": sums["write_sink"] / sums["write_total"],
        "value_norm_sink": sums["vn_sink"] / n_seq, "out_norm_sink": sums["on_sink"] / n_seq,
        "value_norm_other": sums["vn_other"] / n_keys[:, None], "out_norm_other": sums["on_other"] / n_keys[:, None],
        "n_queries": n_q,
    }


@needs_bridge
@pytest.mark.parametrize("family", ["llama", "gemma2", "bert"])
def test_matches_hf_reference(family):
    """Every number against the plain HF model: attention weights, v_proj outputs, o_proj weights and, for
    Gemma 2, the post-attention norm (gain 1 + w, far from 1 on one dimension; scale from the o_proj output)
    and its sliding-window layer (queries beyond the window do not see the sink and are not counted); for
    BERT, the post-LN LayerNorm after the attention (mean removal, gain, scale from resid + o) and
    bidirectional attention."""
    model, hf = zoo_model(family), zoo_hf_model(family)
    perturb_post_attention_norms(family, model.original_model, hf)
    got = measure_value_drain(model, PROMPTS, options=QUIET.replace(batch_size=3))
    ref = _hf_reference(family, model, hf, PROMPTS)
    assert got.post_norm_layers == ([0, 1] if family in ("gemma2", "bert") else [])
    torch.testing.assert_close(got.n_queries, ref["n_queries"].float(), rtol=1e-6, atol=1e-4)
    for name in FIELDS:
        torch.testing.assert_close(getattr(got, name), ref[name].float(), rtol=1e-4, atol=1e-6, msg=name)


@needs_bridge
def test_gqa_grouping_order_matches_hf(llama):
    """4 query heads, 2 kv heads: query head h reads kv head h // 2 (HF repeat_kv), not h % 2."""
    hf = zoo_hf_model("llama")
    assert (llama.cfg.n_heads, llama.cfg.n_key_value_heads) == (4, 2)
    got = measure_value_drain(llama, PROMPTS, options=QUIET)
    seqs = [b.tokens[i][b.valid[i]] for b in as_batches(llama, PROMPTS) for i in range(b.tokens.shape[0])]
    for l, layer in enumerate(hf.model.layers):
        firsts = []
        handle = layer.self_attn.v_proj.register_forward_hook(lambda m, a, out: firsts.append(out[0, 0].double()) and None)
        with torch.no_grad():
            for seq in seqs:
                hf(seq[None])
        handle.remove()
        v0 = torch.stack(firsts).view(len(seqs), 2, -1)  # [seq, kv_head, d_head] at the sink
        per_kv = v0.norm(dim=-1).mean(0)
        torch.testing.assert_close(got.value_norm_sink[l], per_kv[torch.arange(4) // 2].float(), rtol=1e-5, atol=1e-7)
        assert float((per_kv[torch.arange(4) % 2] - per_kv[torch.arange(4) // 2]).abs().max()) > 1e-3  # orders differ


def test_padding_and_batch_size_do_not_matter(llama):
    together = measure_value_drain(llama, PROMPTS, options=QUIET.replace(batch_size=4))
    alone = [b for p in PROMPTS for b in as_batches(llama, [p])]
    (single,) = stream(llama, alone, [ValueDrainReducer(llama)], options=QUIET)
    for name in (*FIELDS, "n_queries"):
        torch.testing.assert_close(getattr(together, name), getattr(single, name), rtol=1e-5, atol=1e-7, msg=name)


def test_exports_and_plot(llama, tmp_path):
    got = measure_value_drain(llama, PROMPTS, options=QUIET.replace(extra_hooks=planted_sink(llama, 1, 2, value="zero")))
    payload = json.loads(json.dumps(got.to_dict(), allow_nan=False))
    assert payload["kinds"][1][2] == "no-op" and payload["counts"]["no-op"] == 1
    assert payload["settings"]["sink_head_threshold"] == 0.3
    assert len(got.rows()) == 8 and got.rows()[6]["kind"] == "no-op"
    fig = plot_value_drain(got, path=tmp_path / "drain.png")
    assert isinstance(fig, matplotlib.figure.Figure) and (tmp_path / "drain.png").stat().st_size > 0
    image = fig.axes[1].images[0].get_array()
    torch.testing.assert_close(torch.as_tensor(image.data), got.write_share)
    points = {tuple(map(float, xy)) for coll in fig.axes[0].collections for xy in coll.get_offsets()}
    assert (float(got.attn_sink[1, 2]), float(got.write_share[1, 2])) in points


def test_settings_are_validated(llama):
    with pytest.raises(InvalidArgumentError, match="broadcast_share"):
        ValueDrainSettings(no_op_share=0.5, broadcast_share=0.2)
    with pytest.raises(InvalidArgumentError, match="sink_head_threshold"):
        ValueDrainSettings(sink_head_threshold=0.0)
    with pytest.raises(InvalidArgumentError, match="sink_position"):
        measure_value_drain(llama, ["t5 t6"], settings=ValueDrainSettings(sink_position=9), options=QUIET)
    with pytest.raises((ValueError, TypeError), match="kind"):
        measure_value_drain(llama, ["t5 t6"], options=QUIET).heads("sink")


def test_classification_rule():
    """Sink heads (attn_sink >= 0.3) split at write_share 0.1 (no-op below) and 0.3 (broadcast from)."""
    from sinklens.analysis.value_drain import ValueDrain

    attn = torch.tensor([[0.29, 0.3, 0.9, 0.9, 0.9, 0.9]])
    share = torch.tensor([[0.01, 0.0999, 0.1, 0.2999, 0.3, 0.95]])
    zeros = torch.zeros_like(attn)
    drain = ValueDrain(attn_sink=attn, attn_other=zeros, write_sink=zeros, write_other=zeros, write_share=share,
                       value_norm_sink=zeros, value_norm_other=zeros, out_norm_sink=zeros, out_norm_other=zeros,
                       n_queries=torch.ones(1), layers=[0], n_sequences=1)
    assert drain.kinds() == [["none", "no-op", "partial", "partial", "broadcast", "broadcast"]]
    strict = ValueDrain(**{**drain.__dict__, "settings": ValueDrainSettings(no_op_share=0.2, broadcast_share=0.9)})
    assert strict.kinds() == [["none", "no-op", "no-op", "partial", "partial", "broadcast"]]
    assert strict.no_op_share == 0.2  # settings read as attributes


def test_analyze_reports_value_drain_and_li_feature_std(llama, tmp_path):
    from sinklens.analysis.report import analyze
    from sinklens.plotting.report import figure_makers

    report = analyze(llama, PROMPTS, abs_threshold=None, rel_threshold=3.0, options=QUIET)
    alone = measure_value_drain(llama, PROMPTS, options=QUIET)
    for name in FIELDS:
        torch.testing.assert_close(getattr(report.value_drain, name), getattr(alone, name), msg=name)
    text = report.summary(timing=False)
    assert "Value drain at position 0:" in text and "Li et al." in text
    save_report(report, tmp_path, figures=False)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["value_drain"]["kinds"] == alone.kinds()
    assert "Li et al." in data["variance"]["li_feature_std"]["source"]
    fig = figure_makers(report)["value_drain.png"]()
    torch.testing.assert_close(torch.as_tensor(fig.axes[1].images[0].get_array().data), alone.write_share)


def _variant_reference(model, tokens, variant, *, naive=False):
    """Brute force from a full cache, without the Gram or scale tricks: per query q, the head output is
    ``m_q ⊙ Σ_k A[q, k] v_k`` with ``m_q`` from the variant's own definition (γ / rms(z) for head-wise RMSNorm,
    ``1 / sqrt(Σ_k A²)`` for variance calibration in ``amplify`` mode, the gate for a head-wise gate), so key k
    writes ``A[q, k] · ‖(m_q ⊙ v_k) W_O‖``. Sink at 0, causal, no padding. ``naive``: ``m = 1``, as if W_O
    read ``hook_z``."""
    _, cache = model.run_with_cache(tokens)
    out = {name: torch.zeros(2, 4, dtype=torch.float64) for name in ("attn_sink", "write_sink", "write_other", "write_share")}
    for layer in range(2):
        A = cache[f"blocks.{layer}.attn.hook_pattern"].double()  # [b, h, q, k]
        v = cache[f"blocks.{layer}.attn.hook_v"].double()  # [b, k, h, d]
        z = cache[f"blocks.{layer}.attn.hook_z"].double()
        if variant == "headwise_rms":
            gain = model.blocks[layer].attn.variant.gain.detach().double()
            m = gain / (z.square().mean(-1, keepdim=True) + 1e-6).sqrt()  # [b, q, h, d]
        elif variant == "variance_calibrated":
            m = A.square().sum(-1).rsqrt().transpose(1, 2)[..., None].expand_as(z)
        else:
            m = cache[f"blocks.{layer}.attn.hook_gate"].double()[..., None].expand_as(z)
        if naive:
            m = torch.ones_like(z)
        site = "attn.hook_z" if naive else model.head_output_site
        torch.testing.assert_close(torch.einsum("bhqk,bkhd->bqhd", A, v) * m, cache[f"blocks.{layer}.{site}"].double(),
                                   atol=1e-5, rtol=1e-4)
        w_o = model.W_O[layer].detach().double()  # [h, d, d_model]
        keyed = torch.einsum("bqhd,bkhd->bhqkd", m, v)  # m_q ⊙ v_k
        write = A * torch.einsum("bhqkd,hdm->bhqkm", keyed, w_o).norm(dim=-1)  # [b, h, q, k]
        T = A.shape[-1]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        causal[0] = False  # the query at the sink is not counted
        other = causal.clone()
        other[:, 0] = False
        out["attn_sink"][layer] = A[:, :, 1:, 0].mean(dim=(0, 2))
        out["write_sink"][layer] = write[:, :, 1:, 0].mean(dim=(0, 2))
        out["write_other"][layer] = (write * other).sum(dim=(0, 2, 3)) / (other.sum() * A.shape[0])
        out["write_share"][layer] = write[:, :, 1:, 0].sum(dim=(0, 2)) / (write * causal).sum(dim=(0, 2, 3))
    return out


@pytest.mark.parametrize(("variant", "options"), [("headwise_rms", {}), ("headwise_rms", {"gain": "shared"}),
                                                  ("variance_calibrated", {"mode": "amplify"}),
                                                  ("gated", {"granularity": "headwise"})])
def test_a_variant_with_one_scale_per_query_head_splits_into_the_writes_it_makes(variant, options):
    """Head-wise RMSNorm, variance calibration and a head-wise gate give each head's output as c[q, h] · (γ ⊙ z):
    the per-key writes go through that scale and gain (brute force above); hook_z alone would be wrong."""
    from sinklens.testing import tiny_sinklm

    model = tiny_sinklm(variant, **options)
    tokens = torch.randint(0, 512, (5, 12), generator=torch.Generator().manual_seed(0))
    got = measure_value_drain(model, tokens, options=QUIET.replace(batch_size=2))
    ref = _variant_reference(model, tokens, variant)
    for name, want in ref.items():
        torch.testing.assert_close(getattr(got, name), want.float(), rtol=1e-4, atol=1e-6, msg=name)
    naive = _variant_reference(model, tokens, variant, naive=True)["write_sink"]
    assert float(((naive - ref["write_sink"]).abs() / ref["write_sink"]).min()) > 0.05  # hook_z alone: other numbers


def test_an_elementwise_gate_is_refused_and_analyze_says_why(tmp_path):
    """An element-wise gate multiplies each coordinate of the query's output by its own factor: value drain
    refuses, naming both sites, and ``analyze`` reports every other section with value drain marked skipped."""
    from sinklens.analysis.report import analyze
    from sinklens.errors import UnsupportedArchitectureError
    from sinklens.testing import tiny_sinklm

    model = tiny_sinklm("gated", granularity="elementwise")
    tokens = torch.randint(0, 512, (4, 12), generator=torch.Generator().manual_seed(0))
    with pytest.raises(UnsupportedArchitectureError, match=re.escape("W_O reads blocks.{l}.attn.hook_z_gated, not a scalar")):
        measure_value_drain(model, tokens, options=QUIET)
    report = analyze(model, tokens, options=QUIET)
    assert report.value_drain is None and report.variance.output_site == "attn.hook_z_gated"
    assert "z for zW_O read at attn.hook_z_gated (what W_O reads in this model)" in report.summary()
    assert "Value drain skipped: the model transforms each head's aggregated output" in report.summary()
    save_report(report, tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["value_drain"]["skipped"].startswith("skipped: the model transforms")
    assert not (tmp_path / "value_drain.png").exists()
    assert analyze(tiny_sinklm("headwise_rms"), tokens, options=QUIET).value_drain is not None
