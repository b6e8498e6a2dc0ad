import json

import matplotlib.figure
import pytest
import torch

from sinklens.analysis.variance import VarianceReducer, measure_variance
from sinklens.hooks import weight
from sinklens.inputs import as_batches, random_token_batches
from sinklens.plotting.variance import plot_discrepancy, plot_feature_std_by_position, plot_variance_by_position
from sinklens.streaming import stream
from sinklens.testing import QUIET, tiny_sinklm
from support.checks import VARIED_PROMPTS

pytestmark = pytest.mark.models

PROMPTS = [*VARIED_PROMPTS, "t40 t41 t42 t43"]


def assert_close_to_scale(got, want, *, rtol, msg):
    """``assert_close`` with ``atol`` at 1e-5 of ``want``'s largest magnitude. The one-pass variances keep a
    float32 rounding residue of up to ~1e-6 of that scale, which depends on how rows were batched and on the
    CPU's kernels (it is all there is where the variance is 0: ``z_var_seq`` at a BOS position 0); an error
    of the estimator or of padding is of the order of the values themselves."""
    atol = 1e-5 * float(want.nan_to_num().abs().max())
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=msg)


def _uniform(scores, hook):
    n = scores.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=scores.device).tril()
    return torch.where(causal, torch.zeros_like(scores), torch.full_like(scores, torch.finfo(scores.dtype).min))


def _centred_var(per_seq, n_coords=None):
    """per_seq: list of [pos_i, ..., coords] tensors. Returns (global-centred, per-position-centred) variance
    per position, [..., pos], computed by explicit loops over positions."""
    width = max(x.shape[0] for x in per_seq)
    mean = torch.cat(per_seq).mean(dim=0)  # over every (sequence, position)
    glob, local = [], []
    for t in range(width):
        at_t = torch.stack([x[t] for x in per_seq if x.shape[0] > t])  # [seqs, ..., coords]
        glob.append(((at_t - mean) ** 2).mean(dim=(0, -1)))
        local.append(((at_t - at_t.mean(dim=0)) ** 2).mean(dim=(0, -1)))
    return torch.stack(glob, dim=-1), torch.stack(local, dim=-1)


def test_streamed_variance_equals_full_cache(tiny):
    got = measure_variance(tiny, PROMPTS, options=QUIET.replace(batch_size=4))
    n_layers, n_heads = tiny.cfg.n_layers, tiny.cfg.n_heads
    w_o = weight(tiny, "W_O").double()
    names = ("hook_z", "hook_v", "hook_pattern", "hook_attn_out")
    caches = []
    for prompt in PROMPTS:
        _, cache = tiny.run_with_cache(tiny.to_tokens(prompt), names_filter=lambda n: n.endswith(names))
        caches.append(cache)
    for layer in range(n_layers):
        z = [c[f"blocks.{layer}.attn.hook_z"][0].double() for c in caches]  # [pos, head, d_head]
        z_var, z_var_seq = _centred_var(z)
        result = [torch.einsum("phd,hdm->phm", x, w_o[layer]) for x in z]
        result_var, _ = _centred_var(result)
        out_var, _ = _centred_var([c[f"blocks.{layer}.hook_attn_out"][0].double() for c in caches])
        v = torch.cat([c[f"blocks.{layer}.attn.hook_v"][0].double() for c in caches])  # [tokens, kv_head, d_head]
        value_var = ((v - v.mean(dim=0)) ** 2).mean(dim=(0, 2)).repeat_interleave(n_heads // v.shape[1])
        pats = [c[f"blocks.{layer}.attn.hook_pattern"][0].double() for c in caches]  # [head, q, k]
        width = z_var.shape[-1]
        attn_sq = torch.stack(
            [torch.stack([(p[:, t] ** 2).sum(-1) for p in pats if p.shape[1] > t]).mean(0) for t in range(width)], -1
        )
        for name, ref in (
            ("z_var", z_var), ("z_var_seq", z_var_seq), ("result_var", result_var),
            ("attn_out_var", out_var), ("value_var", value_var), ("attn_sq", attn_sq),
        ):
            assert_close_to_scale(getattr(got, name)[layer], ref.float(), rtol=1e-4, msg=name)
        # Discrepancy: position 0 against the count-weighted mean over valid positions >= 1.
        counts = torch.tensor([sum(x.shape[0] > t for x in z) for t in range(width)], dtype=torch.float64)
        rest = (z_var[:, 1:] * counts[1:]).sum(-1) / counts[1:].sum()
        torch.testing.assert_close(got.discrepancy(0)[layer], (z_var[:, 0] / rest).float(), rtol=1e-4, atol=1e-6)
        rest3 = (torch.cat([z_var[:, 1:3], z_var[:, 4:]], -1) * torch.cat([counts[1:3], counts[4:]])).sum(-1)
        rest3 = rest3 / (counts[1:].sum() - counts[3])
        torch.testing.assert_close(got.discrepancy(3)[layer], (z_var[:, 3] / rest3).float(), rtol=1e-4, atol=1e-6)
        pres = got.discrepancy(0, of="result")[layer] / got.discrepancy(0)[layer]
        ref_pres = (result_var[:, 0] / ((result_var[:, 1:] * counts[1:]).sum(-1) / counts[1:].sum())) / (z_var[:, 0] / rest)
        torch.testing.assert_close(pres, ref_pres.float(), rtol=1e-4, atol=1e-6)
    assert got.counts.tolist() == [float(sum(len(p.split()) + 1 > t for p in PROMPTS)) for t in range(12)]


def test_uniform_attention_follows_sigma_over_t_plus_one(tiny_llama):
    """Layer 0 on random tokens: values are i.i.d. across positions (v = RMSNorm(W_E[tok]) W_V, no
    positional term), so with attention forced uniform Var(z_t) = σ_v² / (t + 1) exactly in expectation."""
    batches = random_token_batches(tiny_llama, n_sequences=1024, seq_len=16, batch_size=256, seed=0)
    got = measure_variance(
        tiny_llama, batches, layers=[0], options=QUIET.replace(extra_hooks=[("blocks.0.attn.hook_attn_scores", _uniform)])
    )
    t = torch.arange(16)
    # The measured pattern is exactly uniform, so both predictions coincide.
    torch.testing.assert_close(got.attn_sq[0], (1 / (t + 1.0)).expand(4, 16), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.pred_pattern, got.pred_uniform, rtol=1e-5, atol=1e-7)
    scaled = got.z_var[0] * (t + 1) / got.value_var[0][:, None]  # [head, pos], ≈ 1
    assert float((scaled - 1).abs().max()) < 0.15, scaled
    assert float(scaled.mean()) == pytest.approx(1.0, abs=0.03)
    # Centring on the overall mean loses nothing here: E z_t is the same at every position.
    torch.testing.assert_close(got.z_var_seq, got.z_var, rtol=0.05, atol=0.0)
    # Position 0 is one value, later ones average several: the discrepancy follows the law.
    expected = got.discrepancy(0, of="z") / got.ratio_of(got.pred_uniform, 0)
    assert float((expected - 1).abs().max()) < 0.15


def test_without_forcing_the_law_is_only_approximate(tiny_llama):
    """Control: the test above can fail — with a deliberately peaked pattern (all attention on the
    own position) Var(z_t) stays σ_v² instead of σ_v² / (t + 1), and pattern prediction tracks it."""

    def diagonal(scores, hook):
        n = scores.shape[-1]
        eye = torch.eye(n, dtype=torch.bool, device=scores.device)
        return torch.where(eye, torch.zeros_like(scores), torch.full_like(scores, torch.finfo(scores.dtype).min))

    batches = random_token_batches(tiny_llama, n_sequences=256, seq_len=8, batch_size=256, seed=1)
    got = measure_variance(
        tiny_llama, batches, layers=[0], options=QUIET.replace(extra_hooks=[("blocks.0.attn.hook_attn_scores", diagonal)])
    )
    torch.testing.assert_close(got.attn_sq[0], torch.ones(4, 8))
    ratio = got.z_var[0] / got.value_var[0][:, None]
    assert float((ratio - 1).abs().max()) < 0.25
    assert float(got.z_var[0, :, -1].mean()) > 4 * float(got.pred_uniform[0, :, -1].mean())


def test_padding_matches_one_sequence_at_a_time(tiny):
    together = measure_variance(tiny, PROMPTS, options=QUIET.replace(batch_size=6))
    alone = [b for p in PROMPTS for b in as_batches(tiny, [p])]
    (single,) = stream(tiny, alone, [VarianceReducer(tiny)], options=QUIET)
    for name in ("z_var", "z_var_seq", "result_var", "attn_out_var", "value_var", "attn_sq", "counts"):
        assert_close_to_scale(getattr(together, name), getattr(single, name), rtol=1e-5, msg=name)


def test_identical_sequences_have_zero_across_sequence_variance(tiny):
    # Seven copies of one prompt: every position's output is the same vector in each sequence, so the
    # across-sequence variance is 0 up to the float32 rounding of the one-pass sums, and never negative.
    got = measure_variance(tiny, [PROMPTS[0]] * 7, options=QUIET.replace(batch_size=7))
    assert float(got.z_var_seq.min()) >= 0.0
    assert float(got.z_var_seq.max()) < 1e-5 * float(got.z_var.max())
    assert float(got.z_var.min()) >= 0.0 and float(got.result_var.min()) >= 0.0


def test_exports_and_plots(tiny_llama, tmp_path):
    got = measure_variance(tiny_llama, PROMPTS, options=QUIET)
    payload = json.loads(json.dumps(got.to_dict()))
    assert len(payload["discrepancy_z"]) == 2 and len(payload["discrepancy_z"][0]) == 4
    assert len(got.rows()) == got.z_var.numel()
    assert len(got.summary_rows()) == 2 * 4
    fig = plot_variance_by_position(got, heads=[0, 1], path=tmp_path / "var.png")
    assert isinstance(fig, matplotlib.figure.Figure) and (tmp_path / "var.png").stat().st_size > 0
    # One panel per layer; its lines are the head-mean measured variance and both predictions.
    for row, ax in enumerate(fig.axes):
        measured, pattern, uniform = (line.get_ydata() for line in ax.get_lines())
        torch.testing.assert_close(torch.as_tensor(measured), got.z_var[row, [0, 1]].mean(0))
        torch.testing.assert_close(torch.as_tensor(pattern), got.pred_pattern[row, [0, 1]].mean(0))
        torch.testing.assert_close(torch.as_tensor(uniform), got.pred_uniform[row, [0, 1]].mean(0))
    fig = plot_feature_std_by_position(got, layers=[1], path=tmp_path / "std.png")
    concat, per_head, law = (torch.as_tensor(line.get_ydata()) for line in fig.axes[0].get_lines())
    torch.testing.assert_close(concat, got.feature_std[1])
    torch.testing.assert_close(per_head, got.feature_std_head[1].mean(0))
    torch.testing.assert_close(law.float(), got.feature_std[1, 0] / torch.arange(1, concat.shape[0] + 1).sqrt(), rtol=1e-5, atol=1e-7)
    fig = plot_discrepancy(got, path=tmp_path / "disc.png")
    assert isinstance(fig, matplotlib.figure.Figure) and (tmp_path / "disc.png").stat().st_size > 0
    z_image, result_image = (ax.images[0].get_array() for ax in fig.axes if ax.images)
    torch.testing.assert_close(torch.as_tensor(z_image.data), got.discrepancy(0))
    torch.testing.assert_close(torch.as_tensor(result_image.data), got.discrepancy(0, of="result"))


def test_bad_arguments(tiny_llama):
    with pytest.raises(ValueError, match="out of range"):
        measure_variance(tiny_llama, PROMPTS[:1], layers=[5], options=QUIET)
    got = measure_variance(tiny_llama, PROMPTS[:2], options=QUIET)
    with pytest.raises(ValueError, match="out of range"):
        got.discrepancy(40)
    with pytest.raises((ValueError, TypeError), match="of"):
        got.discrepancy(0, of="q")
    with pytest.raises(ValueError, match="not analysed"):
        plot_variance_by_position(got, layers=[9])
    with pytest.raises(ValueError, match="heads"):
        plot_variance_by_position(got, heads=[7])


# ---------------------------------------------------------------------------------------------------------
# Architecture zoo: residual units through post-norms, Li et al.'s per-position feature std, GQA order.
# Every reference below is computed from the plain Hugging Face model of the same weights (no sinklens or
# TransformerLens code), one sequence at a time.

from sinklens.analysis.post_attention import post_attention_map  # noqa: E402
from sinklens.testing import transformer_lens_major  # noqa: E402
from support.planted_values import c4, gaussian_values, uniform_attention  # noqa: E402
from support.zoo import zoo_hf_model, zoo_model  # noqa: E402

from _hf_reference import perturb_post_attention_norms  # noqa: E402

ZOO_PROMPTS = ["t5 t6 t7 t8 t9 t10 t11 t12", "t13 t14 t15", "t20 t9 t31 t7 t40 t41", "t3 t4 t5 t6 t7 t8 t9 t10 t11 t12"]
needs_bridge = pytest.mark.skipif(transformer_lens_major() < 4, reason="zoo HF twins share weights only under TL 4.x")


def _zoo_pair(family):
    """The sinklens model and its plain HF twin; Gemma's post-attention norm gets a gain far from 1, BERT's
    post-attention LayerNorm a gain far from 1 and a bias."""
    model, hf = zoo_model(family), zoo_hf_model(family)
    perturb_post_attention_norms(family, model.original_model, hf)
    return model, hf


def _hf_layers(family, hf):
    if family == "bert":  # post-LN: the LayerNorm after the attention normalises resid_pre + its output
        return [(layer.attention.output.dense, layer.attention.output.LayerNorm) for layer in hf.bert.encoder.layer]
    if family == "neox":
        return [(layer.attention.dense, None) for layer in hf.gpt_neox.layers]
    return [(layer.self_attn.o_proj, getattr(layer, "post_attention_layernorm", None) if family == "gemma2" else None)
            for layer in hf.model.layers]


def _hf_sequences(model, prompts):
    return [b.tokens[i][b.valid[i]] for b in as_batches(model, prompts, batch_size=3) for i in range(b.tokens.shape[0])]


def _hf_o_proj_inputs(family, hf, seqs):
    """Per layer, per sequence: o_proj input [pos, n_heads * d_head], o_proj output [pos, d_model] and, for a
    post-LN model, the input of the LayerNorm after the attention [pos, d_model]."""
    layers = _hf_layers(family, hf)
    got = {name: [[] for _ in layers] for name in ("z", "o", "ln_in")}
    def keep(i):
        def hook(mod, args, out):
            got["z"][i].append(args[0][0].double())
            got["o"][i].append(out[0].double())

        return hook

    handles = [o_proj.register_forward_hook(keep(i)) for i, (o_proj, _) in enumerate(layers)]
    if family == "bert":
        handles += [norm.register_forward_hook(lambda mod, args, out, i=i: got["ln_in"][i].append(args[0][0].double()))
                    for i, (_, norm) in enumerate(layers)]
    try:
        with torch.no_grad():
            for seq in seqs:
                hf(seq[None])
    finally:
        for h in handles:
            h.remove()
    return got


@needs_bridge
@pytest.mark.parametrize("family", ["llama", "gemma2", "neox", "bert"])
def test_li_feature_std_and_residual_writes_match_hf(family):
    """Li et al.'s measure exactly as their notebook computes it (a hook on ``o_proj``'s input, ``.std(dim=-1)``
    per token, mean over samples), and each head's write, and the whole attention's, where it reaches the
    residual stream (on BERT through the LayerNorm that follows; its output would include the residual)."""
    model, hf = _zoo_pair(family)
    got = measure_variance(model, ZOO_PROMPTS, options=QUIET.replace(batch_size=3))
    seqs = _hf_sequences(model, ZOO_PROMPTS)
    acts = _hf_o_proj_inputs(family, hf, seqs)
    n_heads, d_head = model.cfg.n_heads, model.cfg.d_head
    width = max(len(s) for s in seqs)
    assert got.post_norm_layers == ([0, 1] if family in ("gemma2", "bert") else [])
    for layer, (o_proj, post_norm) in enumerate(_hf_layers(family, hf)):
        zs = acts["z"][layer]
        std_all = torch.stack([torch.stack([z[t].float().std(dim=-1) for z in zs if len(z) > t]).mean() for t in range(width)])
        std_head = torch.stack([torch.stack([z[t].view(n_heads, d_head).float().std(dim=-1) for z in zs if len(z) > t]).mean(0)
                                for t in range(width)], -1)
        torch.testing.assert_close(got.feature_std[layer], std_all, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(got.feature_std_head[layer], std_head, rtol=1e-4, atol=1e-7)
        w = o_proj.weight.double()  # [d_model, n_heads * d_head]
        writes, writes_pre, whole = [], [], []
        for j, (z, o) in enumerate(zip(zs, acts["o"][layer])):
            per_head = torch.stack([z[:, h * d_head:(h + 1) * d_head] @ w[:, h * d_head:(h + 1) * d_head].T
                                    for h in range(n_heads)], 1)  # [pos, head, d_model]
            writes_pre.append(per_head)
            if family == "bert":  # LayerNorm(resid + o): a head's share is (x - mean x) / sqrt(var + eps) * w
                x = acts["ln_in"][layer][j]
                s = (x.var(-1, unbiased=False, keepdim=True) + post_norm.eps).sqrt()
                per_head = (per_head - per_head.mean(-1, keepdim=True)) / s[:, None] * post_norm.weight.double()
                o = (o - o.mean(-1, keepdim=True)) / s * post_norm.weight.double()  # the whole write, bias included
            elif post_norm is not None:  # Gemma: x / sqrt(mean(x²) + eps) * (1 + w)
                s = (o.pow(2).mean(-1, keepdim=True) + post_norm.eps).sqrt()
                per_head = per_head / s[:, None] * (1 + post_norm.weight.double())
                o = post_norm(o.float()).double()
            writes.append(per_head)
            whole.append(o)
        result_var, _ = _centred_var(writes)
        pre_var, _ = _centred_var(writes_pre)
        out_var, _ = _centred_var(whole)  # the attention's write where it reaches the stream
        torch.testing.assert_close(got.attn_out_var[layer], out_var.float(), rtol=2e-4, atol=1e-8)
        torch.testing.assert_close(got.result_var[layer], result_var.float(), rtol=2e-4, atol=1e-8)
        torch.testing.assert_close(got.result_var_pre_norm[layer], pre_var.float(), rtol=2e-4, atol=1e-8)
    if family in ("gemma2", "bert"):  # the post-norm's gain of 41 (40) on one dimension changes the answer
        assert float((got.result_var / got.result_var_pre_norm).min()) > (10 if family == "gemma2" else 2)
    else:
        torch.testing.assert_close(got.result_var, got.result_var_pre_norm)
    payload = got.to_dict()
    assert "Li et al." in payload["li_feature_std"]["source"] and "o_proj" in payload["li_feature_std"]["source"]
    row = got.summary_rows()[0]
    c = got.counts[1:]  # the rest is count-weighted, as for every discrepancy ratio
    rest = (got.feature_std[0, 1:] * c).sum() / c.sum()
    assert row["feature_std_ratio"] == pytest.approx(float(got.feature_std[0, 0] / rest), rel=1e-4)
    assert "Li et al." in row["sources"]["feature_std_ratio"]


def test_post_norm_affine_map_reproduces_hook_out():
    """At a fixed position the post-attention RMS norm is ``x ⊙ g / s``: the per-head writes mapped with the
    probed gain and ``hook_scale`` add up to ``ln1_post.hook_out`` exactly (TransformerLens 3.x and 4.x), and
    the probed gain is the gain the model applies (Gemma's ``1 + w`` on 4.x, the stored ``w`` on 3.x)."""
    model = zoo_model("gemma2")
    w = torch.linspace(-0.5, 2.0, model.cfg.d_model)
    w[3] = 40.0
    with torch.no_grad():
        for layer in range(2):
            if transformer_lens_major() >= 4:
                model.original_model.model.layers[layer].post_attention_layernorm.weight.copy_(w)
            else:
                model.blocks[layer].ln1_post.w.copy_(w)
    expected_gain = 1 + w if transformer_lens_major() >= 4 else w
    names = ("attn.hook_z", "ln1_post.hook_scale", "hook_attn_out")  # hook_attn_out: after ln1_post on 3.x and 4.x
    _, cache = model.run_with_cache(model.to_tokens(ZOO_PROMPTS[3]), names_filter=lambda n: n.endswith(names))
    w_o = weight(model, "W_O")
    b_o = getattr(model, "b_O", None)
    for layer in range(2):
        gain = post_attention_map(model, layer).gain.float().cpu()  # Gemma's 1 + w whatever its convention
        torch.testing.assert_close(gain, expected_gain, rtol=1e-5, atol=1e-5)
        z = cache[f"blocks.{layer}.attn.hook_z"][0]
        s = cache[f"blocks.{layer}.ln1_post.hook_scale"][0]
        raw = torch.einsum("phd,hdm->pm", z, w_o[layer]) + (b_o[layer].detach() if b_o is not None else 0.0)
        mapped = raw * gain / s
        torch.testing.assert_close(mapped, cache[f"blocks.{layer}.hook_attn_out"][0], rtol=1e-4, atol=1e-4)
    assert post_attention_map(zoo_model("llama"), 0) is None


@needs_bridge
def test_gqa_value_variance_follows_hf_repeat_kv_order():
    """Llama zoo: 4 query heads share 2 key/value heads; query head h reads kv head h // 2 (HF ``repeat_kv``)."""
    model, hf = _zoo_pair("llama")
    assert (model.cfg.n_heads, model.cfg.n_key_value_heads) == (4, 2)
    got = measure_variance(model, ZOO_PROMPTS, options=QUIET)
    seqs = _hf_sequences(model, ZOO_PROMPTS)
    for layer, block in enumerate(hf.model.layers):
        vs = []
        handle = block.self_attn.v_proj.register_forward_hook(lambda mod, args, out: vs.append(out[0].double()) and None)
        with torch.no_grad():
            for seq in seqs:
                hf(seq[None])
        handle.remove()
        v = torch.cat(vs).view(-1, 2, model.cfg.d_head)  # [tokens, kv_head, d_head]
        per_kv = ((v - v.mean(0)) ** 2).mean(dim=(0, 2))
        expected = per_kv[torch.arange(4) // 2]
        torch.testing.assert_close(got.value_var[layer], expected.float(), rtol=1e-4, atol=1e-8)
        wrong = per_kv[torch.arange(4) % 2]  # the other plausible order gives a different answer
        assert float((wrong - expected).abs().max()) > 1e-3 * float(expected.max())


def test_li_feature_std_follows_the_uniform_law():
    """Planted: i.i.d. N(0, 1) values and uniform attention in layer 0. The head output at position t is the
    mean of t + 1 values, so E feature_std_head[t] = c4(d_head) / sqrt(t + 1) (analytic), and the std of the
    concatenated o_proj input scales as 1 / sqrt(t + 1) as well."""
    model = zoo_model("llama")
    batches = random_token_batches(model, n_sequences=1024, seq_len=12, batch_size=256, seed=0)
    got = measure_variance(model, batches, layers=[0],
                           options=QUIET.replace(extra_hooks=[*gaussian_values(0, seed=1), *uniform_attention(0)]))
    t = torch.arange(12)
    scaled = got.feature_std_head[0] * (t + 1).sqrt() / c4(model.cfg.d_head)  # [head, pos], ≈ 1
    assert float((scaled - 1).abs().max()) < 0.05, scaled
    law = got.feature_std[0] * (t + 1).sqrt() / got.feature_std[0, 0]
    assert float((law - 1).abs().max()) < 0.05, law
    # Same numbers as the across-sequence definition's law, for the variance of z.
    torch.testing.assert_close(got.z_var[0] * (t + 1), torch.ones(4, 12), rtol=0.1, atol=0.0)


# ---------------------------------------------------------------- sinklens' own attention variants
VARIANTS = [("headwise_rms", {}), ("gated", {"granularity": "elementwise"}), ("gated", {"granularity": "headwise"}),
            ("variance_calibrated", {"mode": "amplify"})]


@pytest.mark.parametrize(("variant", "options"), VARIANTS, ids=["headwise_rms", "gated-elementwise", "gated-headwise", "variance_calibrated"])
def test_a_sinklens_variant_is_measured_where_its_w_o_reads(variant, options):
    """On a SinkLM whose variant transforms the aggregation before W_O, ``result_var`` and Li et al.'s feature std
    come from that variant's own site (what W_O reads), ``z_var`` from ``hook_z`` (the aggregation itself)."""
    model = tiny_sinklm(variant, seed=3, **options)
    tokens = torch.randint(0, 512, (24, 10), generator=torch.Generator().manual_seed(0))
    got = measure_variance(model, tokens, options=QUIET.replace(batch_size=8))
    site = model.head_output_site
    assert got.output_site == site != "attn.hook_z" and got.to_dict()["output_site"] == site
    w_o = weight(model, "W_O").double()
    _, cache = model.run_with_cache(tokens)
    for layer in range(2):
        out = cache[f"blocks.{layer}.{site}"].double()  # [batch, pos, head, d_head]
        write = torch.einsum("bphd,hdm->bphm", out, w_o[layer])
        b_o = weight(model, "b_O")[layer].double()
        torch.testing.assert_close(write.sum(2) + b_o, cache[f"blocks.{layer}.hook_attn_out"].double(), atol=1e-5, rtol=1e-5)
        result_var, _ = _centred_var(list(write))
        z_var, _ = _centred_var(list(cache[f"blocks.{layer}.attn.hook_z"].double()))
        assert_close_to_scale(got.result_var[layer], result_var.float(), rtol=1e-4, msg="result_var")
        assert_close_to_scale(got.z_var[layer], z_var.float(), rtol=1e-4, msg="z_var")
        feature_std = out.flatten(2).std(dim=-1).mean(0)  # Li et al.: torch.std over the o_proj input, mean over sequences
        torch.testing.assert_close(got.feature_std[layer], feature_std.float(), rtol=1e-4, atol=1e-6)
        raw, _ = _centred_var([torch.einsum("phd,hdm->phm", z, w_o[layer]) for z in cache[f"blocks.{layer}.attn.hook_z"].double()])
        assert float((raw - result_var).abs().max() / result_var.abs().max()) > 0.05  # the site matters here


def test_headwise_rmsnorm_restores_write_parity_under_uniform_attention():
    """Li et al.'s mechanism, planted: uniform attention over zero-mean values gives the aggregation the σ²/(t+1)
    law (position 0 about 4x the rest over 8 positions, around the global mean), and head-wise RMSNorm with unit gains gives every
    position's write the same variance (ratio 1), which ``result_var`` must show."""
    model = tiny_sinklm("headwise_rms", init="ones")
    with torch.no_grad():
        for block in model.blocks:
            block.attn.W_Q.zero_()
            block.attn.variant.gain.fill_(1.0)
    tokens = torch.randint(0, 512, (1024, 8), generator=torch.Generator().manual_seed(1))
    got = measure_variance(model, tokens, options=QUIET.replace(batch_size=256))
    z_ratio, write_ratio = got.discrepancy(0, of="z")[0], got.discrepancy(0, of="result")[0]  # layer 0
    assert float(z_ratio.min()) > 3.0, z_ratio  # measured 3.97-4.12
    assert float((write_ratio - 1).abs().max()) < 0.05, write_ratio  # measured 0.998-1.015


def test_li_feature_std_keeps_its_precision_under_a_large_common_mean():
    """Li et al.'s ``torch.std`` per token stays exact when the head outputs share a mean ~10⁴ times their spread
    (a common offset added at ``hook_z``): a one-pass ``Σz² − (Σz)²/n`` in float32 loses the spread to rounding
    there (relative error ≈ 0.4 at this offset)."""
    model = tiny_sinklm(seed=0)
    tokens = torch.randint(0, 512, (12, 10), generator=torch.Generator().manual_seed(5))
    offset = tuple((f"blocks.{layer}.attn.hook_z", lambda z, hook: z + 1000.0) for layer in range(model.cfg.n_layers))
    got = measure_variance(model, tokens, options=QUIET.replace(batch_size=4, extra_hooks=offset))
    with model.hooks(fwd_hooks=list(offset)):
        _, cache = model.run_with_cache(tokens, names_filter=lambda name: name.endswith("attn.hook_z"))
    for layer in range(model.cfg.n_layers):
        z = cache[f"blocks.{layer}.attn.hook_z"].double()  # [batch, pos, head, d_head], offset included
        torch.testing.assert_close(got.feature_std[layer], z.flatten(2).std(dim=-1).mean(0).float(), rtol=1e-4, atol=0)
        torch.testing.assert_close(got.feature_std_head[layer], z.std(dim=-1).mean(0).T.float(), rtol=1e-4, atol=0)
