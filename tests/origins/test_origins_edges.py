"""Edge cases of the origins measures found by audit H, each against an independent reference or an analytic value:
zero hidden states (F1), encoders (F2), gated MLPs (F3), the ``--bos`` hint (F5), the recorded init seed (F6)
and the figures' axes (F7)."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from sinklens.errors import InvalidArgumentError, UnsupportedArchitectureError
from sinklens.inputs import random_token_batches
from sinklens.options import RunOptions
from sinklens.origins.contraction import _ACTIVATIONS, contraction
from sinklens.sinklm.init import sinklm_at_init
from sinklens.origins.positional import positional_discrepancy
from sinklens.origins.preference import token_preference
from sinklens.sinklm.config import ModelConfig

pytestmark = pytest.mark.models
OPTS = RunOptions(batch_size=5, progress=False)  # batches that split the sequences unevenly
N, T, SEED = 12, 6, 3
ZERO_ROWS = (0, 1, 2, 3, 4, 5, 6, 7)  # of 32 tokens: a quarter of the states are zero at the embedding


def _sinklm(family: str, seed: int = 0, **over):
    cfg = dict(family=family, n_layers=2, d_model=32, n_heads=4, d_mlp=64, n_ctx=16, d_vocab=32) | over
    return sinklm_at_init(ModelConfig.from_dict(cfg), seed)


def _tokens(model, n=N, t=T, seed=SEED, prepend_bos=False):
    return torch.cat([b.tokens for b in random_token_batches(model, n_sequences=n, seq_len=t, batch_size=n,
                                                             prepend_bos=prepend_bos, seed=seed)])


@pytest.fixture(scope="module")
def zeroed():
    """Bias-free llama SinkLM (RMSNorm, tied unembedding) whose embedding rows ZERO_ROWS are 0: those tokens'
    states are exactly 0 at ``embed``, and at position 0 (attending only to itself) through every layer,
    so their final state and all their logits are 0 (a tie across the whole vocabulary)."""
    model = _sinklm("llama", seed=2)
    with torch.no_grad():
        model.W_E[list(ZERO_ROWS)] = 0.0
    return model


def _cosine_reference(h: torch.Tensor, first: int) -> tuple[torch.Tensor, float, float, int]:
    """Pairwise cosines of ``h [N, T, d]`` over non-zero states only, by explicit loops: ``inter[t]`` (NaN below
    2 states), its mean over positions ``>= first`` where defined, the mean over sequences with >= 2 non-zero
    counted states of their mean pairwise cosine, and the number of zero counted states."""
    h = h.double()
    inter = []
    for t in range(h.shape[1]):
        rows = [h[n, t] for n in range(h.shape[0]) if float(h[n, t].norm()) > 0]
        cos = [float(a @ b / (a.norm() * b.norm())) for i, a in enumerate(rows) for j, b in enumerate(rows) if i != j]
        inter.append(sum(cos) / len(cos) if cos else math.nan)
    inter_t = torch.tensor(inter, dtype=torch.float64)
    counted = [v for v in inter[first:] if not math.isnan(v)]
    terms = []
    for n in range(h.shape[0]):
        rows = [h[n, t] for t in range(first, h.shape[1]) if float(h[n, t].norm()) > 0]
        cos = [float(a @ b / (a.norm() * b.norm())) for i, a in enumerate(rows) for j, b in enumerate(rows) if i != j]
        if cos:
            terms.append(sum(cos) / len(cos))
    zeros = int((h[:, first:].norm(dim=-1) == 0).sum())
    return inter_t, sum(counted) / len(counted), sum(terms) / len(terms), zeros


# ------------------------------------------------------------------------------------------------- F1: zero states


@pytest.mark.parametrize("prepend_bos", [False, True])
def test_zero_states_are_left_out_of_the_cosine_means(zeroed, prepend_bos):
    """``(‖Σû‖² − N)/(N(N−1))`` subtracted 1 for every zero state although its û is 0: each one lowered the mean
    cosine by 1/(N(N−1)) (the audit's Llama with a zeroed padding row: 0.0518 instead of 0.0647)."""
    tokens = _tokens(zeroed, prepend_bos=prepend_bos)
    first = int(prepend_bos)
    assert bool(torch.isin(tokens[:, first:], torch.tensor(ZERO_ROWS)).any())
    res = contraction(zeroed, n_sequences=N, seq_len=T, seed=SEED, prepend_bos=prepend_bos, options=OPTS)
    names = {"embed": "blocks.0.hook_resid_pre", "mlp 1": "blocks.1.hook_resid_post"}
    with torch.no_grad():
        _, cache = zeroed.run_with_cache(tokens, names_filter=lambda n: n in names.values())
    for site, hook in names.items():
        inter, inter_mean, intra, zeros = _cosine_reference(cache[hook], first)
        stats = res.site(site)
        torch.testing.assert_close(stats.inter.double(), inter, atol=1e-5, rtol=1e-5, equal_nan=True)
        assert stats.inter_mean == pytest.approx(inter_mean, abs=1e-6)
        assert stats.intra == pytest.approx(intra, abs=1e-6)
        assert stats.zero_states == zeros
    expected = int(torch.isin(tokens[:, first:], torch.tensor(ZERO_ROWS)).sum())
    assert res.site("embed").zero_states == expected > 0
    assert res.summary()["sites"][0]["zero_states"] == expected


def test_all_zero_states_give_nan_not_minus_one_over_n_minus_one():
    """Every state 0: no cosine is defined. The closed form gave −1/(N−1) (inter) and −1/(T−1) (intra)."""
    model = _sinklm("llama")
    with torch.no_grad():
        model.W_E.zero_()
    res = contraction(model, n_sequences=N, seq_len=T, options=OPTS)
    embed = res.site("embed")
    assert bool(embed.inter.isnan().all()) and math.isnan(embed.inter_mean) and math.isnan(embed.intra)
    assert embed.zero_states == N * T
    data = json.loads(json.dumps(res.to_dict(), allow_nan=False))  # strict JSON: null, not NaN
    assert data["sites"][0]["inter"] is None and data["sites"][0]["intra"] is None


def test_tied_logits_are_not_counted_as_an_argmax_for_token_0(zeroed):
    """A zero final state has all logits 0; ``argmax`` gave the tie to token 0, a spurious preference for it."""
    tokens = _tokens(zeroed)
    pref = token_preference(zeroed, n_sequences=N, seq_len=T, seed=SEED, options=OPTS)
    with torch.no_grad():
        logits = zeroed(tokens).float()
    tied = (logits == logits.max(dim=-1, keepdim=True).values).sum(-1) > 1  # independent: from the model's logits
    assert torch.equal(tied[:, 0], torch.isin(tokens[:, 0], torch.tensor(ZERO_ROWS)))  # the analytic premise
    assert int(tied.sum()) > 0
    torch.testing.assert_close(pref.argmax_ties, tied.sum(0))
    for t in range(T):
        expected = torch.bincount(logits[:, t][~tied[:, t]].argmax(-1), minlength=32)
        assert torch.equal(pref.argmax_counts[t], expected), t
    assert pref.summary()["argmax_ties"] == int(tied.sum())
    assert int(pref.argmax_counts.sum()) == N * T - int(tied.sum())


# ------------------------------------------------------------------------------------------------- F2: encoders


def _bert():
    """The zoo's BERT through the 4.x bridge; under 3.x, whose config cannot build it, a ``HookedEncoder``."""
    from sinklens.testing.models import transformer_lens_major
    from support.zoo import zoo_model
    from support.models import tl3_encoder

    return zoo_model("bert") if transformer_lens_major() >= 4 else tl3_encoder()


def test_token_preference_refuses_an_encoder_and_positional_says_it_is_not_causal():
    """On BERT the logits at t predict token t (which the model sees): token preference printed an MLM
    distribution as "the mean next-token distribution". Positional discrepancy keeps its meaning but its
    premise (t + 1 values averaged) does not hold: ``causal`` records it."""
    from sinklens.origins.persistence import snapshot

    model = _bert()
    with pytest.raises(UnsupportedArchitectureError, match=r"token_preference needs a causal \(next-token\) model"):
        token_preference(model, n_sequences=4, seq_len=4, options=OPTS)
    with pytest.raises(UnsupportedArchitectureError, match="attends both ways"):
        snapshot(model, n_sequences=4, seq_len=4)
    pd = positional_discrepancy(model, n_sequences=8, seq_len=4, options=OPTS)
    assert pd.causal is False and pd.summary()["causal"] is False and pd.to_dict()["causal"] is False
    assert positional_discrepancy(_sinklm("gpt2"), n_sequences=4, seq_len=4, options=OPTS).causal is True


def test_origins_cli_on_an_encoder_skips_token_preference(tmp_path, capsys):
    from sinklens.cli import main
    from support.zoo import zoo_dir
    from sinklens.testing.models import transformer_lens_major

    if transformer_lens_major() < 4:
        pytest.skip("the zoo's BERT folder loads through the TransformerLens 4.x bridge")
    out = tmp_path / "rep"
    (out).mkdir()
    (out / "rank_probability.png").write_bytes(b"stale")  # an earlier run's figure must not stay
    code = main(["origins", "--model", str(zoo_dir("bert")), "--sequences", "6", "--seq-len", "6", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "token preference skipped" in printed and "no positional discrepancy is expected" in printed
    data = json.loads((out / "origins.json").read_text())
    assert data["token_preference"] is None and "causal" in data["token_preference_skipped"]
    assert data["positional"]["causal"] is False and len(data["contraction"]["sites"]) == 6
    assert sorted(p.name for p in out.glob("*.png")) == ["contraction.png", "positional.png"]


# ------------------------------------------------------------------------------------------------- F3: gated MLPs


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_mlp_act_mean_is_the_nonlinearity_output_on_gated_and_ungated_mlps(family):
    """``mlp_post_mean`` on a gated MLP is the mean of ``f(gate) · up`` (≈ 0 whatever ``f``), which the docs set
    beside ``E[f(z)]``; ``mlp_act_mean`` is the mean of ``f(pre)`` on both kinds, from a full cache here."""
    model = _sinklm(family, seed=1)
    res = contraction(model, n_sequences=N, seq_len=T, seed=SEED, prepend_bos=True, options=OPTS)
    tokens = _tokens(model, prepend_bos=True)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.startswith("blocks.") and ".mlp.hook_" in n)
    f = _ACTIVATIONS["silu" if family == "llama" else "gelu_new"]
    assert res.gated_mlp is (family == "llama")
    for layer in range(2):
        pre, post = cache[f"blocks.{layer}.mlp.hook_pre"][:, 1:].double(), cache[f"blocks.{layer}.mlp.hook_post"][:, 1:].double()
        if family == "llama":
            lin = cache[f"blocks.{layer}.mlp.hook_pre_linear"][:, 1:].double()
            torch.testing.assert_close(post, f(pre) * lin, atol=1e-6, rtol=1e-5)  # the premise: post = f(gate) · up
        else:
            torch.testing.assert_close(post, f(pre), atol=1e-6, rtol=1e-5)
        assert float(res.mlp_act_mean[layer]) == pytest.approx(float(f(pre).mean()), rel=1e-4, abs=1e-8)
        assert float(res.mlp_post_mean[layer]) == pytest.approx(float(post.mean()), rel=1e-4, abs=1e-8)
    assert float(res.mlp_act_mean.min()) > 0  # silu and gelu: E[f(σz)] > 0 for every σ
    summary = res.summary()
    assert summary["gated_mlp"] is res.gated_mlp and summary["mlp_act_mean"] == res.mlp_act_mean.tolist()
    assert ("gate" in res.asymmetry_text()) is (family == "llama")


# ------------------------------------------------------------------------------------------------- F5, F6: the CLI


def _nobos_llama(tmp_path):
    """The zoo Llama folder with a tokenizer that names no BOS token."""
    from support.zoo import zoo_dir

    folder = tmp_path / "nobos"
    shutil.copytree(zoo_dir("llama"), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["bos_token"] = None
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_origins_bos_refusal_names_its_own_flag(tmp_path, capsys):
    """The refusal said "use prepend_bos=False (CLI: --no-bos)": ``origins`` has no --no-bos (argparse then says
    "unrecognized arguments")."""
    from sinklens.cli import main
    from sinklens.testing.models import transformer_lens_major

    if transformer_lens_major() < 4:
        pytest.skip("the zoo's Hugging Face folder loads through the TransformerLens 4.x bridge")
    code = main(["origins", "--model", str(_nobos_llama(tmp_path)), "--bos", "--sequences", "4", "--seq-len", "4",
                 "--out", str(tmp_path / "rep")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "--bos: the tokenizer of" in err and "run without --bos" in err and "--no-bos" not in err


def test_check_bos_without_a_bos_token():
    from types import SimpleNamespace

    from sinklens.commands.origins import check_bos

    tok = SimpleNamespace(bos_token=None, bos_token_id=None, cls_token_id=None, unk_token_id=3, all_special_ids=[3])
    with pytest.raises(InvalidArgumentError, match=r"^--bos: the tokenizer of 'm' has no BOS .*bos_token=None.*run without --bos\.$"):
        check_bos(SimpleNamespace(tokenizer=tok), "m")
    check_bos(SimpleNamespace(tokenizer=SimpleNamespace(bos_token_id=0, unk_token_id=3, all_special_ids=[0, 3])), "m")
    check_bos(SimpleNamespace(tokenizer=None), "m")  # token 0 goes first


def test_origins_json_records_the_seed_the_weights_were_drawn_with(trained_runs, tmp_path):
    """``--model RUN@init:2`` wrote ``"init_seed": null``; ``RUN@init`` is the run's own seed (1 here)."""
    from sinklens.cli import main

    for spec, seed in ((f"{trained_runs[1]}@init:2", 2), (f"{trained_runs[1]}@init", 1), (str(trained_runs[1]), None)):
        out = tmp_path / f"rep{seed}"
        assert main(["origins", "--model", spec, "--sequences", "4", "--seq-len", "4", "--out", str(out), "--no-figures"]) == 0
        assert json.loads((out / "origins.json").read_text())["init_seed"] == seed, spec
    assert main(["origins", "--model", str(trained_runs[1]), "--init-seed", "7", "--sequences", "4", "--seq-len", "4",
                 "--out", str(tmp_path / "rep7"), "--no-figures"]) == 0
    assert json.loads((tmp_path / "rep7" / "origins.json").read_text())["init_seed"] == 7


def test_effective_init_seed_reads_the_run_config():
    from types import SimpleNamespace

    from sinklens.commands.origins import effective_init_seed

    run = SimpleNamespace(train_config=SimpleNamespace(seed=9))
    assert effective_init_seed("runs/a@init", None, run) == 9
    assert effective_init_seed("runs/a@init:4", None, run) == 4
    assert effective_init_seed("runs/a@init", 5, run) == 5
    assert effective_init_seed("gpt2@init", None, SimpleNamespace()) == 0
    assert effective_init_seed("gpt2", None, SimpleNamespace()) is None


# ------------------------------------------------------------------------------------------------- F7: figures


def _integer_ticks(ax) -> bool:
    ticks = np.asarray(ax.get_xticks())
    lo, hi = ax.get_xlim()
    shown = ticks[(ticks >= lo - 1e-9) & (ticks <= hi + 1e-9)]
    return shown.size > 0 and bool(np.all(shown == np.round(shown)))


def test_figures_have_integer_layer_ticks_and_nothing_non_positive_on_log_axes():
    """The share panel's layer axis read −0.25, 0, 0.25 …; with a BOS the positional panel drew the BOS's
    relative variance 0 on a log axis."""
    import matplotlib.pyplot as plt

    from sinklens.plotting.origins import plot_contraction, plot_positional

    model = _sinklm("gpt2", seed=3)
    con = contraction(model, n_sequences=8, seq_len=6, options=OPTS)
    fig = plot_contraction(con)
    assert _integer_ticks(fig.axes[1])
    plt.close(fig)
    pd = positional_discrepancy(model, n_sequences=16, seq_len=6, prepend_bos=True, options=OPTS)
    assert float(pd.relative("attn_out_var")[:, 0].max()) < 1e-8  # the BOS: no variance across sequences
    fig = plot_positional(pd)
    left, right = fig.axes[0], fig.axes[1]
    assert _integer_ticks(left) and _integer_ticks(right)
    for ax in (left, right):
        for line in ax.get_lines():
            y = np.asarray(line.get_ydata(), dtype=float)
            assert not np.any(y[np.isfinite(y)] <= 0), (ax.get_xlabel(), y)
    assert all(float(np.asarray(line.get_xdata())[0]) == 1.0 for line in left.get_lines())  # from the first random token
    plt.close(fig)
