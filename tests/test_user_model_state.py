"""sinklens measures the model, not the state a notebook left it in, and gives that state back.

Its one-off architecture probes run with the hooks already on the model silenced and in eval mode, and keep their
answers off the model; reference means are the weights'; global settings (default dtype, the random number
generator) neither break a call nor change under it; a model without values (``meta``) is refused by name."""
import copy

import pytest
import torch

import sinklens
from sinklens.errors import InvalidArgumentError
from sinklens.probes import attends_to_later_keys, post_hoc_attention
from sinklens.interventions.variance import reference_mean
from sinklens.testing import QUIET, tiny_model
from support.checks import VARIED_PROMPTS
from sinklens.visibility import attention_visibility

pytestmark = pytest.mark.models

TOKENS = torch.tensor([[0, 5, 6, 7, 8, 9, 10, 11], [0, 12, 13, 14, 15, 16, 17, 18]])
PATTERN0 = "blocks.0.attn.hook_pattern"


def _uniform_over_all_keys(pattern, hook):
    """A user's ablation: every query attends to every key, later ones included (not causal on purpose)."""
    return torch.full_like(pattern, 1.0 / pattern.shape[-1])


def _small(arch="llama", **kw):
    return tiny_model(arch, n_layers=2, d_model=16, n_heads=4, d_mlp=32, n_ctx=64, d_vocab=64, **kw)


def test_a_users_hook_during_the_first_call_does_not_describe_the_model_for_good():
    model, fresh = _small(), _small()
    with model.hooks(fwd_hooks=[(PATTERN0, _uniform_over_all_keys)]):
        assert not attends_to_later_keys(model)  # the architecture is causal, whatever the hook does
        assert post_hoc_attention(model) is None  # its pattern is a seam: mask interventions may run
        sinklens.remove_sink(model, TOKENS, options=QUIET)  # refused before: "attention ... cannot be edited"
        hooked = sinklens.find_sinks(model, TOKENS, options=QUIET)
    assert attention_visibility(model).causal
    assert "_sinklens_probes" not in vars(model)  # nothing stored on the user's model
    after = sinklens.find_sinks(model, TOKENS, options=QUIET)
    assert after == sinklens.find_sinks(fresh, TOKENS, options=QUIET)
    assert not torch.allclose(hooked.received, after.received)  # inside the block the hooked model was measured
    assert sinklens.remove_sink(model, TOKENS, options=QUIET) == sinklens.remove_sink(fresh, TOKENS, options=QUIET)


def test_the_users_hooks_are_kept_and_run_in_sinklens_passes():
    """Hooks the user attached stay attached, and the analyzers measure the hooked model (as ``extra_hooks`` do)."""
    model = _small()
    calls = []
    model.add_hook("blocks.0.hook_resid_post", lambda act, hook: calls.append(act.shape) or act * 2.0, is_permanent=True)
    try:
        hooked = sinklens.find_sinks(model, TOKENS, options=QUIET)
        assert calls, "the user's permanent hook did not run in the analysis pass"
        expected = sinklens.find_sinks(_small(), TOKENS, options=sinklens.RunOptions(
            progress=False, extra_hooks=[("blocks.0.hook_resid_post", lambda act, hook: act * 2.0)]))
        assert hooked == expected
        assert len(model.hook_dict["blocks.0.hook_resid_post"]._forward_hooks) == 1
    finally:
        model.reset_hooks(including_permanent=True)


def test_reference_means_are_the_weights_whatever_hook_is_active():
    model = _small()
    kw = dict(site="attn.hook_z", n_sequences=4, seq_len=10, seed=1)
    plain = reference_mean(model, cache=False, **kw)
    steer = [("blocks.0.attn.hook_z", lambda z, hook: z + 5.0)]
    with model.hooks(fwd_hooks=steer):
        during = reference_mean(model, **kw)  # computed, and cached, while the steering hook is on
    for layer in plain:
        torch.testing.assert_close(during[layer], plain[layer])
        torch.testing.assert_close(reference_mean(model, **kw)[layer], plain[layer])


def test_probes_on_a_model_in_train_mode_leave_the_global_generator_alone():
    model = _small("gpt2")
    if not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        for m in model.modules():  # TransformerLens 3's config-built models have no dropout: give them one
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.1
    model.train()
    torch.manual_seed(0)
    sinklens.find_sinks(model, VARIED_PROMPTS, options=QUIET)  # its first call: every probe runs
    drawn = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(drawn, torch.rand(3))
    assert model.training


def test_float64_default_dtype_with_a_float32_model():
    model, other = _small(), _small()  # both float32, built before the default changes
    want = sinklens.analyze(model, VARIED_PROMPTS, abs_threshold=None, rel_threshold=2.0, options=QUIET)
    want_drain = sinklens.measure_value_drain(model, VARIED_PROMPTS, options=QUIET)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = sinklens.analyze(other, VARIED_PROMPTS, abs_threshold=None, rel_threshold=2.0, options=QUIET)
        drain = sinklens.measure_value_drain(other, VARIED_PROMPTS, options=QUIET)
    finally:
        torch.set_default_dtype(before)
    torch.testing.assert_close(got.sinks.received, want.sinks.received)
    torch.testing.assert_close(got.variance.result_var, want.variance.result_var)
    torch.testing.assert_close(drain.write_sink, want_drain.write_sink)


@pytest.mark.parametrize("call", ["find_sinks", "analyze", "remove_sink", "contraction"])
def test_a_model_on_the_meta_device_is_refused_by_name(call):
    model = copy.deepcopy(_small()).to("meta")
    run = {
        "find_sinks": lambda: sinklens.find_sinks(model, TOKENS, options=QUIET),
        "analyze": lambda: sinklens.analyze(model, TOKENS, options=QUIET),
        "remove_sink": lambda: sinklens.remove_sink(model, TOKENS, options=QUIET),
        "contraction": lambda: sinklens.origins.contraction(model, n_sequences=4, seq_len=4, options=QUIET),
    }[call]
    with pytest.raises(InvalidArgumentError, match="meta device .*materialise it first"):
        run()


@pytest.mark.parametrize("setup", ["train with block 0 in eval", "eval with block 1 in train"])
def test_fingerprint_gives_every_submodule_its_own_mode_back(setup):
    from sinklens.origins.fingerprint import final_hidden_states

    def modes(model):
        found = {name: m.training for name, m in model.named_modules()}
        inner = getattr(model, "original_model", None)
        return found | ({f"hf.{n}": m.training for n, m in inner.named_modules()} if inner is not None else {})

    model = _small("gpt2")
    if setup.startswith("train"):
        model.train()
        model.blocks[0].eval()
    else:
        model.eval()
        model.blocks[1].train()
    before = modes(model)
    final_hidden_states(model, n_samples=4, seq_len=8, options=QUIET)
    assert modes(model) == before
    sinklens.fingerprint(model, _small("gpt2", seed=1), n_samples=8, seq_len=8, buffer_k=2, options=QUIET)
    assert modes(model) == before
