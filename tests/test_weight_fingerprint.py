"""The weight fingerprint that guards sinklens' caches of weight-only quantities must see every edit of the weights,
including writes through a ``.data`` alias (which bypass the autograd version counter), wherever they land."""
import pytest
import torch

from sinklens import measure_value_drain, measure_variance
from sinklens.hooks import _STAT_CACHES, weight_fingerprint
from sinklens.testing import QUIET, tiny_model
from support.checks import VARIED_PROMPTS

pytestmark = pytest.mark.models


def _strided_samples(param, n=16):
    """The flat indices a fingerprint that sampled ``n`` evenly strided entries would read."""
    step = max(param.numel() // n, 1)
    return torch.arange(0, param.numel(), step)[:n]


def test_fingerprint_sees_one_entry_edited_through_data_anywhere():
    model = tiny_model("llama", seed=3)
    before = weight_fingerprint(model)
    assert weight_fingerprint(model) == before  # no edit: the same key (the checksum is deterministic)
    generator = torch.Generator().manual_seed(0)
    for name, param in model.named_parameters():
        flat = param.data.view(-1)
        for index in torch.randint(0, flat.numel(), (3,), generator=generator).tolist():
            old = flat[index].item()
            flat[index] = old + 1e-3 * (1.0 + abs(old))
            assert weight_fingerprint(model) != before, f"{name}[{index}] edited through .data went unseen"
            flat[index] = old
            assert weight_fingerprint(model) == before, f"{name}[{index}] restored, yet the key differs"


def test_fingerprint_sees_permuted_rows_and_columns():
    """Small integers, so that any sum over the entries is exact in float32 whatever their order: only a
    checksum that weighs each entry by where it stands tells the permuted matrices apart."""
    model = tiny_model("llama", seed=3)
    param = next(p for p in model.parameters() if p.dim() >= 2 and p.shape[0] > 1 and p.shape[-1] > 1)
    exact = (torch.arange(param.numel()) % 7 - 3).reshape(param.shape).to(param.dtype)
    param.data.copy_(exact)
    before = weight_fingerprint(model)
    param.data.copy_(exact.flip(0))  # same values, rows swapped: a sum or any per-column statistic is unchanged
    assert weight_fingerprint(model) != before
    param.data.copy_(exact.flip(-1))  # columns swapped: any per-row statistic is unchanged
    assert weight_fingerprint(model) != before
    param.data.copy_(exact)
    assert weight_fingerprint(model) == before


def test_weight_statistics_follow_edits_that_miss_any_strided_sample():
    """``measure_variance``'s output-projection Grams and ``measure_value_drain``'s write norms are cached per
    model; every weight scaled ×2 through ``.data`` except at the entries a strided sample would read must give
    the numbers of a fresh computation, not the cached ones."""
    model = tiny_model("llama", seed=5)
    variance = measure_variance(model, VARIED_PROMPTS, options=QUIET)
    drain = measure_value_drain(model, VARIED_PROMPTS, options=QUIET)
    for param in model.parameters():
        if param.dim() >= 2:
            keep = torch.zeros(param.numel(), dtype=torch.bool)
            keep[_strided_samples(param)] = True
            flat = param.data.view(-1)
            flat[~keep] *= 2.0
    edited_variance = measure_variance(model, VARIED_PROMPTS, options=QUIET)
    edited_drain = measure_value_drain(model, VARIED_PROMPTS, options=QUIET)
    _STAT_CACHES.pop(model, None)  # what a fresh process computes
    fresh_variance = measure_variance(model, VARIED_PROMPTS, options=QUIET)
    fresh_drain = measure_value_drain(model, VARIED_PROMPTS, options=QUIET)
    assert not torch.allclose(fresh_variance.result_var, variance.result_var)  # the edit changes the numbers
    assert not torch.allclose(fresh_drain.write_sink, drain.write_sink)
    torch.testing.assert_close(edited_variance.result_var, fresh_variance.result_var)
    torch.testing.assert_close(edited_drain.write_sink, fresh_drain.write_sink)
    torch.testing.assert_close(edited_drain.write_other, fresh_drain.write_other)
