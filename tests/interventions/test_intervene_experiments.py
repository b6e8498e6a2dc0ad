"""create_sink / remove_sink / sweep / patch_sink / CLI on tiny models, and hook hygiene."""

import json

import pytest
import torch

from sinklens import cli
from sinklens.analysis.attention import AttentionReceivedReducer
from sinklens.inputs import as_batches
from sinklens.interventions import (
    amplify, block_keys, create_sink, patch_sink, remove_sink, restart, self_only, sweep,
)
from sinklens.options import RunOptions
from sinklens.streaming import stream

pytestmark = pytest.mark.models


def test_hooks_compose_with_stream(tiny, toks):
    batches = as_batches(tiny, toks)
    (clean,) = stream(tiny, batches, [AttentionReceivedReducer(tiny, min_query=1)], options=RunOptions(progress=False))
    cut_opts = RunOptions(progress=False, extra_hooks=block_keys(tiny, positions=0))
    (cut,) = stream(tiny, batches, [AttentionReceivedReducer(tiny, min_query=1)], options=cut_opts)
    assert float(clean.at(0).min()) > 0
    assert float(cut.at(0).abs().max()) == 0.0


def test_remove_sink_block_zeroes_received(tiny, toks):
    res = remove_sink(tiny, toks, method="block")
    assert res.target == 0 and float(res.received_after.abs().max()) == 0.0
    assert float(res.received_before.min()) > 0
    assert res.received_before.shape == (tiny.cfg.n_layers, tiny.cfg.n_heads)


def test_create_sink_restart_hides_old_sink(tiny, toks):
    res = create_sink(tiny, toks, 5, method="restart")
    assert float(res.sink_after.abs().max()) == 0.0  # queries after 5 no longer see position 0
    assert float(res.received_after.mean()) > float(res.received_before.mean())  # fewer keys share the mass
    d = json.loads(json.dumps(res.to_dict()))
    assert {"layers", "before", "after"} <= d.keys() and len(d["after"]) == tiny.cfg.n_layers
    torch.testing.assert_close(torch.tensor(d["after"]), res.received_after.mean(dim=1))


def test_identity_intervention_changes_nothing(tiny, toks):
    res = create_sink(tiny, toks, 4, method="variance", alpha=1.0, reference="batch")
    torch.testing.assert_close(res.received_after, res.received_before)
    torch.testing.assert_close(res.resid_norm_after, res.resid_norm_before)
    assert res.loss_after == pytest.approx(res.loss_before, abs=1e-9)


def test_self_only_measures_and_plots(tiny, toks, tmp_path):
    res = create_sink(tiny, toks, 6, method="self-only", dims=[0, 1])
    assert res.dims == [0, 1] and res.dims_after.shape == (tiny.cfg.n_layers, 2)
    assert res.loss_before > 0 and res.loss_after > 0
    res.plot(tmp_path / "fig.png")
    assert (tmp_path / "fig.png").stat().st_size > 0


def test_sweep_rows(tiny, toks):
    rows = sweep(tiny, toks, method="variance", positions=[3, 6], layer_sets=[None, [1]], alphas=[2.0, 5.0],
                 reference="batch", options=RunOptions(progress=False))
    assert len(rows) == 2 * 2 * 2 * tiny.cfg.n_layers
    assert {"position", "layers", "alpha", "layer", "received_before", "received_after"} <= rows[0].keys()
    # intervening only in layer 1 leaves layer 0 untouched
    for row in rows:
        if row["layers"] == [1] and row["layer"] == 0:
            assert row["received_after"] == pytest.approx(row["received_before"], abs=1e-7)


def test_patching_restores_exactly_where_the_intervention_is(sharp, toks):
    tiny = sharp
    """Amplify pos 3 at layer 1's resid_pre; patching that very activation restores 1, earlier ones 0."""
    hooks = amplify(tiny, positions=3, alpha=6.0, site="hook_resid_pre", layers=[1], reference="batch")
    res = patch_sink(tiny, toks, hooks, target=3, site="resid_pre", positions=[0, 2, 3])
    assert res.values.shape == (tiny.cfg.n_layers, 3) and res.axes == ("layer", "pos")
    assert abs(res.clean - res.intervened) > 1e-4
    restored = res.restored
    assert restored[1, 2] == pytest.approx(1.0, abs=1e-4)  # (layer 1, pos 3)
    torch.testing.assert_close(restored[0], torch.zeros(3), atol=1e-4, rtol=0)  # layer 0 is clean anyway
    torch.testing.assert_close(restored[1, :2], torch.zeros(2), atol=1e-4, rtol=0)  # causal: earlier positions
    assert res.top(1)[0][0] == {"layer": 1, "pos": 3}


def test_patching_by_head_matches_a_hand_loop(sharp, toks):
    tiny = sharp
    hooks = amplify(tiny, positions=3, alpha=6.0, site="attn.hook_z", layers=[0], reference="batch")
    res = patch_sink(tiny, toks, hooks, target=3, site="z", metric_layers=[1])
    clean_z = tiny.run_with_cache(toks, names_filter="blocks.0.attn.hook_z")[1]["blocks.0.attn.hook_z"]
    for head in (0, 2):
        def patch(act, hook, head=head):
            act = act.clone()
            act[:, :, head] = clean_z[:, :, head]
            return act

        captured = {}

        def grab(pattern, hook):
            captured["p"] = pattern[:, :, 4:, 3].mean()

        tiny.run_with_hooks(toks, fwd_hooks=hooks + [("blocks.0.attn.hook_z", patch), ("blocks.1.attn.hook_pattern", grab)])
        assert float(res.values[0, head]) == pytest.approx(float(captured["p"].detach()), abs=1e-5)


def test_cli_intervene(tiny, tmp_path, monkeypatch, capsys):
    import sinklens.loading

    monkeypatch.setattr(sinklens.loading, "load_model", lambda spec, **kw: tiny)
    out = tmp_path / "r.json"
    text = " ".join(f"t{i}" for i in range(3, 15))
    rc = cli.main(["intervene", "--method", "restart", "--position", "4", "--text", text, "--json", str(out), "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["layers"] == list(range(tiny.cfg.n_layers)) and len(data["before"]) == len(data["after"])
    printed = capsys.readouterr().out
    assert "layer" in printed and f"{data['after'][0]:8.4f}" in printed
    assert (tmp_path / "intervention.png").exists()
    assert cli.main(["intervene", "--method", "variance", "--text", text]) == 2  # no --position
    assert cli.main(["intervene", "--method", "self-only", "--position", "500", "--text", text]) == 2


def test_errors(tiny, toks):
    with pytest.raises(ValueError, match="Unknown create intervention"):
        create_sink(tiny, toks, 3, method="teleport")
    with pytest.raises(ValueError, match="out of range"):
        create_sink(tiny, toks, 999)
    with pytest.raises(ValueError, match="No query after"):
        create_sink(tiny, toks, 11)
    with pytest.raises(ValueError, match="needs dims"):
        remove_sink(tiny, toks, method="clamp")
    with pytest.raises(ValueError, match="needs neurons"):
        remove_sink(tiny, toks, method="ablate-neurons")


def test_works_inside_hooks_context_and_leaves_no_hooks(tiny, toks, no_hooks_left):
    hooks = self_only(tiny, positions=4) + restart(tiny, positions=7)
    with torch.inference_mode():
        with tiny.hooks(fwd_hooks=hooks):
            inside = tiny(toks)
        assert no_hooks_left(tiny)
        torch.testing.assert_close(inside, tiny.run_with_hooks(toks, fwd_hooks=hooks))
    assert no_hooks_left(tiny)

    def boom(act, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        stream(
            tiny, as_batches(tiny, toks), [AttentionReceivedReducer(tiny)],
            options=RunOptions(extra_hooks=hooks + [("blocks.1.hook_resid_pre", boom)], progress=False),
        )
    assert no_hooks_left(tiny)
    with pytest.raises(RuntimeError, match="boom"):
        patch_sink(tiny, toks, hooks + [("blocks.1.mlp.hook_post", boom)], target=4, site="z")
    assert no_hooks_left(tiny)
    with pytest.raises(ValueError):
        with tiny.hooks(fwd_hooks=self_only(tiny, positions=40)):
            tiny(toks)
    assert no_hooks_left(tiny)


def test_hooks_support_backward_for_training(tiny, toks, no_hooks_left):
    """The trainer reuses these hooks: gradients flow through every kind and stay finite."""
    from sinklens.interventions import calibrate, edit_neurons, transplant_dims

    hooks = (self_only(tiny, positions=4) + block_keys(tiny, positions=0, layers=[1])
             + amplify(tiny, positions=6, alpha=3.0, reference="batch") + calibrate(tiny, layers=[0])
             + edit_neurons(tiny, [1, 2], positions=0, layers=[0]) + transplant_dims(tiny, [3], positions=[5]))
    tiny.zero_grad()
    loss = tiny.run_with_hooks(toks, fwd_hooks=hooks, return_type="loss")
    loss.backward()
    grads = [p.grad for p in tiny.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
    tiny.zero_grad()
    assert no_hooks_left(tiny)


def test_sinklens_0_1_run_keywords_warn_and_take_effect(tiny, toks, capsys):
    """Every field of ``RunOptions`` given as a 0.1 keyword is folded into ``options`` with one deprecation warning,
    by one helper for analyzers, experiments and patching."""
    cut = block_keys(tiny, positions=0)
    with pytest.warns(DeprecationWarning, match=r"create_sink\(extra_hooks=\) is deprecated"):
        old = create_sink(tiny, toks, 5, method="restart", extra_hooks=cut)
    new = create_sink(tiny, toks, 5, method="restart", options=RunOptions(progress=False, extra_hooks=cut))
    assert float(old.sink_before.abs().max()) == 0.0  # the extra hooks ran in the clean run too
    torch.testing.assert_close(old.received_after, new.received_after, rtol=0, atol=0)
    with pytest.warns(DeprecationWarning, match=r"patch_sink\(progress=\) is deprecated"):
        patch_sink(tiny, toks, block_keys(tiny, positions=0), site="z", layers=0, progress=True)
    assert "patch" in capsys.readouterr().err  # the progress bar was shown
