"""The prefix's share of attention against prefix and input length, analytic on a planted model."""

from __future__ import annotations

import json

import pytest
import torch

from sinklens.export import dumps
from sinklens.peft import PrefixTuning, PrefixTuningPlus
from sinklens.peft.sinks import measure_prefix_sinks
from sinklens.testing import tiny_model

pytestmark = pytest.mark.models  # also run under TransformerLens 3.x (tests/test_tl3_compat.py)

LENGTHS = [4, 8, 32]
PREFIXES = [1, 4, 16]


@pytest.fixture(scope="module")
def planted():
    """Queries zeroed at layer 0: every score there is 0, so a query at position i puts P/(P+i+1) on the prefix."""
    model = tiny_model("llama")
    zero_q = ("blocks.0.attn.hook_q", lambda q, hook: torch.zeros_like(q))
    adapters = [PrefixTuning(model, p, reparam=False, seed=p) for p in PREFIXES] + [PrefixTuningPlus(model, init_std=0.1)]
    tokens = torch.randint(8, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    with model.hooks(fwd_hooks=[zero_q]):
        return measure_prefix_sinks(model, adapters, tokens, input_lengths=LENGTHS)


def test_prefix_mass_is_the_analytic_share(planted):
    for a, p in enumerate(PREFIXES):
        for j, n in enumerate(LENGTHS):
            expected = sum(p / (p + i + 1) for i in range(1, n)) / (n - 1)
            torch.testing.assert_close(planted.prefix_mass[a, j, 0], torch.full((4,), expected), atol=1e-5, rtol=0)


def test_prefix_share_rises_with_prefix_length_and_falls_with_input_length(planted):
    mass = planted.mean("prefix_mass")[: len(PREFIXES)]
    assert (mass[1:] > mass[:-1]).all()  # longer prefix: more mass
    assert (mass[:, 1:] < mass[:, :-1]).all()  # longer input: less mass


def test_the_prefix_takes_mass_from_position_zero(planted):
    """With a prefix in the softmax position 0 keeps (i+1)/(P+i+1) of its input share; Prefix-Tuning+ leaves it."""
    p0 = planted.mean("pos0_mass")
    base = planted.mean("base_pos0_mass")
    assert (p0[: len(PREFIXES)] < base).all()
    torch.testing.assert_close(planted.pos0_mass[-1, :, 0], planted.base_pos0_mass[:, 0])


def test_prefix_plus_has_no_attention_mass_but_an_output_share(planted):
    assert torch.isnan(planted.prefix_mass[-1]).all()
    assert ((planted.output_share[-1] > 0) & (planted.output_share[-1] < 1)).all()


def test_json_is_strict(planted):
    data = json.loads(dumps(planted.to_dict()))
    assert data["prefix_mass"][-1][0][0][0] is None and data["input_lengths"] == LENGTHS


def test_the_figure_draws_each_curve(planted):
    from sinklens.plotting.peft import plot_prefix_sinks

    fig = plot_prefix_sinks(planted)
    left, right = fig.axes[:2]
    assert len(left.get_lines()) == 3 * 2 + 1  # mass and share per prefix, share only for Prefix-Tuning+
    assert len(right.get_lines()) == 4 + 1  # each adapter and the model without one
