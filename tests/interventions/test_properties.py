"""Property-based checks (hypothesis): any positions, layers, alpha or mask shape either works or fails cleanly.

For each generated call on the tiny Llama model: the factory and a forward pass with its hooks either
return finite numbers or raise a :class:`~sinklens.errors.SinklensError` (never a bare
``IndexError``/``RuntimeError`` from deep inside torch), and no hook is left attached afterwards.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sinklens.errors import SinklensError
from sinklens.interventions import (
    amplify, block_keys, calibrate, clamp_dims, create_sink, custom_mask, edit_neurons, restart, self_only,
    transplant_dims,
)
from sinklens.options import RunOptions
from support.checks import no_hooks_left

pytestmark = pytest.mark.models

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
TOKS = torch.randint(2, 64, (2, 12), generator=torch.Generator().manual_seed(11))

ints = st.integers(min_value=-3, max_value=70)
index_like = st.one_of(
    ints,
    st.lists(ints, min_size=0, max_size=4),
    st.lists(st.integers(0, 11), min_size=1, max_size=3).map(np.array),
    st.integers(0, 11).map(torch.tensor),
    st.lists(st.sampled_from([0.5, 1.0, True]), min_size=1, max_size=2),
)
layers_like = st.one_of(st.none(), st.integers(-3, 3), st.lists(st.integers(-3, 3), max_size=3),
                        st.lists(st.sampled_from([0.0, 1.5]), min_size=1, max_size=2))
alpha_like = st.one_of(
    st.floats(min_value=1e-3, max_value=100.0),
    st.integers(-2, 50),
    st.sampled_from([0.0, -1.0, math.nan, math.inf, -math.inf]),
    st.floats(min_value=0.1, max_value=10.0).map(np.float32),
    st.floats(min_value=0.1, max_value=10.0).map(torch.tensor),
)
FACTORIES = {
    "self_only": lambda m, p, l, a: self_only(m, positions=p, layers=l),
    "restart": lambda m, p, l, a: restart(m, positions=p, layers=l),
    "block_keys": lambda m, p, l, a: block_keys(m, positions=p, layers=l, heads=[0, 2]),
    "amplify": lambda m, p, l, a: amplify(m, positions=p, alpha=a, layers=l, reference="batch"),
    "amplify_heads": lambda m, p, l, a: amplify(m, positions=p, alpha=a, layers=l, heads=p, reference="batch"),
    "calibrate": lambda m, p, l, a: calibrate(m, positions=p, layers=l, heads=p),
    "clamp_dims": lambda m, p, l, a: clamp_dims(m, p, positions=0, value=a, layers=l),
    "transplant_dims": lambda m, p, l, a: transplant_dims(m, [1, 2], positions=p, layers=l),
    "edit_neurons": lambda m, p, l, a: edit_neurons(m, p, positions=[1], mode="scale", value=a, layers=l),
}


def _forward_is_finite_or_clean_error(model, make_hooks) -> None:
    try:
        hooks = make_hooks()
        with torch.inference_mode(), model.hooks(fwd_hooks=hooks):
            logits = model(TOKS)
    except SinklensError:
        return
    finally:
        assert no_hooks_left(model)
    assert bool(torch.isfinite(logits).all())


@SETTINGS
@given(name=st.sampled_from(sorted(FACTORIES)), positions=index_like, layers=layers_like, alpha=alpha_like)
def test_factories_work_or_raise_a_sinklens_error(tiny_llama, name, positions, layers, alpha):
    _forward_is_finite_or_clean_error(tiny_llama, lambda: FACTORIES[name](tiny_llama, positions, layers, alpha))


@st.composite
def masks(draw):
    ndim = draw(st.integers(1, 5))
    n = draw(st.sampled_from([12, 12, 12, 11, 13, 0]))
    heads = draw(st.sampled_from([1, 4, 3]))
    batch = draw(st.sampled_from([1, 2, 3]))
    shape = {1: (n,), 2: (n, n), 3: (heads, n, n), 4: (batch, heads, n, n), 5: (1, batch, heads, n, n)}[ndim]
    kind = draw(st.sampled_from(["ones", "random", "eye", "tril", "not_square", "float"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 10_000)))
    if kind == "not_square" and ndim >= 2:
        shape = (*shape[:-1], max(n - 1, 0))
    if kind == "float":
        return torch.rand(shape, generator=gen)
    if kind == "random":
        return torch.rand(shape, generator=gen) > draw(st.floats(0.0, 0.9))
    if kind == "eye" and ndim >= 2 and shape[-1] == shape[-2]:
        return torch.eye(n, dtype=torch.bool).expand(shape).clone()
    if kind == "tril" and ndim >= 2 and shape[-1] == shape[-2]:
        return torch.ones(n, n, dtype=torch.bool).tril().expand(shape).clone()
    return torch.ones(shape, dtype=torch.bool)


@SETTINGS
@given(allowed=masks(), layers=layers_like, heads=st.one_of(st.none(), index_like))
def test_custom_mask_shapes_work_or_raise_a_sinklens_error(tiny_llama, allowed, layers, heads):
    _forward_is_finite_or_clean_error(tiny_llama, lambda: custom_mask(tiny_llama, allowed, layers=layers, heads=heads))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(position=st.one_of(st.integers(-2, 66), st.integers(0, 11).map(np.int64)), layers=layers_like, alpha=alpha_like,
       method=st.sampled_from(["amplify", "self_only", "restart"]))
def test_create_sink_is_finite_or_raises_a_sinklens_error(tiny_llama, position, layers, alpha, method):
    kw = {"alpha": alpha, "reference": "batch"} if method == "amplify" else {}
    try:
        res = create_sink(tiny_llama, TOKS, position, method=method, layers=layers, options=RunOptions(progress=False), **kw)
    except SinklensError:
        assert no_hooks_left(tiny_llama)
        return
    assert no_hooks_left(tiny_llama)
    for value in (res.received_before, res.received_after, res.sink_after, res.resid_norm_after, res.dims_after):
        assert bool(torch.isfinite(value).all())
    assert math.isfinite(res.loss_before) and math.isfinite(res.loss_after)
