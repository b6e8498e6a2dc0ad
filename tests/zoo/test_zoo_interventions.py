"""Attention interventions on every family of the zoo: a mask either takes effect exactly or is refused.

TransformerLens 4.x runs BERT's attention inside the Hugging Face module and fires ``hook_attn_scores`` /
``hook_pattern`` afterwards with the post-softmax weights, so an edit there is discarded (TransformerLens
only warns). Before sinklens checked for this, ``sinklens intervene --method self-only`` on BERT printed
"ratio 1.00" for every layer and query-key locking counted probabilities as scores.
"""

from __future__ import annotations

import pytest
import torch

from sinklens.analysis.qk_locking import query_key_locking
from sinklens.errors import UnsupportedArchitectureError
from sinklens.hooks import PATTERN, SCORES, hook_name
from sinklens.probes import post_hoc_attention
from sinklens.interventions import (amplify, block_keys, calibrate, clamp_dims, custom_mask, edit_neurons, restart, self_only,
                                    transplant_dims)
from sinklens.interventions.calibration import variance_calibration
from support.zoo import FAMILIES, MOE_FAMILIES, POST_NORM_FAMILIES, FamilyUnavailableError, zoo_model

from _zoo_reference import TL4

pytestmark = pytest.mark.models

#: Families whose attention hooks are fired after the fact, per installed TransformerLens.
POST_HOC = {"bert"} if TL4 else set()
TOKENS = torch.tensor([[0, 5, 6, 7, 8, 9, 10]])
TARGET = 3


def _model(family: str):
    try:
        return zoo_model(family)
    except FamilyUnavailableError as err:
        pytest.skip(str(err))


def _sink_logits(model, layer: int) -> torch.Tensor | None:
    """gpt-oss's learned per-head sink logits ``[head]`` from the Hugging Face model behind the bridge."""
    for name, param in model.named_parameters():
        if name.replace("._original_component", "").endswith(f"layers.{layer}.self_attn.sinks"):
            return param.detach()
    raise AssertionError("no sink logits found on the gpt-oss model")


@pytest.mark.parametrize("family", FAMILIES)
def test_self_only_takes_effect_exactly_or_is_refused(family):
    """Where the hooks are seams, ``self_only`` leaves the target with attention on its own key only:
    weight 1, or on gpt-oss ``exp(s) / (exp(s) + exp(sink_h))`` from its unmasked score ``s`` and the head's
    sink logit (as position 0 splits it). Where they are not, every attention edit refuses up front."""
    model = _model(family)
    if family in POST_HOC:
        assert "post-softmax" in post_hoc_attention(model)
        allowed = torch.ones(len(TOKENS[0]), len(TOKENS[0]), dtype=torch.bool)
        for build in (lambda: self_only(model, positions=TARGET), lambda: block_keys(model, positions=0),
                      lambda: restart(model, positions=TARGET), lambda: custom_mask(model, allowed),
                      lambda: variance_calibration(model)):
            with pytest.raises(UnsupportedArchitectureError, match="discarded"):
                build()
        with pytest.raises(UnsupportedArchitectureError, match="post-softmax"):
            query_key_locking(model, TOKENS)
        return
    assert post_hoc_attention(model) is None
    layer = 0
    seen: dict[str, torch.Tensor] = {}

    def keep(key: str):
        def hook(act, hook):
            seen[key] = act.detach().clone()

        return hook

    hooks = [(hook_name(layer, SCORES), keep("scores"))] + self_only(model, positions=TARGET, layers=[layer])
    hooks.append((hook_name(layer, PATTERN), keep("pattern")))
    model.run_with_hooks(TOKENS, fwd_hooks=hooks)
    row = seen["pattern"][0, :, TARGET].double()  # [head, key]
    others = torch.ones(row.shape[-1], dtype=torch.bool)
    others[TARGET] = False
    assert torch.equal(row[:, others], torch.zeros_like(row[:, others]))
    sinks = _sink_logits(model, layer) if family == "gptoss" else None
    if sinks is None:
        expected = torch.ones(row.shape[0], dtype=torch.float64)
    else:
        own = seen["scores"][0, :, TARGET, TARGET].double()
        expected = torch.sigmoid(own - sinks.double())
        assert float(expected.max()) < 0.99  # the sink logit really takes a share here
    torch.testing.assert_close(row[:, TARGET], expected, rtol=1e-5, atol=1e-6)


def test_cli_intervene_refuses_a_post_hoc_model(tmp_path, capsys):
    """``sinklens intervene --method self-only`` on BERT (TransformerLens 4.x): one line, exit 2, no figure."""
    if not TL4:
        pytest.skip("BERT's bridge is TransformerLens 4.x")
    from sinklens.cli import main
    from support.zoo import zoo_dir

    out = tmp_path / "out"
    code = main(["intervene", "--model", str(zoo_dir("bert")), "--method", "self-only", "--position", "3",
                 "--text", "t5 t6 t7 t8 t9", "--out", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if line.startswith("sinklens")]  # (transformers prints progress)
    assert "Traceback" not in err and len(ours) == 1
    assert ours[0].startswith("sinklens intervene: error: Mask interventions") and "post-softmax" in ours[0]
    assert not (out / "intervention.png").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_neuron_edits_zero_one_neuron_or_are_refused(family):
    """Zeroing neuron 3 of layer 0 removes exactly ``act_3 · W_out[0][3]`` from ``hook_mlp_out`` (where no norm
    follows the MLP); a mixture of experts, whose ``hook_post`` is not per neuron (the 4.x gpt-oss bridge fires
    it with the ``d_model`` output), refuses instead of editing a column of that output."""
    model = _model(family)
    if family in MOE_FAMILIES:
        with pytest.raises(UnsupportedArchitectureError, match="mixture of experts"):
            edit_neurons(model, {0: [3]})
        return
    seen: dict[str, torch.Tensor] = {}

    def keep(key: str):
        def hook(act, hook):
            seen[key] = act.detach().clone()

        return hook

    names = ("blocks.0.mlp.hook_post", "blocks.0.hook_mlp_out")
    model.run_with_hooks(TOKENS, fwd_hooks=[(n, keep(f"clean {n}")) for n in names])
    model.run_with_hooks(TOKENS, fwd_hooks=edit_neurons(model, {0: [3]}) + [(n, keep(f"edited {n}")) for n in names])
    post = seen["clean blocks.0.mlp.hook_post"]
    assert post.shape[-1] == model.cfg.d_mlp and float(post[..., 3].abs().max()) > 0
    assert torch.equal(seen["edited blocks.0.mlp.hook_post"][..., 3], torch.zeros_like(post[..., 3]))
    change = seen["clean blocks.0.hook_mlp_out"] - seen["edited blocks.0.hook_mlp_out"]
    if family in POST_NORM_FAMILIES or family == "bert":
        assert float(change.abs().max()) > 0  # through the post norm: changed, not by the raw row
    else:
        expected = post[..., 3:4] * model.W_out[0][3].detach()
        torch.testing.assert_close(change, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_next_token_loss_only_where_it_is_defined(family):
    """A decoder's loss is the mean next-token cross-entropy of its logits; an encoder has none (it sees the
    token it would predict), so the default leaves it NaN (JSON null, no CLI line) and ``loss=True`` refuses."""
    import argparse
    import math

    from sinklens.commands.intervene import loss_note
    from sinklens.inputs import as_batches
    from sinklens.interventions import create_sink

    model = _model(family)
    prompts = ["t5 t6 t7 t8 t9 t10", "t11 t12 t13 t14 t15"]
    res = create_sink(model, prompts, TARGET, method="amplify", alpha=1.0)
    args = argparse.Namespace(no_loss=False)
    if family == "bert":
        assert math.isnan(res.loss_before) and math.isnan(res.loss_after)
        assert "encoder" in loss_note(model, args)
        with pytest.raises(UnsupportedArchitectureError, match="encoder"):
            create_sink(model, prompts, TARGET, method="amplify", loss=True)
        return
    assert loss_note(model, args) is None
    total, count = 0.0, 0
    for prompt in prompts:  # one at a time: no padding
        (batch,) = as_batches(model, [prompt])
        with torch.no_grad():
            logits = model(batch.tokens, return_type="logits")[0, :-1].double()
        total += float(torch.nn.functional.cross_entropy(logits, batch.tokens[0, 1:], reduction="sum"))
        count += batch.tokens.shape[1] - 1
    assert res.loss_before == pytest.approx(total / count, rel=1e-5)
    assert res.loss_after == pytest.approx(res.loss_before, rel=1e-5)  # alpha = 1: the identity


RESID_MID_EDITS = {
    "clamp_dims": lambda m: clamp_dims(m, [1, 3], positions=2, site="hook_resid_mid", layers=0, value=7.0),
    "transplant_dims": lambda m: transplant_dims(m, [1, 3], positions=2, site="hook_resid_mid", layers=0),
    "amplify": lambda m: amplify(m, positions=2, site="hook_resid_mid", layers=0, alpha=5.0, reference="batch"),
    "calibrate": lambda m: calibrate(m, positions=2, site="hook_resid_mid", layers=0),
}


@pytest.mark.parametrize("edit", sorted(RESID_MID_EDITS))
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("neox", "bert")])
def test_an_edit_at_resid_mid_reaches_the_residual_stream(family, edit):
    """What the MLP reads at ``hook_resid_mid`` is what the block carries on past it (``hook_resid_post −
    hook_mlp_out``), edit included. On the 4.x bridges the hook is a copy only the MLP reads: before the edit
    went through the attention write there, the stream kept the unedited residual (off by the edit, e.g. 7 − x
    in the clamped dimensions) while the MLP read the edited one."""
    model = _model(family)
    seen: dict[str, torch.Tensor] = {}

    def keep(key: str):
        return lambda act, hook: seen.__setitem__(key, act.detach().clone())

    reads = [(hook_name(0, site), keep(site)) for site in ("hook_resid_mid", "hook_mlp_out", "hook_resid_post")]
    with torch.no_grad():
        model.run_with_hooks(TOKENS.repeat(2, 1), fwd_hooks=RESID_MID_EDITS[edit](model) + reads, return_type=None)
    carried = seen["hook_resid_post"] - seen["hook_mlp_out"]
    scale = float(seen["hook_resid_mid"].abs().max())
    assert float((carried - seen["hook_resid_mid"]).abs().max()) <= 1e-5 * scale
    if edit == "clamp_dims":
        assert carried[:, 2, [1, 3]].flatten().tolist() == pytest.approx([7.0] * 4, abs=1e-4)
