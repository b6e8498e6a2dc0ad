"""SeedPrint between models of different hidden sizes, as the authors' ``run_test`` handles them (YnezT0311/SeedPrints
``seedprint.py`` lines 173-262 at commit 1ceb956): identity dims are index sets, the coset is their intersection, so
both feature matrices are read at dims that exist in both. Token mode only (their README: "the only viable option when
comparing models with different hidden sizes"); embedding mode and ``base`` mode with A's dims outside B are refused."""

from __future__ import annotations

import importlib
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sinklens.errors import InvalidArgumentError
from sinklens.options import RunOptions
from sinklens.origins.fingerprint import fingerprint, seedprint_test

fp_module = importlib.import_module("sinklens.origins.fingerprint")  # the module (sinklens.origins.fingerprint is also a function)

pytestmark = pytest.mark.models
OPTS = RunOptions(batch_size=200, progress=False)


def authors_run_test(hs_base, hs_target, buffer_k, identity_mode="coset"):
    """The authors' ``run_test`` (analytical, ``use_agg=False``), written out independently of sinklens:
    ``get_identity_indices`` (l. 23-36: ``topk(mean over samples, buffer_k, largest=False)``), ``get_co_positions``
    (l. 39-41: set intersection), ``run_test`` l. 216-227 (sorted indices, ``normalize_features(..., "softmax_T10")``
    = ``softmax(x / 10, dim=1)``), ``compute_per_dim_correlation`` (l. 73-98: scipy ``kendalltau`` per column),
    ``get_null_params`` / ``_kendall_tau_null_std`` (l. 101-130), l. 243 (z) and l. 258-259 (``log p``, ``p``)."""
    from scipy.stats import kendalltau, norm

    bot_a = torch.topk(hs_base.mean(dim=0), buffer_k, largest=False).indices.tolist()
    if identity_mode == "coset":
        bot_b = torch.topk(hs_target.mean(dim=0), buffer_k, largest=False).indices.tolist()
        idx = sorted(set(bot_a) & set(bot_b))
    else:
        idx = sorted(set(bot_a))
    k, n = len(idx), hs_base.shape[0]
    a_norm = F.softmax(hs_base[:, idx] / 10.0, dim=1).numpy()
    b_norm = F.softmax(hs_target[:, idx] / 10.0, dim=1).numpy()  # raises IndexError for a dim outside B
    corr = torch.tensor([kendalltau(a_norm[:, i], b_norm[:, i])[0] for i in range(k)])
    perdim_mean = corr.mean().item()
    perdim_std = np.sqrt(2.0 * (2 * n + 5) / (9.0 * n * (n - 1))) / np.sqrt(k)
    z = (perdim_mean - 0.0) / max(perdim_std, 1e-10)
    log_p = np.log(2) + norm.logsf(z)
    return {"k": k, "dims": idx, "tau": perdim_mean, "z": z, "p": min(1.0, np.exp(log_p)), "log10_p": log_p / np.log(10)}


def _planted(n=400, d_a=48, d_b=64, seed=0):
    """A (width d_a) and B (width d_b) over the same n samples: B's first d_a columns follow A's (a shared, descending
    mean profile: the planted bottom), and B's extra columns d_a.. hold its very lowest means (dims A does not have,
    so B's bottom-k reaches outside A's width and the coset must drop them)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, d_a, generator=g) - torch.linspace(0, 3, d_a)
    extra = torch.randn(n, d_b - d_a, generator=g) - 4.0
    b = torch.cat([a + 0.7 * torch.randn(n, d_a, generator=g), extra], dim=1)
    return a, b


def _assert_matches(res, ref):
    assert res.n_dims == ref["k"] and res.dims == ref["dims"]
    assert res.tau_mean == pytest.approx(ref["tau"], rel=1e-6)
    assert res.z == pytest.approx(ref["z"], rel=1e-6)
    assert res.p_value == pytest.approx(ref["p"], rel=1e-6, abs=1e-300)
    assert res.log10_p == pytest.approx(ref["log10_p"], rel=1e-6)


@pytest.mark.parametrize("buffer_k", [20, 40])
@pytest.mark.parametrize("order", ["narrow_first", "wide_first"])
def test_different_widths_match_the_authors_coset_test(buffer_k, order):
    a, b = _planted()
    if order == "wide_first":
        a, b = b, a
    res = seedprint_test(a, b, buffer_k=buffer_k)
    ref = authors_run_test(a, b, buffer_k)
    _assert_matches(res, ref)
    assert 2 < res.n_dims < buffer_k  # the planted bottom is shared; B's extra low dims are not in A
    assert max(res.dims) < 48 and res.same_lineage and res.z > 10
    assert res.settings["widths"] == [a.shape[1], b.shape[1]]
    assert "hidden sizes 48 and 64" in res.summary() or "hidden sizes 64 and 48" in res.summary()


def test_unrelated_features_of_different_widths_match_the_authors_too():
    a, _ = _planted(seed=1)
    g = torch.Generator().manual_seed(7)
    b = torch.randn(400, 64, generator=g) - torch.linspace(0, 3, 64)
    res, ref = seedprint_test(a, b, buffer_k=30), authors_run_test(a, b, 30)
    _assert_matches(res, ref)
    assert abs(res.z) < 4


def test_buffer_k_between_the_widths_is_clipped_per_matrix():
    """buffer_k = 56 exceeds A's width 48 (the authors' topk would raise there; sinklens clips k to each matrix's own
    width, its documented difference): A keeps all 48 dims, B its own bottom 56, the coset is their intersection."""
    from scipy.stats import kendalltau

    a, b = _planted()
    res = seedprint_test(a, b, buffer_k=56)
    dims = sorted(set(range(48)) & set(torch.topk(b.mean(0), 56, largest=False).indices.tolist()))
    assert res.dims == dims and 2 < res.n_dims < 48
    a_norm, b_norm = F.softmax(a[:, dims] / 10, 1).numpy(), F.softmax(b[:, dims] / 10, 1).numpy()
    tau = float(np.mean([kendalltau(a_norm[:, i], b_norm[:, i])[0] for i in range(len(dims))]))
    assert res.tau_mean == pytest.approx(tau, rel=1e-6)
    assert res.z == pytest.approx(tau / (math.sqrt(2 * (2 * 400 + 5) / (9 * 400 * 399)) / math.sqrt(len(dims))), rel=1e-6)


def test_base_mode_follows_the_authors_where_their_indexing_works():
    """Base mode reads B at A's dims (run_test l. 221, 227): fine when A is the narrower one (numbers as theirs)."""
    a, b = _planted()
    res, ref = seedprint_test(a, b, buffer_k=20, identity_mode="base"), authors_run_test(a, b, 20, "base")
    _assert_matches(res, ref)
    assert res.n_dims == 20


def test_base_mode_with_dims_outside_b_is_refused_by_name():
    """A wider than B with A's bottom dims at or above B's width: theirs raises IndexError (hs_target[:, idx])."""
    b, a = _planted()  # a: width 64 whose lowest dims are 48..63; b: width 48
    with pytest.raises(IndexError):
        authors_run_test(a, b, 20, "base")
    with pytest.raises(InvalidArgumentError, match=r"hidden sizes 64 \(A\) and 48 \(B\)") as err:
        seedprint_test(a, b, buffer_k=20, identity_mode="base")
    assert "identity_mode='coset'" in str(err.value) and "dims 48, 49" in str(err.value)
    assert seedprint_test(a, b, buffer_k=20).n_dims > 2  # coset works on the same pair


def test_shapes_that_cannot_be_paired_are_still_refused():
    """Without pytest's jaxtyping wrapper (which would refuse these first), as a user's call runs."""
    import inspect

    plain = inspect.unwrap(seedprint_test)
    h = torch.randn(50, 8)
    with pytest.raises(InvalidArgumentError, match="same number of rows"):
        plain(h, torch.randn(40, 8))
    with pytest.raises(InvalidArgumentError, match=r"\(50, 8\) and \(400,\)"):
        plain(h, torch.randn(400))
    assert plain(h, torch.randn(50, 12), buffer_k=4).settings["widths"] == [8, 12]


# ------------------------------------------------------------------------------ models
@pytest.fixture(scope="module")
def narrow_and_wide():
    from sinklens.testing import tiny_model

    sizes = dict(n_layers=2, n_heads=4, n_ctx=16, d_vocab=4096, seed=0)
    return tiny_model(d_model=16, d_mlp=32, **sizes), tiny_model(d_model=32, d_mlp=64, **sizes)


def test_models_of_different_hidden_sizes_are_compared_in_token_mode(narrow_and_wide):
    narrow, wide = narrow_and_wide
    res = fingerprint(narrow, wide, n_samples=200, seq_len=8, options=OPTS)
    assert math.isfinite(res.z) and math.isfinite(res.p_value) and res.n_dims >= 2
    assert max(res.dims) < 16 and res.settings["widths"] == [16, 32] and res.settings["input"] == "token"
    assert "hidden sizes 16 and 32" in res.summary()
    back = fingerprint(wide, narrow, n_samples=200, seq_len=8, options=OPTS)  # coset is symmetric
    assert back.dims == res.dims and back.z == pytest.approx(res.z, rel=1e-9)
    assert back.settings["widths"] == [32, 16]
    assert json.loads(json.dumps(res.to_dict()))["settings"]["widths"] == [16, 32]


def test_embedding_mode_with_different_hidden_sizes_is_refused_before_any_forward(narrow_and_wide, monkeypatch):
    narrow, wide = narrow_and_wide
    ran = []
    monkeypatch.setattr(fp_module, "final_hidden_states", lambda *a, **k: ran.append(1))
    with pytest.raises(InvalidArgumentError, match=r"d_model=16 \(A\) and d_model=32 \(B\)") as err:
        fingerprint(narrow, wide, n_samples=50, seq_len=8, input="embedding", options=OPTS)
    assert "input='token'" in str(err.value) and ran == []


def test_base_mode_of_a_wider_model_a_is_refused_before_b_runs(narrow_and_wide, monkeypatch):
    narrow, wide = narrow_and_wide
    real, ran = fp_module.final_hidden_states, []

    def counted(model, **kw):
        ran.append(model)
        return real(model, **kw)

    monkeypatch.setattr(fp_module, "final_hidden_states", counted)
    with pytest.raises(InvalidArgumentError, match=r"hidden sizes 32 \(A\) and 16 \(B\)"):
        fingerprint(wide, narrow, n_samples=50, seq_len=8, identity_mode="base", options=OPTS)
    assert ran == [wide]
    ran.clear()
    res = fingerprint(narrow, wide, n_samples=50, seq_len=8, identity_mode="base", options=OPTS)  # A narrower
    assert res.n_dims == 16 and len(ran) == 2


def test_cli_compares_different_hidden_sizes_and_refuses_embedding_mode(tmp_path, capsys):
    from sinklens.cli import main
    from support.zoo import zoo_dir

    dirs = [str(zoo_dir("llama", d_model=d, d_mlp=2 * d, d_vocab=4096, seed=0)) for d in (16, 32)]
    out = tmp_path / "fp.json"
    assert main(["fingerprint", *dirs, "--samples", "200", "--seq-len", "8", "--json", str(out), "--no-progress",
                 "--batch-size", "200"]) == 0
    assert "hidden sizes 16 and 32" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["settings"]["widths"] == [16, 32] and data["z"] is not None and math.isfinite(data["z"])
    assert main(["fingerprint", *dirs, "--samples", "200", "--seq-len", "8", "--input", "embedding",
                 "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert "d_model=16 (A) and d_model=32 (B)" in captured.err and "--input token" in captured.err
    assert "Traceback" not in captured.err + captured.out
