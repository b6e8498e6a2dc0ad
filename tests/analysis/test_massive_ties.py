"""find_massive_activations: which sequence an event reports, and so its ``event_ratio``, does not depend on the
order of the prompts, their batching or the order reducers are merged in. With BOS at position 0 every sequence
has the same sink activation, so they all tie for the largest ``|x|``; the tie goes to the larger ratio (the
smallest median), then the larger signed value."""

import itertools

import pytest
import torch

import sinklens
from sinklens.analysis.disparity import MassiveActivationsReducer
from sinklens.inputs import TokenBatch
from sinklens.testing import QUIET

pytestmark = pytest.mark.models

D_MODEL, N_POS = 16, 4
# (median |x| of the sequence, signed value at (pos 0, dim 0)): every |value| is 100, a three-way tie.
# Ratios 100, 200, 200: the second and third tie again on the ratio; the larger signed value (+100) wins.
PLANTED = {"A": (1.0, 100.0), "B": (0.5, 100.0), "C": (0.5, -100.0)}


def planted_acts(names):
    """Residual activations ``[len(names), N_POS, D_MODEL]``: every entry is the sequence's median except the
    planted ``(pos 0, dim 0)``, so its median ``|x|`` is exactly that (63 of 64 entries)."""
    acts = torch.stack([torch.full((N_POS, D_MODEL), PLANTED[n][0]) for n in names])
    acts[:, 0, 0] = torch.tensor([PLANTED[n][1] for n in names])
    return acts


def reducer_over(model, groups):
    """A reducer fed the planted activations of ``groups`` (one batch per group), through its own hooks."""
    reducer = MassiveActivationsReducer(model, streams=[0], abs_threshold=None, rel_threshold=10.0)
    for names in groups:
        batch = TokenBatch(torch.zeros(len(names), N_POS, dtype=torch.long),
                           torch.ones(len(names), N_POS, dtype=torch.bool), True)
        fold = reducer.fwd_hooks(batch)
        for _, fn in fold.hooks:
            fn(planted_acts(names), hook=None)
        reducer.end_batch(batch, fold)
    return reducer


def only_event(result):
    assert result.events.tolist() == [[0, 0, 0]] and result.n_events == 1
    return float(result.event_value[0]), float(result.event_ratio[0])


def test_a_planted_tie_reports_the_largest_ratio_in_every_order(tiny_llama):
    orders = list(itertools.permutations("ABC"))
    within_a_batch = {only_event(reducer_over(tiny_llama, ["".join(o)]).result()) for o in orders}
    one_per_batch = {only_event(reducer_over(tiny_llama, [[n] for n in o]).result()) for o in orders}
    assert within_a_batch == one_per_batch == {(100.0, 200.0)}  # B: |x| 100, median 0.5, value +100
    for first, second in (("A", "BC"), ("BC", "A"), ("C", "AB"), ("AB", "C"), ("B", "C"), ("C", "B")):
        merged = reducer_over(tiny_llama, [list(first)])
        merged.merge(reducer_over(tiny_llama, [list(second)]))
        expected = max(((abs(v), 100.0 / m, v) for m, v in (PLANTED[n] for n in first + second)))
        assert only_event(merged.result()) == (expected[2], expected[1]), (first, second)
    assert only_event(reducer_over(tiny_llama, [["A", "C"]]).result()) == (-100.0, 200.0)  # ratio before sign


def test_event_ratio_on_a_model_is_the_largest_over_the_tied_sequences(tiny_llama):
    """A value planted at the sink (the same in every sequence) ties across sequences whose medians differ: the
    ratio is the planted value over the smallest median, whatever the order or the batch size."""
    prompts = ["t11 t12", "t13 t14 t15 t16 t17", "t20 t21 t22", "t5 t6 t7 t8 t9 t10"]
    medians = []

    def plant(act, hook):
        act = act.clone()
        act[:, 0, 3] = 50.0
        if act.shape[0] == 1:
            medians.append(float(act.abs().flatten().kthvalue((act[0].numel() + 1) // 2).values))
        return act

    def run(ps, batch_size):
        options = QUIET.replace(batch_size=batch_size, extra_hooks=[("blocks.0.hook_resid_pre", plant)])
        r = sinklens.find_massive_activations(tiny_llama, ps, streams=[0], abs_threshold=None, rel_threshold=20.0,
                                              options=options)
        at = [i for i, e in enumerate(r.events.tolist()) if e == [0, 0, 3]]
        assert len(at) == 1
        return float(r.event_value[at[0]]), float(r.event_ratio[at[0]])

    forward = run(prompts, 1)
    expected = 50.0 / min(medians)
    assert medians[0] > min(medians)  # the medians differ: the tie is real, and the first sequence does not win it
    assert forward == pytest.approx((50.0, expected), rel=1e-6)
    for ps, batch_size in ((prompts[::-1], 1), (prompts, 4), (prompts[::-1], 4), (prompts[1:] + prompts[:1], 2)):
        assert run(ps, batch_size) == pytest.approx(forward, rel=1e-5)
