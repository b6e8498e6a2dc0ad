"""SeedPrint edge cases: an undefined statistic is inconclusive, embedding-mode inputs and statistics, the
shared-input caveat, full-precision JSON, features with autograd history."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sinklens.errors import InvalidArgumentError
from sinklens.options import RunOptions
from sinklens.origins.fingerprint import (_RandomInputs, embedding_stats_at_init, final_hidden_states, fingerprint,
                                          seedprint_test, shared_input_z)
from sinklens.origins.stats import max_shared_input_z

pytestmark = pytest.mark.models
OPTS = RunOptions(batch_size=300, progress=False)


def _sinklm(seed: int, d_model: int = 32, **init):
    from sinklens.sinklm.init import sinklm_at_init
    from sinklens.sinklm.config import ModelConfig

    cfg = ModelConfig.from_dict(dict(family="llama", n_layers=2, d_model=d_model, n_heads=4, d_mlp=2 * d_model,
                                     n_ctx=16, d_vocab=1024))
    return sinklm_at_init(cfg, seed, **init)


# ------------------------------------------------------------------------------ undefined statistic
def test_buffer_k_of_one_is_refused_by_name(tmp_path, capsys):
    """The softmax over one identity dim is the constant 1: Kendall tau is undefined, so buffer_k = 1 could only
    ever print p = 1 ("no evidence") for a model tested against itself."""
    from sinklens.cli import main

    hidden = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(InvalidArgumentError, match="buffer_k must be an integer >= 2, got 1"):
        seedprint_test(hidden, hidden, buffer_k=1)
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(InvalidArgumentError, match="buffer_k must be an integer >= 2, got 1"):
        fingerprint(missing, missing, buffer_k=1)
    assert main(["fingerprint", missing, missing, "--buffer-k", "1"]) == 2
    assert "--buffer-k must be an integer >= 2, got 1" in capsys.readouterr().err


def test_one_shared_identity_dim_is_inconclusive_not_no_evidence():
    """Nearly identical features whose bottom-2 sets share one dim: the statistic is undefined, and the result
    says so (verdict, caveat, NaN p written as null) instead of p = 1, "no evidence"."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(200, 8, generator=g)
    a = h + torch.tensor([-5.0, -4, 0, 0, 0, 0, 0, 0])
    b = h + 0.01 * torch.randn(200, 8, generator=g) + torch.tensor([-5.0, 0, -4, 0, 0, 0, 0, 0])
    res = seedprint_test(a, b, buffer_k=2)
    assert res.dims == [0] and res.n_dims == 1 and res.undefined
    assert res.verdict == "inconclusive" and res.same_lineage is None  # not False: nothing was measured
    assert math.isnan(res.p_value) and math.isnan(res.z) and math.isnan(res.tau_mean)
    assert len(res.caveats) == 1 and res.caveats[0].startswith("only 1 identity dim (of the bottom 2 of each model)")
    assert res.summary().startswith("SeedPrint: INCONCLUSIVE, the statistic is undefined here")
    assert "no evidence of shared lineage" not in res.summary()
    data = json.loads(json.dumps(res.to_dict(), allow_nan=False))  # strict JSON
    assert data["p_value"] is None and data["z"] is None and data["verdict"] == "inconclusive" and data["same_lineage"] is None
    assert data["caveats"] == res.caveats
    # no shared dim at all (bottom-1 sets disjoint at buffer_k = 2 of 4 dims)
    none = seedprint_test(h[:, :4] + torch.tensor([-5.0, -4, 0, 0]), h[:, :4] + torch.tensor([0.0, 0, -5, -4]),
                          buffer_k=2)
    assert none.n_dims == 0 and none.verdict == "inconclusive" and "only 0 identity dims" in none.caveats[0]
    # the same features with both dims shared give a real result
    assert seedprint_test(a, a + 0.01 * torch.randn(200, 8, generator=g), buffer_k=3).verdict == "same_lineage"


def test_a_constant_normalised_column_is_inconclusive():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(100, 6, generator=g)
    a[:, :2] = torch.tensor([-6.0, -5.0])  # the two identity dims are the same in every sample
    res = seedprint_test(a, a.clone(), buffer_k=2)
    assert res.dims == [0, 1] and torch.isnan(res.tau).all()
    assert res.verdict == "inconclusive" and math.isnan(res.p_value)
    assert "Kendall tau is undefined in 2 of the 2 identity dims (dims 0, 1:" in res.caveats[0]


def test_non_finite_features_are_refused_by_name():
    h = torch.randn(200, 8, generator=torch.Generator().manual_seed(0))
    inf = h.clone()
    inf[0, :] = float("inf")
    with pytest.raises(InvalidArgumentError, match=r"hidden_a has 8 non-finite values \(inf or NaN\) in 1 of its 200 "
                                                   r"samples \(rows 0\)"):
        seedprint_test(inf, inf, buffer_k=4)
    nan = h.clone()
    nan[3:10, 2] = float("nan")
    with pytest.raises(InvalidArgumentError, match=r"hidden_b has 7 non-finite values .*\(rows 3, 4, 5, 6, 7, \.\.\.\)"):
        seedprint_test(h, nan, buffer_k=4)


def test_a_model_with_non_finite_output_is_named():
    broken = _sinklm(0, d_model=16)
    with torch.no_grad():
        next(p for name, p in broken.named_parameters() if "blocks.1" in name).fill_(3e38)  # finite, overflows
    with pytest.raises(InvalidArgumentError, match=r"model B's final states has \d+ non-finite values"):
        fingerprint(_sinklm(1, d_model=16), broken, n_samples=100, seq_len=8, options=OPTS)


def test_features_with_autograd_history_are_accepted():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 16, generator=g, requires_grad=True)
    h = torch.randn(50, 16, generator=g) @ w
    res = seedprint_test(h, h + 0.1, buffer_k=4)
    with torch.no_grad():
        ref = seedprint_test(h.detach(), h.detach() + 0.1, buffer_k=4)
    assert res.z == ref.z and res.same_lineage and w.grad is None


# ------------------------------------------------------------------------------ embedding mode
def test_embedding_inputs_do_not_depend_on_batch_size():
    """seq_len * d_model = 9 * 24 = 216 is no multiple of 16 (torch.normal's block): one draw per batch made the
    inputs, and SeedPrint's z, change with the batch size (113.41 at 7 vs 113.55 at 16)."""
    def draws(batch_size):
        src = _RandomInputs(30, 9, batch_size, mode="embedding", high=2, seed=42, device=torch.device("cpu"),
                            d_model=24, mu=0.0, sigma=1.0)
        return torch.cat([src.embeddings(batch.tokens.shape[0]) for batch in src])

    assert torch.equal(draws(30), draws(7)) and torch.equal(draws(30), draws(1))
    src = _RandomInputs(30, 9, 4, mode="embedding", high=2, seed=42, device=torch.device("cpu"), d_model=24)
    assert torch.equal(src.last_embeddings(), draws(30)[:, -1])
    a, b = _sinklm(1, d_model=24), _sinklm(2, d_model=24)
    kw = dict(n_samples=40, seq_len=9, input="embedding")
    feats = [final_hidden_states(a, **kw, options=RunOptions(batch_size=bs, progress=False)) for bs in (7, 16, 40)]
    assert torch.equal(feats[0], feats[1]) and torch.equal(feats[0], feats[2])
    zs = {fingerprint(a, b, **kw, options=RunOptions(batch_size=bs, progress=False)).z for bs in (7, 16)}
    assert len(zs) == 1


def test_embedding_statistics_come_from_the_architecture_at_init():
    """As the authors' generate_random_embeddings on a freshly initialised model: a trained W_E (here scaled
    tenfold) does not move mu, sigma; they are those of load_at_init's W_E."""
    from sinklens.loading.init import load_at_init
    from support.zoo import zoo_model

    a, b = zoo_model("llama", d_vocab=4096, seed=0), zoo_model("llama", d_vocab=4096, seed=1)
    fresh = load_at_init(a, init_seed=42).W_E.detach().float()
    with torch.no_grad():
        a.W_E.mul_(10.0)  # a "trained" embedding: 10x the init scale
    res = fingerprint(a, b, n_samples=50, seq_len=8, input="embedding", options=OPTS)
    assert res.settings["embedding_mu"] == pytest.approx(float(fresh.mean()), abs=1e-9)
    assert res.settings["embedding_sigma"] == pytest.approx(float(fresh.std()), rel=1e-6)
    assert res.settings["embedding_sigma"] < 0.5 * float(a.W_E.detach().std())
    assert embedding_stats_at_init([a, b]) == embedding_stats_at_init([b])  # one architecture: one draw
    assert embedding_stats_at_init([a], seed=42) == (res.settings["embedding_mu"], res.settings["embedding_sigma"])


def test_shared_input_z_predicts_the_shift_of_unrelated_features():
    """Features = rho * shared input + independent rest: the z of two such unrelated 'models' is what the input
    alone predicts, and features with no input component predict ~0."""
    g = torch.Generator().manual_seed(0)
    n, d = 400, 48
    x = torch.randn(n, d, generator=g)
    dims = list(range(d))
    for rho in (0.0, 0.1, 0.3):  # measured: z 1.28 / 11.71 against predicted 1.29 / 11.75
        zs, preds = [], []
        for _ in range(10):
            fa = rho * x + math.sqrt(1 - rho**2) * torch.randn(n, d, generator=g)
            fb = rho * x + math.sqrt(1 - rho**2) * torch.randn(n, d, generator=g)
            zs.append(seedprint_test(fa * 10, fb * 10, buffer_k=d).z)
            preds.append(shared_input_z(fa * 10, fb * 10, x * 10, dims))
        z, pred = sum(zs) / 10, sum(preds) / 10
        assert abs(z - pred) < 0.6 + 0.1 * abs(z), (rho, z, pred)
        if rho == 0.0:
            assert abs(pred) < 0.1
        else:
            assert pred > 1
    assert max_shared_input_z(0.01) == pytest.approx(0.5221, abs=1e-4)


def test_unrelated_tiny_models_in_embedding_mode_get_a_caveat(tmp_path, capsys):
    """Two unrelated tiny zoo models pass the shared input straight to the output: z ~ 90 in embedding mode (token
    mode: z ~ -1). The result is inconclusive with a caveat, in the summary, the CLI and the JSON."""
    from sinklens.cli import main
    from support.zoo import zoo_dir, zoo_model

    a, b = zoo_model("llama", d_vocab=4096, seed=0), zoo_model("llama", d_vocab=4096, seed=1)
    res = fingerprint(a, b, n_samples=300, seq_len=16, input="embedding", options=OPTS)
    assert res.same_lineage and res.z > 5  # the authors' rule alone would call them related (z 92.8; 7.1 on TL 3.x)
    assert res.settings["shared_input_z"] > 0.5 * res.z > 3 * max_shared_input_z(0.01)
    assert res.verdict == "inconclusive" and len(res.caveats) == 1
    assert "follow the shared random input embeddings" in res.caveats[0] and "SAME lineage" not in res.summary()
    assert fingerprint(a, b, n_samples=300, seq_len=16, options=OPTS).verdict == "no_evidence"
    out = tmp_path / "fp.json"
    dirs = [str(zoo_dir("llama", d_vocab=4096, seed=s)) for s in (0, 1)]
    assert main(["fingerprint", *dirs, "--samples", "300", "--seq-len", "16", "--input", "embedding",
                 "--json", str(out), "--no-progress", "--batch-size", "300"]) == 0
    printed = capsys.readouterr().out
    assert "INCONCLUSIVE" in printed and "caveat: both models' final states follow the shared" in printed
    data = json.loads(out.read_text())
    assert data["verdict"] == "inconclusive" and data["caveats"][0].startswith("both models' final states follow")


def test_embedding_mode_without_passthrough_has_no_caveat():
    """Blocks with std-1 weights dominate the residual stream: the input's share is ~0, no caveat, and a model
    against itself is still the same lineage."""
    a, b = _sinklm(0, scheme="normal", std=1.0), _sinklm(1, scheme="normal", std=1.0)
    other = fingerprint(a, b, n_samples=300, seq_len=16, input="embedding", options=OPTS)
    assert abs(other.settings["shared_input_z"]) < 0.1 and other.caveats == []
    same = fingerprint(a, a, n_samples=300, seq_len=16, input="embedding", options=OPTS)
    assert same.verdict == "same_lineage" and same.caveats == []


# ------------------------------------------------------------------------------ JSON
def test_cli_json_keeps_full_precision(tmp_path):
    """p and z are written as computed (a 6-digit rounding wrote p = 0.0339653 for both p = 0.03396528083 and
    alpha = 0.03396528762)."""
    from sinklens import load_model
    from sinklens.cli import main
    from support.zoo import zoo_dir

    dirs = [str(zoo_dir("llama", d_vocab=4096, seed=s)) for s in (0, 1)]
    out = tmp_path / "fp.json"
    assert main(["fingerprint", *dirs, "--samples", "100", "--seq-len", "8", "--json", str(out), "--no-progress",
                 "--batch-size", "100"]) == 0
    data = json.loads(out.read_text())
    res = fingerprint(*(load_model(d, check_patterns=False) for d in dirs), n_samples=100, seq_len=8, options=OPTS)
    assert data["z"] == res.z and data["p_value"] == res.p_value and data["tau_mean"] == res.tau_mean
    assert data["tau"] == res.tau.tolist()
    assert f"{res.z:.6g}" != repr(res.z)  # the check has teeth: 6 digits would not round-trip
