"""Models at initialization: RUN_DIR@init is a run's step 0, SPEC@init:S re-draws HF weights by seed."""

from __future__ import annotations

import pytest
import torch
from _origins_cfg import origins_cfg

from sinklens import load_model
from sinklens.errors import InvalidArgumentError
from sinklens.loading.init import load_at_init, parse_init_spec

pytestmark = pytest.mark.models


def test_run_dir_at_init_is_the_runs_step0_weights_bit_exactly(tmp_path):
    from sinklens.train.loop import train

    cfg = origins_cfg(7, steps=5, model={"d_model": 32, "n_ctx": 16, "d_vocab": 64, "d_mlp": 64})
    train(cfg, out_dir=tmp_path / "step0", progress=False, until=0)  # checkpoint written before any step
    train(cfg, out_dir=tmp_path / "run", progress=False)
    step0 = load_model(tmp_path / "step0", check_patterns=False).state_dict()
    at_init = load_model(f"{tmp_path / 'run'}@init", check_patterns=False).state_dict()
    trained = load_model(tmp_path / "run", check_patterns=False).state_dict()
    assert step0.keys() == at_init.keys()
    assert all(torch.equal(step0[k], at_init[k]) for k in step0)
    assert not all(torch.equal(step0[k], trained[k]) for k in step0)  # training moved the weights
    other = load_model(f"{tmp_path / 'run'}@init:8", check_patterns=False).state_dict()
    assert not torch.equal(other["embed.W_E"], step0["embed.W_E"])
    assert torch.equal(load_model(tmp_path / "run", init_seed=7, check_patterns=False).embed.W_E, step0["embed.W_E"])


def test_tl_model_at_init_matches_its_own_seeded_init(tiny_llama):
    fresh = load_at_init(tiny_llama, init_seed=5)
    if hasattr(tiny_llama, "original_model"):  # TransformerLens 4.x bridge: HF from_config under the seed
        from transformers import AutoModelForCausalLM

        torch.manual_seed(5)
        ref = dict(AutoModelForCausalLM.from_config(tiny_llama.original_model.config).named_parameters())
        got = {k.replace("._original_component", ""): v for k, v in fresh.original_model.named_parameters()}
    else:  # TransformerLens 3.x HookedTransformer: its own init with cfg.seed
        import copy

        cfg = copy.deepcopy(tiny_llama.cfg)
        cfg.seed = 5
        ref = dict(type(tiny_llama)(cfg).named_parameters())
        got = dict(fresh.named_parameters())
    assert ref.keys() == got.keys()
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert not torch.equal(fresh.W_E, tiny_llama.W_E)
    assert torch.equal(load_at_init(tiny_llama, init_seed=5).W_E, fresh.W_E)  # deterministic
    assert "blocks.0.attn.hook_pattern" in fresh.hook_dict
    # The 'normal' scheme redraws every matrix with the given std.
    scaled = load_at_init(tiny_llama, init_seed=5, scheme="normal", std=0.5)
    assert scaled.W_in[0].std().item() == pytest.approx(0.5, rel=0.15)


def test_bad_init_specs_name_the_value():
    assert parse_init_spec("x@init:12").seed == 12
    with pytest.raises(InvalidArgumentError, match="x@init:abc"):
        parse_init_spec("x@init:abc")
    with pytest.raises(InvalidArgumentError, match="std"):
        load_at_init("x@init", scheme="normal", std=-1.0)


def test_a_sinklm_at_init_honours_dtype():
    """``load_at_init(sinklm, dtype=torch.float64)`` returned float32 (the other model kinds honoured it)."""
    from sinklens.testing.models import tiny_sinklm

    model = tiny_sinklm(seed=0)
    wide = load_at_init(model, init_seed=1, dtype=torch.float64)
    plain = load_at_init(model, init_seed=1)
    assert {p.dtype for p in wide.parameters()} == {torch.float64}
    assert all(torch.equal(w, p.double()) for w, p in zip(wide.parameters(), plain.parameters()))
