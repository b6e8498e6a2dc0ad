import json

import matplotlib.figure
import pytest
import torch

from sinklens.analysis.variance import VarianceReducer, measure_variance
from sinklens.hooks import weight
from sinklens.inputs import as_batches, random_token_batches
from sinklens.streaming import stream
from sinklens.testing import QUIET, VARIED_PROMPTS

pytestmark = pytest.mark.models

PROMPTS = [*VARIED_PROMPTS, "t40 t41 t42 t43"]


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
            torch.testing.assert_close(getattr(got, name)[layer], ref.float(), rtol=1e-4, atol=1e-7, msg=name)
        # Discrepancy: position 0 against the count-weighted mean over valid positions >= 1.
        counts = torch.tensor([sum(x.shape[0] > t for x in z) for t in range(width)], dtype=torch.float64)
        rest = (z_var[:, 1:] * counts[1:]).sum(-1) / counts[1:].sum()
        torch.testing.assert_close(got.discrepancy(0)[layer], (z_var[:, 0] / rest).float(), rtol=1e-4, atol=1e-6)
        rest3 = (torch.cat([z_var[:, 1:3], z_var[:, 4:]], -1) * torch.cat([counts[1:3], counts[4:]])).sum(-1)
        rest3 = rest3 / (counts[1:].sum() - counts[3])
        torch.testing.assert_close(got.discrepancy(3)[layer], (z_var[:, 3] / rest3).float(), rtol=1e-4, atol=1e-6)
        pres = got.preservation(0)[layer]
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
        torch.testing.assert_close(getattr(together, name), getattr(single, name), rtol=1e-5, atol=1e-7, msg=name)


def test_exports_and_plots(tiny_llama, tmp_path):
    got = measure_variance(tiny_llama, PROMPTS, options=QUIET)
    payload = json.loads(json.dumps(got.to_dict()))
    assert len(payload["discrepancy_z"]) == 2 and len(payload["discrepancy_z"][0]) == 4
    assert len(got.rows()) == got.z_var.numel()
    assert len(got.summary_rows()) == 2 * 4
    fig = got.plot(tmp_path / "var.png", heads=[0, 1])
    assert isinstance(fig, matplotlib.figure.Figure) and (tmp_path / "var.png").stat().st_size > 0
    # One panel per layer; its lines are the head-mean measured variance and both predictions.
    for row, ax in enumerate(fig.axes):
        measured, pattern, uniform = (line.get_ydata() for line in ax.get_lines())
        torch.testing.assert_close(torch.as_tensor(measured), got.z_var[row, [0, 1]].mean(0))
        torch.testing.assert_close(torch.as_tensor(pattern), got.pred_pattern[row, [0, 1]].mean(0))
        torch.testing.assert_close(torch.as_tensor(uniform), got.pred_uniform[row, [0, 1]].mean(0))
    fig = got.plot_discrepancy(tmp_path / "disc.png")
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
        got.plot(layers=[9])
    with pytest.raises(ValueError, match="heads"):
        got.plot(heads=[7])
