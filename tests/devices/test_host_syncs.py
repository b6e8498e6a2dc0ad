"""The analysis loop waits for the device at most once per batch.

Counted on the pretend device (:attr:`sinklens.testing.fake_cuda.FakeCuda.host_syncs`: ``.item()``, ``bool``
of a tensor, ``.tolist()``, ``.cpu()``, boolean-mask indexing, ``nonzero`` ...) for runs over 1 and 3 batches
of the same sequences: the difference over 2 is what one more batch costs; the work before and after the
loop (checks, ``result()``) is the same in both runs and cancels.
"""

from __future__ import annotations

import pytest
import torch

import sinklens
from sinklens.inputs import TokenBatch
from sinklens.testing import QUIET
from support.checks import VARIED_PROMPTS
from sinklens.testing.fake_cuda import fake_cuda
from sinklens.testing.planted import planted_model

PROMPTS = VARIED_PROMPTS[:2]  # 9 and 2 words: a padded batch of two


@pytest.fixture(scope="module")
def model():
    model = planted_model("llama", n_layers=3, layer=0, neuron=7, dim=5)[0]
    with fake_cuda():
        return model.to("cuda")


def _syncs_per_batch(model, make_inputs) -> float:
    counts = []
    for n_batches in (1, 3):
        with fake_cuda() as device:
            sinklens.analyze(model, make_inputs(n_batches), options=QUIET.replace(batch_size=2))
        counts.append(device.host_syncs)
    return (counts[1] - counts[0]) / 2


def test_analyze_of_text_waits_for_no_batch(model):
    """Text is tokenized on the host, so its lengths are known there; ``result()`` varies by a sync or two."""
    assert _syncs_per_batch(model, lambda n: PROMPTS * n) < 1


def test_analyze_of_batches_made_on_the_device_waits_twice_per_batch(model):
    """A batch the user made on the device has its token ids checked where it enters (one read) and its lengths
    read once (TokenBatch.host_lengths), then never again: one wait per batch in the loop itself."""
    tokens = torch.tensor([[0, 3, 4, 5, 6, 7], [0, 9, 10, 1, 1, 1]])
    valid = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])

    def batches(n):
        with fake_cuda():
            return [TokenBatch(tokens.to("cuda"), valid.to("cuda"), True) for _ in range(n)]

    assert _syncs_per_batch(model, batches) <= 2
