"""On the embedded SmolLM2-135M: a self-only mask turns a mid-sequence token into a sink."""

import pytest
import torch

from sinklens.interventions import create_sink
from sinklens.options import RunOptions

pytestmark = [pytest.mark.slow, pytest.mark.models]

TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening, lit the lamp, and watched "
    "the ships pass safely through the narrow channel below."
)


@pytest.fixture(scope="session")
def smollm2():
    from sinklens.loading import load_model

    return load_model("smollm2-135m", device="cpu")


def test_self_only_creates_a_first_token_like_sink(smollm2):
    """Position 10 of one ~30-token prompt attends only to itself in every layer.

    Measured (TL 4.3, float32, CPU; 4 built-in prompts while developing, this prompt in the test):
    attention received by position 10 from later queries, mean over heads, layers 12-29:
    ~0.02-0.05 before -> ~0.22-0.41 after (8-15x); the original sink's share drops from ~0.5-0.8
    to ~0.3-0.4. Position 10's residual (hook_resid_post) in dim 507: ~40-240 before -> ~24,000
    after from layer 11 on (the first token has ~24,900 there), ~740 in layers 2-8 (first token ~760).
    """
    res = create_sink(smollm2, TEXT, 10, method="self-only", dims=[507], loss=False,
                      options=RunOptions(prepend_bos=True, progress=False))  # measured with <|im_start|> at 0
    deep = slice(12, 28)
    before, after = res.received_layer_before[deep], res.received_layer_after[deep]
    assert float(after.mean()) > 4 * float(before.mean())
    assert float(after.min()) > 0.15
    assert float(res.sink_after[deep].mean()) < float(res.sink_before[deep].mean())
    dim507_after = res.dims_after[12:28, 0]
    sink_507 = res.sink_dims[12:28, 0]
    assert float(dim507_after.min()) > 5000  # massive, like the first token
    assert float(res.dims_before[12:28, 0].abs().max()) < 1000
    torch.testing.assert_close(dim507_after, sink_507, rtol=0.1, atol=0)
