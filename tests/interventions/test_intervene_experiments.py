"""create_sink / remove_sink / sweep / patch_sink / CLI on tiny models, and hook hygiene."""

import json

import pytest
import torch

from sinklens import cli
from sinklens.analysis.attention import AttentionReceivedReducer
from sinklens.inputs import as_batches
from sinklens.interventions import (
    amplify, block_keys, create_sink, measure_intervention, patch_sink, remove_sink, restart, self_only, sweep,
)
from sinklens.options import RunOptions
from sinklens.plotting.interventions import plot_intervention
from sinklens.streaming import stream

pytestmark = pytest.mark.models


def test_hooks_compose_with_stream(tiny, toks):
    batches = as_batches(tiny, toks)
    (clean,) = stream(tiny, batches, [AttentionReceivedReducer(tiny, min_query=1)], options=RunOptions(progress=False))
    cut_opts = RunOptions(progress=False, extra_hooks=block_keys(tiny, positions=0))
    (cut,) = stream(tiny, batches, [AttentionReceivedReducer(tiny, min_query=1)], options=cut_opts)
    assert float(clean.at(0).min()) > 0
    assert float(cut.at(0).abs().max()) == 0.0


@pytest.mark.parametrize(("method", "extra"), [("self_only", {}), ("restart", {}), ("transplant_dims", {"dims": [1, 2]})])
def test_an_experiment_does_not_depend_on_how_prompts_fall_into_batches(tiny, method, extra):
    """Prompts of 10 and 3 tokens, a sink created at 5: one batch of both, or one batch each (the short one alone
    has no position 5; it used to raise "Position 5 is out of range for a sequence of 3 tokens"), give the same
    numbers, since a sequence too short to hold the target is left as it is either way."""
    prompts = ["t3 t4 t5 t6 t7 t8 t9 t10 t11", "t9 t10"]
    one, each = (create_sink(tiny, prompts, 5, method=method, options=RunOptions(progress=False, batch_size=size), **extra)
                 for size in (2, 1))
    for key, value in one.to_dict().items():
        if isinstance(value, list) and value and not isinstance(value[0], (str, int)):
            assert torch.tensor(each.to_dict()[key]) == pytest.approx(torch.tensor(value), abs=1e-5), key
    assert each.loss_after == pytest.approx(one.loss_after, abs=1e-5)


PADDING_SENSITIVE = {  # interventions that take statistics over a sequence's positions
    "amplify, batch reference": lambda m, p, o: create_sink(m, p, 3, method="amplify", reference="batch", options=o),
    "calibrate": lambda m, p, o: remove_sink(m, p, method="calibrate", options=o),
    "variance calibration, attenuate": lambda m, p, o: measure_intervention(
        m, p, "variance_calibration:mode=attenuate", target=0, options=o),
}


@pytest.mark.parametrize("experiment", sorted(PADDING_SENSITIVE))
def test_statistics_over_positions_leave_padding_out(tiny, experiment):
    """Three prompts of 10, 7 and 12 tokens in one padded batch or one at a time give the same numbers: the
    hooks' per-sequence statistics (the batch mean, the others' RMS, the attenuate floor) skip padding, which
    they used to average in (resid norms off by up to 0.36 on 3.x, 0.005 on 4.x)."""
    prompts = ["t3 t4 t5 t6 t7 t8 t9 t10 t11", "t11 t12 t13 t14 t15 t16", "t20 t21 t22 t23 t24 t25 t26 t27 t28 t29 t30"]
    run = PADDING_SENSITIVE[experiment]
    padded, alone = (run(tiny, prompts, RunOptions(progress=False, batch_size=size)) for size in (3, 1))
    assert float((padded.resid_norm_after - alone.resid_norm_after).abs().max()) <= 1e-5 * float(alone.resid_norm_after.max())
    assert float((padded.received_after - alone.received_after).abs().max()) <= 1e-6
    assert padded.loss_after == pytest.approx(alone.loss_after, abs=1e-6)


def test_to_dict_is_strict_json_when_no_loss_was_computed(tiny, toks):
    res = create_sink(tiny, toks, 5, loss=False)
    assert res.loss_before != res.loss_before  # NaN on the result itself
    data = json.loads(json.dumps(res.to_dict(), allow_nan=False))
    assert data["loss_before"] is None and data["loss_after"] is None
    assert data["before"] == res.received_layer_before.tolist()  # full precision


def test_remove_sink_block_zeroes_received(tiny, toks):
    res = remove_sink(tiny, toks, method="block_keys")
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
    res = create_sink(tiny, toks, 4, method="amplify", alpha=1.0, reference="batch")
    torch.testing.assert_close(res.received_after, res.received_before)
    torch.testing.assert_close(res.resid_norm_after, res.resid_norm_before)
    assert res.loss_after == pytest.approx(res.loss_before, abs=1e-9)


def test_self_only_measures_and_plots(tiny, toks, tmp_path):
    res = create_sink(tiny, toks, 6, method="self-only", dims=[0, 1])
    assert res.dims == [0, 1] and res.dims_after.shape == (tiny.cfg.n_layers, 2)
    assert res.loss_before > 0 and res.loss_after > 0
    plot_intervention(res, tmp_path / "fig.png")
    assert (tmp_path / "fig.png").stat().st_size > 0


def test_sweep_rows(tiny, toks):
    rows = sweep(tiny, toks, method="amplify", positions=[3, 6], layer_sets=[None, [1]], alphas=[2.0, 5.0],
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
    torch.testing.assert_close(restored[0], torch.zeros(3, dtype=torch.float64), atol=1e-4, rtol=0)  # layer 0 is clean anyway
    torch.testing.assert_close(restored[1, :2], torch.zeros(2, dtype=torch.float64), atol=1e-4, rtol=0)  # causal: earlier positions
    assert res.top(1)[0][0] == {"layer": 1, "pos": 3}
    from sinklens.plotting.interventions import plot_patching

    ax = plot_patching(res).axes[0]
    assert ax.get_xlabel() == "pos" and [t.get_text() for t in ax.get_xticklabels()] == ["0", "2", "3"]
    assert ax.images[0].get_array()[1, 2] == pytest.approx(1.0, abs=1e-4)


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

    loaded = []
    monkeypatch.setattr(sinklens.loading, "load_model", lambda spec, **kw: loaded.append(kw) or tiny)
    out = tmp_path / "r.json"
    text = " ".join(f"t{i}" for i in range(3, 15))
    rc = cli.main(["intervene", "--method", "restart", "--position", "4", "--text", text, "--json", str(out), "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads(out.read_text())
    # the model flags reach the loader and the run; one prompt per batch gives the same numbers
    rc = cli.main(["intervene", "--method", "restart", "--position", "4", "--text", text, "--text", text + " t20",
                   "--json", str(tmp_path / "b1.json"), "--batch-size", "1", "--device", "cpu", "--dtype", "float32"])
    rc2 = cli.main(["intervene", "--method", "restart", "--position", "4", "--text", text, "--text", text + " t20",
                    "--json", str(tmp_path / "b2.json")])
    assert rc == rc2 == 0
    assert loaded[1] == {"device": "cpu", "dtype": "float32"} and loaded[2] == {"device": None, "dtype": None}
    one, two = (json.loads((tmp_path / f).read_text()) for f in ("b1.json", "b2.json"))
    assert one["after"] == pytest.approx(two["after"], abs=1e-6) and one["before"] == pytest.approx(two["before"], abs=1e-6)
    assert data["layers"] == list(range(tiny.cfg.n_layers)) and len(data["before"]) == len(data["after"])
    printed = capsys.readouterr().out
    assert "layer" in printed and f"{data['after'][0]:8.4f}" in printed
    assert (tmp_path / "intervention.png").exists()
    assert cli.main(["intervene", "--method", "amplify", "--text", text]) == 2  # no --position
    assert cli.main(["intervene", "--method", "self-only", "--position", "500", "--text", text]) == 2


def test_errors(tiny, toks):
    with pytest.raises(ValueError, match="Unknown create intervention"):
        create_sink(tiny, toks, 3, method="teleport")
    with pytest.raises(ValueError, match="out of range"):
        create_sink(tiny, toks, 999)
    with pytest.raises(ValueError, match="No query after"):
        create_sink(tiny, toks, 11)
    with pytest.raises(ValueError, match="needs dims"):
        remove_sink(tiny, toks, method="clamp_dims")
    with pytest.raises(ValueError, match="needs neurons"):
        remove_sink(tiny, toks, method="edit-neurons")


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


def test_run_options_extra_hooks_and_progress_take_effect(tiny, toks, capsys):
    """``options.extra_hooks`` run in the clean run too; ``options.progress`` shows patch_sink's bar."""
    cut = block_keys(tiny, positions=0)
    res = create_sink(tiny, toks, 5, method="restart", options=RunOptions(progress=False, extra_hooks=cut))
    assert float(res.sink_before.abs().max()) == 0.0  # the extra hooks ran in the clean run too
    patch_sink(tiny, toks, block_keys(tiny, positions=0), site="z", layers=0, options=RunOptions(progress=True))
    assert "patch" in capsys.readouterr().err  # the progress bar was shown
