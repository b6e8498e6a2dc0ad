"""Fixes from the interventions audit, each against a hand-written reference or an analytic expectation.

* ``variance_calibration`` as a remove intervention attenuates the sink (it was ``amplify``: factor 1 at t = 0,
  a no-op, and 1/A_00 ≈ 2 on gpt-oss, which strengthened the sink); ``amplify`` at position 0 alone is refused
  where it is the identity.
* ``site="hook_resid_mid"`` on BERT edits the residual right after the attention, before ``ln1``, on both
  TransformerLens versions (the 4.x bridge fires that hook after the MLP).
* :class:`InterventionResult` records the inputs' BOS/special tokens and the method's options.
* ``custom_mask`` over absolute positions works whatever the batching (a larger mask is cut to the run).
* ``patch_sink``'s no-effect guard is relative to the metric and the pattern's dtype.
* ``heads=`` at ``attn.hook_v`` of a grouped-query model is checked against the key/value heads when built.
* ``sinklens intervene --json`` is full precision, and ``--no-bos`` exists.
"""

from __future__ import annotations

import json

import pytest
import torch

from sinklens import cli
from sinklens.errors import InvalidArgumentError
from sinklens.inputs import as_batches
from sinklens.interventions import (
    SinkPatchResult, amplify, block_keys, calibrate, clamp_dims, create_sink, custom_mask, measure_intervention, patch_sink,
    registry, remove_sink, transplant_dims,
)
from sinklens.interventions.calibration import variance_calibration
from sinklens.options import RunOptions
from sinklens.testing import transformer_lens_major
from support.models import tl3_encoder

pytestmark = pytest.mark.models

TL4 = transformer_lens_major() >= 4
QUIET = RunOptions(progress=False)


# ----------------------------------------------------------------------------- 1. variance_calibration as remove


def _attenuate_reference(n_layers: int, positions: list[int]) -> list:
    """Variance calibration (attenuate) written out: ``z_t ← z_t · sqrt(min_t' s_t' / s_t)``, ``s_t = Σ_j A_tj²``
    per (batch, head), at ``positions`` only, in float64 (equal-length sequences: no padding)."""
    s: dict[int, torch.Tensor] = {}
    hooks = []
    for layer in range(n_layers):
        def keep(pattern, hook, layer=layer):
            s[layer] = pattern.double().pow(2).sum(-1)  # [batch, head, query]

        def scale(z, hook, layer=layer):
            sl = s.pop(layer)
            factor = (sl.amin(dim=-1, keepdim=True) / sl).sqrt().transpose(1, 2)  # [batch, query, head]
            out = z.clone()
            out[:, positions] = (z[:, positions].double() * factor[:, positions, :, None]).to(z.dtype)
            return out

        hooks += [(f"blocks.{layer}.attn.hook_pattern", keep), (f"blocks.{layer}.attn.hook_z", scale)]
    return hooks


def test_remove_sink_variance_calibration_attenuates_the_sink(tiny, toks, capture):
    """The registry's remove entry scales the sink's head outputs by sqrt(min_t s_t / s_0) < 1 (s_0 = 1 on a
    causal model): measured numbers equal the hand-written calibration's, and the sink's residual moves. Before the
    fix the entry ran mode="amplify", whose factor at position 0 is exactly 1: nothing changed."""
    z0, p0 = "blocks.0.attn.hook_z", "blocks.0.attn.hook_pattern"
    clean = capture(tiny, toks, [z0, p0])
    got = capture(tiny, toks, [z0], registry.get("variance_calibration")(tiny, positions=0, mode="attenuate"))[z0]
    s = clean[p0].double().pow(2).sum(-1)  # [batch, head, query]
    factor = (s.amin(dim=-1) / s[..., 0]).sqrt()  # [batch, head]: the sink's factor
    torch.testing.assert_close(s[..., 0], torch.ones_like(s[..., 0]))  # causal: A_00 = 1
    assert float(factor.max()) < 0.9  # an attenuation, not the identity
    torch.testing.assert_close(got[:, 0].double(), clean[z0][:, 0].double() * factor[..., None], rtol=1e-5, atol=1e-7)
    assert torch.equal(got[:, 1:], clean[z0][:, 1:])

    result = remove_sink(tiny, toks, method="variance_calibration")
    ref = measure_intervention(tiny, toks, _attenuate_reference(tiny.cfg.n_layers, [0]), target=0)
    torch.testing.assert_close(result.resid_norm_after, ref.resid_norm_after, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(result.received_after, ref.received_after, rtol=1e-5, atol=1e-7)
    assert float((result.resid_norm_after - result.resid_norm_before).abs().max()) > 1e-4 * float(result.resid_norm_before.max())
    assert result.to_dict()["options"]["mode"] == "attenuate"


def test_variance_calibration_amplify_at_position_zero_alone_is_refused_where_it_is_the_identity(tiny, toks):
    """On a causal model without sink logits 1/sqrt(s_0) = 1 exactly: the call is refused by name; with later
    positions it runs and leaves position 0 as it was (the factor there is 1)."""
    with pytest.raises(InvalidArgumentError, match=r"mode='amplify', positions=\[0\]\) does nothing"):
        variance_calibration(tiny, positions=0)
    with pytest.raises(InvalidArgumentError, match="does nothing"):
        registry.build(tiny, "variance_calibration:positions=0,mode=amplify")
    z0 = "blocks.0.attn.hook_z"
    store = {}
    hooks = variance_calibration(tiny, positions=[0, 5]) + [(z0, lambda z, hook: store.__setitem__("z", z.clone()))]
    with torch.inference_mode():
        _, cache = tiny.run_with_cache(toks, names_filter=[z0])
        tiny.run_with_hooks(toks, fwd_hooks=hooks)
    assert torch.equal(store["z"][:, 0], cache[z0][:, 0])
    assert not torch.allclose(store["z"][:, 5], cache[z0][:, 5])


@pytest.mark.skipif(not TL4, reason="the zoo's gpt-oss (learned sink logits) is a TransformerLens 4.x bridge")
def test_variance_calibration_removes_rather_than_strengthens_a_sink_logit_models_sink():
    """gpt-oss: rows give part of their mass to the sink logit, so s_0 = A_00² < 1. The remove entry's factor at
    the sink is sqrt(min_t s_t / s_0) <= 1, as the hand formula says; amplify (the old default) gave 1/A_00 ≈ 2."""
    from support.zoo import FamilyUnavailableError, zoo_model

    try:
        model = zoo_model("gptoss")
    except FamilyUnavailableError as err:
        pytest.skip(str(err))
    gen = torch.Generator().manual_seed(0)
    toks = torch.randint(5, 60, (2, 9), generator=gen)
    toks[:, 0] = 0
    z0, p0 = "blocks.0.attn.hook_z", "blocks.0.attn.hook_pattern"
    with torch.inference_mode():
        _, clean = model.run_with_cache(toks, names_filter=[z0, p0])
        store = {}
        model.run_with_hooks(toks, fwd_hooks=registry.get("variance_calibration")(model, positions=0, mode="attenuate")
                             + [(z0, lambda z, hook: store.__setitem__("z", z.clone()))])
    s = clean[p0].double().pow(2).sum(-1)
    assert float(s[..., 0].max()) < 0.9  # sink logits: A_00 < 1
    factor = (s.amin(dim=-1) / s[..., 0]).sqrt()  # [batch, head]
    assert float(factor.max()) <= 1.0 + 1e-6
    torch.testing.assert_close(store["z"][:, 0].double(), clean[z0][:, 0].double() * factor[..., None], rtol=1e-5, atol=1e-7)
    variance_calibration(model, positions=0)  # amplify at 0 is not the identity here: not refused


# ----------------------------------------------------------------------------- 2. hook_resid_mid on BERT


@pytest.fixture(scope="module")
def bert():
    """``(model, ln1 module, MLP module)`` of layer 0 of a post-LN BERT: the 4.x bridge's Hugging Face modules
    (``attention.output.LayerNorm``, ``intermediate``) or the 3.x ``HookedEncoder``'s ``ln1`` and ``mlp``."""
    if TL4:
        from support.zoo import zoo_model

        model = zoo_model("bert")
        layer = model.original_model.bert.encoder.layer[0]
        return model, layer.attention.output.LayerNorm, layer.intermediate
    model = tl3_encoder()
    return model, model.blocks[0].ln1, model.blocks[0].mlp


def _edit_mid(x: torch.Tensor, edit: str, mu: torch.Tensor) -> torch.Tensor:
    """The analytic edit of the residual after the attention ``x`` [batch, pos, d_model] (positions 2 and 4)."""
    out = x.clone()
    if edit == "clamp_dims":
        out[:, [2, 4], 3] = 5.0
    elif edit == "transplant_dims":
        out[:, 2:3, [1, 3]] = x[:, 0:1, [1, 3]]
        out[:, 4:5, [1, 3]] = x[:, 0:1, [1, 3]]
    elif edit == "amplify":
        out[:, [2, 4]] = mu + 3.0 * (x[:, [2, 4]] - mu)
    else:  # calibrate: the targets' deviation rescaled to the RMS deviation of positions >= 1 that are not targets
        others = [p for p in range(1, x.shape[1]) if p not in (2, 4)]
        m = x[:, others].mean(dim=1, keepdim=True)
        rms = (x[:, others] - m).norm(dim=-1).pow(2).mean(dim=1, keepdim=True).sqrt()[..., None]
        dev = x[:, [2, 4]] - m
        out[:, [2, 4]] = m + dev * rms / dev.norm(dim=-1, keepdim=True)
    return out


@pytest.mark.parametrize("edit", ["clamp_dims", "transplant_dims", "amplify", "calibrate"])
def test_resid_mid_edit_on_bert_reaches_the_mlp_as_the_residual_after_the_attention(bert, edit):
    """The MLP of a post-LN block reads ln1(resid_pre + write). An edit at site="hook_resid_mid" must be an edit of
    resid_pre + write, so the MLP reads ln1(edited): checked with the model's own ln1 and MLP modules (3.x
    HookedEncoder: its hook_resid_mid is that sum; 4.x bridge: the input of the Hugging Face LayerNorm). Before the
    fix the bridge edited ln2's input, after the MLP, and the MLP read the clean residual."""
    model, ln1, mlp = bert
    toks = torch.tensor([[2, 5, 6, 7, 8, 9, 3], [2, 9, 8, 7, 6, 5, 3]])
    seen: dict[str, torch.Tensor] = {}
    handles = [ln1.register_forward_pre_hook(lambda mod, args: seen.__setitem__("x", args[0].detach().clone())),
               mlp.register_forward_pre_hook(lambda mod, args: seen.__setitem__("mlp_in", args[0].detach().clone()))]
    try:
        with torch.no_grad():
            model(toks, return_type=None)
            x = seen["x"]
            mu = x[:, 1:].mean(dim=(0, 1))
            hooks = {
                "clamp_dims": lambda: clamp_dims(model, [3], positions=[2, 4], value=5.0, site="hook_resid_mid", layers=[0]),
                "transplant_dims": lambda: transplant_dims(model, [1, 3], positions=[2, 4], source=0, site="hook_resid_mid",
                                                           layers=[0]),
                "amplify": lambda: amplify(model, positions=[2, 4], alpha=3.0, site="hook_resid_mid", layers=[0],
                                           reference={0: mu}),
                "calibrate": lambda: calibrate(model, positions=[2, 4], site="hook_resid_mid", layers=[0]),
            }[edit]()
            model.run_with_hooks(toks, fwd_hooks=hooks, return_type=None)
            expected, unedited = ln1(_edit_mid(x, edit, mu)), ln1(x)
    finally:
        for h in handles:
            h.remove()
    assert float((seen["mlp_in"] - unedited).abs().max()) > 1e-2  # the edit reached the MLP
    torch.testing.assert_close(seen["mlp_in"], expected, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- 3. options recorded


def test_result_records_the_inputs_and_the_methods_options(tiny):
    texts = ["t5 t6 t7 t8 t9 t10 t11 t12", "t20 t21 t22 t23 t24 t25"]
    for bos in (True, False):
        options = RunOptions(prepend_bos=bos, progress=False)
        res = create_sink(tiny, texts, 4, method="amplify", alpha=3.0, heads=torch.tensor([1]), layers=(0,),
                          reference="batch", options=options)
        batch = as_batches(tiny, texts, prepend_bos=bos)[0]
        recorded = json.loads(json.dumps(res.to_dict(), allow_nan=False))["options"]
        assert recorded == {"alpha": 3.0, "site": "attn.hook_z", "heads": [1], "layers": [0], "reference": "batch",
                            "prepend_bos": bos, "special_tokens": list(batch.special_tokens), "max_length": None}
    assert list(as_batches(tiny, texts, prepend_bos=True)[0].special_tokens)  # the BOS run records its token
    removed = remove_sink(tiny, texts, method="clamp_dims", dims=[1, 2], options=QUIET)
    assert removed.to_dict()["options"] == {"dims": [1, 2], "mode": "set", "value": 0.0, "site": "hook_resid_post",
                                            "layers": None, "prepend_bos": True, "special_tokens":
                                            list(as_batches(tiny, texts)[0].special_tokens), "max_length": None}
    spec = measure_intervention(tiny, texts, "amplify:positions=3,layers=[1]", target=3, options=QUIET)
    assert spec.to_dict()["options"]["alpha"] == 8.0 and spec.to_dict()["options"]["layers"] == [1]
    assert spec.to_dict()["options"]["positions"] == 3


# ----------------------------------------------------------------------------- 4. custom_mask and batching


def test_custom_mask_over_absolute_positions_does_not_depend_on_the_batch_size(tiny):
    """A 13 × 13 mask (BOS + the longest prompt) with prompts of 12, 5 and 9 words: batch size 1 runs sequences of
    6 and 10 positions, which use the mask's top-left block; the numbers equal batch size 8's and those of a
    hand-written hook that cuts the mask itself. A mask smaller than the run is still refused."""
    words = [[f"t{5 + (7 * i + 3 * j) % 50}" for j in range(n)] for i, n in enumerate((12, 5, 9))]
    texts = [" ".join(w) for w in words]
    allowed = torch.tril(torch.ones(13, 13, dtype=torch.bool))
    allowed[6:, :6] = False
    allowed[6:, 0] = True

    def cut(scores, hook):
        n = scores.shape[-1]
        return scores.masked_fill(~allowed[:n, :n], float("-inf"))

    reference = [(f"blocks.{layer}.attn.hook_attn_scores", cut) for layer in range(tiny.cfg.n_layers)]
    ref = measure_intervention(tiny, texts, reference, target=3, options=RunOptions(batch_size=1, progress=False))
    for size in (8, 1):
        got = measure_intervention(tiny, texts, custom_mask(tiny, allowed), target=3,
                                   options=RunOptions(batch_size=size, progress=False))
        torch.testing.assert_close(got.received_after, ref.received_after, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got.resid_norm_after, ref.resid_norm_after, rtol=1e-5, atol=1e-6)
    assert float((ref.received_after - ref.received_before).abs().max()) > 1e-3
    with pytest.raises(InvalidArgumentError, match=r"at least \(13, 13\)"):
        measure_intervention(tiny, texts, custom_mask(tiny, allowed[:8, :8]), target=3, options=QUIET)


# ----------------------------------------------------------------------------- 5. patch_sink's no-effect guard


def _patch_result(clean: float, intervened: float, dtype: str = "float32") -> SinkPatchResult:
    values = torch.tensor([[clean, intervened], [intervened, 0.5 * (clean + intervened)]], dtype=torch.float64)
    return SinkPatchResult(site="z", axes=("layer", "head"), coords={"layer": [0, 1], "head": [0, 1]}, values=values,
                           clean=clean, intervened=intervened, target=0, metric_layers=[0, 1], pattern_dtype=dtype)


def test_patch_result_treats_a_rounding_gap_as_no_effect():
    """The BERT + calibrate numbers of the audit: a gap of 1.9e-9 on a metric of 0.143 is float32 rounding (1.3e-8
    relative), not an effect; restored is undefined rather than noise / noise = 0 or 1. A real gap gives the
    analytic fractions 1, 0, 0 and 1/2; bfloat16 patterns need a gap of a few of its eps."""
    noise = _patch_result(0.14282751083374023, 0.14282750897109509)
    assert not noise.has_effect
    with pytest.raises(InvalidArgumentError, match="float32 rounding"):
        noise.restored
    assert [row["restored"] for row in noise.to_rows()] == [None] * 4
    real = _patch_result(0.2, 0.1)
    assert real.has_effect
    torch.testing.assert_close(real.restored, torch.tensor([[1.0, 0.0], [0.0, 0.5]], dtype=torch.float64))
    assert [row["restored"] for row in real.to_rows()] == pytest.approx([1.0, 0.0, 0.0, 0.5])
    assert _patch_result(0.2, 0.1999, "float32").has_effect  # 5e-4 relative: beyond float32 rounding
    assert not _patch_result(0.2, 0.1999, "bfloat16").has_effect  # within bfloat16's (eps 7.8e-3)
    assert _patch_result(0.16662370, 0.16662367, "float32").has_effect  # 1.8e-7 relative: 1.5 float32 eps


def test_patch_sink_on_a_rounding_level_intervention_restores_nothing(sharp):
    """An intervention that multiplies every layer's attention scores by (1 + 2^-23), one float32 ulp: the metric
    moves by a fraction of float32 precision (0.06 to 0.2 eps on the sharp tiny models, never 0), and patch_sink's
    rows say so (restored None) instead of fractions of noise (the absolute 1e-12 guard turned them into 0s and 1s)."""
    toks = torch.randint(2, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    hooks = [(f"blocks.{layer}.attn.hook_attn_scores", lambda scores, hook: scores * (1 + 2.0 ** -23))
             for layer in range(sharp.cfg.n_layers)]
    result = patch_sink(sharp, toks, hooks, target=0, site="z", layers=[0])
    gap = abs(result.clean - result.intervened)
    assert 1e-12 < gap <= torch.finfo(torch.float32).eps * abs(result.clean)
    assert [row["restored"] for row in result.to_rows()] == [None] * sharp.cfg.n_heads
    assert result.pattern_dtype == "float32" and not result.has_effect
    block = patch_sink(sharp, toks, block_keys(sharp, positions=0, layers=[0]), target=0, site="z", layers=[0])
    assert block.has_effect and block.restored.shape == (1, sharp.cfg.n_heads)  # a real effect is kept


# ----------------------------------------------------------------------------- 6. heads at hook_v under GQA


def test_amplify_heads_at_hook_v_index_the_key_value_heads_and_are_checked_when_built(tiny_llama, toks, capture):
    """tiny_llama has 4 query heads sharing 2 key/value heads: heads=[3] at attn.hook_v is refused when the hooks
    are built (it used to fail inside the forward); heads=[1] amplifies key/value head 1 alone."""
    assert tiny_llama.cfg.n_key_value_heads == 2
    with pytest.raises(InvalidArgumentError, match="2 key/value heads.*head 3 is out of range"):
        amplify(tiny_llama, positions=4, alpha=2.0, site="attn.hook_v", heads=[3], reference="batch")
    with pytest.raises(InvalidArgumentError, match="key/value heads"):
        calibrate(tiny_llama, positions=0, site="attn.hook_v", heads=[2])
    v0 = "blocks.0.attn.hook_v"
    clean = capture(tiny_llama, toks, [v0])[v0]
    assert clean.shape[2] == 2
    got = capture(tiny_llama, toks, [v0], amplify(tiny_llama, positions=4, alpha=2.0, site="attn.hook_v", heads=[1],
                                                   layers=[0], reference="batch"))[v0]
    keep = [p for p in range(1, toks.shape[1]) if p != 4]
    mu = clean[:, keep].mean(dim=1)
    torch.testing.assert_close(got[:, 4, 1], mu[:, 1] + 2.0 * (clean[:, 4, 1] - mu[:, 1]), rtol=1e-5, atol=1e-6)
    assert torch.equal(got[:, 4, 0], clean[:, 4, 0])


# ----------------------------------------------------------------------------- 7, 8. the CLI


@pytest.fixture
def cli_model(tiny, monkeypatch):
    import sinklens.loading

    monkeypatch.setattr(sinklens.loading, "load_model", lambda spec, **kw: tiny)
    return tiny


def test_cli_json_is_full_precision_and_equals_to_dict(cli_model, tmp_path):
    text = " ".join(f"t{i}" for i in range(3, 15))
    out = tmp_path / "r.json"
    assert cli.main(["intervene", "--method", "restart", "--position", "4", "--text", text, "--json", str(out)]) == 0
    direct = create_sink(cli_model, [text], 4, method="restart", options=QUIET).to_dict()
    written = json.loads(out.read_text())
    for key in ("before", "after", "received_after", "resid_norm_after", "dims_after", "loss_after"):
        assert written[key] == direct[key], key  # exactly: no rounding to 6 significant digits


def test_cli_no_bos(cli_model, tmp_path):
    """--no-bos: text prompts get no BOS and random sequences none either, as in analyze; the JSON says so."""
    text = " ".join(f"t{i}" for i in range(3, 15))
    out = tmp_path / "r.json"
    assert cli.main(["intervene", "--method", "restart", "--position", "4", "--text", text, "--no-bos",
                     "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    direct = create_sink(cli_model, [text], 4, method="restart", options=RunOptions(prepend_bos=False, progress=False))
    assert written["after"] == direct.to_dict()["after"]
    assert written["options"]["prepend_bos"] is False and written["options"]["special_tokens"] == []
    with_bos = create_sink(cli_model, [text], 4, method="restart", options=QUIET).to_dict()["after"]
    assert written["after"] != with_bos
    out2 = tmp_path / "r2.json"
    assert cli.main(["intervene", "--method", "block-keys", "--random-tokens", "3", "--seq-len", "8", "--no-bos",
                     "--json", str(out2)]) == 0
    assert json.loads(out2.read_text())["options"]["prepend_bos"] is False


def test_cli_no_bos_on_a_run_without_a_tokenizer(tmp_path, capsys):
    """A sinklens train run on a synthetic task: intervene runs it on random tokens that start with its BOS token
    0, and with --no-bos on the same random tokens without it, as analyze does; the numbers equal remove_sink's on
    those batches."""
    from sinklens.inputs import random_token_batches
    from sinklens.loading import load_model
    from sinklens.sinklm.checkpoint import save_checkpoint
    from sinklens.sinklm.config import ModelConfig, TrainConfig
    from sinklens.sinklm.model import SinkLM

    run = tmp_path / "run"
    cfg = TrainConfig.from_dict({**TrainConfig().to_dict(), "model": ModelConfig.from_preset("tiny").to_dict()})
    save_checkpoint(run, model=SinkLM(cfg.model), optimizer=None, cfg=cfg, step=0)
    model = load_model(str(run))
    for flags, bos in (([], True), (["--no-bos"], False)):
        out = tmp_path / f"bos{bos}.json"
        assert cli.main(["intervene", "--model", str(run), "--method", "block-keys", "--seq-len", "16", "--no-loss",
                         "--json", str(out), *flags]) == 0
        assert ("starting with the task's BOS token 0" in capsys.readouterr().err) is bos
        written = json.loads(out.read_text())
        batches = random_token_batches(model, n_sequences=16, seq_len=16, batch_size=8, prepend_bos=bos)
        assert bool((torch.cat([b.tokens[:, 0] for b in batches]) == 0).all()) is bos
        direct = remove_sink(model, batches, method="block_keys", loss=False, options=QUIET).to_dict()
        assert written["before"] == direct["before"] and written["options"]["prepend_bos"] is bos


def test_variance_calibration_as_a_spec_stays_causal_amplify():
    """remove_sink's attenuate default must not reach specs: a training-time ``--intervention variance_calibration``
    stored as that string would have switched a run to attenuate (whose floor reads later queries) on resume."""
    from sinklens.interventions import registry
    from sinklens.interventions.calibration import variance_calibration
    from support.zoo import zoo_model

    model = zoo_model("llama")
    tokens = torch.tensor([[0, 5, 6, 7, 8, 9, 10, 11]])
    spec = model.run_with_hooks(tokens, fwd_hooks=registry.build(model, "variance_calibration"))
    amplify = model.run_with_hooks(tokens, fwd_hooks=variance_calibration(model, mode="amplify"))
    torch.testing.assert_close(spec, amplify, rtol=0, atol=0)
    prefix = model.run_with_hooks(tokens[:, :5], fwd_hooks=registry.build(model, "variance_calibration"))
    torch.testing.assert_close(spec[:, :5], prefix, rtol=1e-5, atol=1e-5)  # causal: later tokens change nothing


def test_creating_a_sink_where_the_sink_already_is_is_refused(tmp_path):
    """``intervene --method restart --position 0`` ran as a no-op (ratio 1.00 in every layer) with exit 0."""
    from sinklens.errors import InvalidArgumentError
    from sinklens.interventions.experiments import create_sink
    from support.zoo import zoo_model

    model = zoo_model("llama")
    with pytest.raises(InvalidArgumentError, match=r"position=0 is the sink itself \(sink=0\)"):
        create_sink(model, ["t3 t4 t5 t6"], 0, method="restart")
    with pytest.raises(InvalidArgumentError, match=r"position=2 is the sink itself \(sink=2\)"):
        create_sink(model, ["t3 t4 t5 t6"], 2, sink=2, method="self_only")
