"""The shared analyzer body (``sinklens.analysis._common.run_analyzer``): a public analyzer gives what
streaming its reducer by hand gives, and an unknown keyword is named."""

from __future__ import annotations

import pytest
import torch

from sinklens.analysis.sinks import SinkReducer, find_sinks
from sinklens.analysis.variance import measure_variance
from sinklens.options import RunOptions
from sinklens.streaming import run
from sinklens.testing import tiny_model

PROMPTS = ["t3 t4 t5 t6", "t7 t8"]


def test_public_analyzer_equals_its_reducer_streamed_by_hand():
    model = tiny_model()
    options = RunOptions(progress=False, batch_size=1)
    public = find_sinks(model, PROMPTS, layers=[1], min_query=2, options=options)
    (by_hand,) = run(model, PROMPTS, SinkReducer(model, layers=[1], min_query=2), options=options)
    assert public.layers == by_hand.layers == [1]
    assert public.settings.min_query == 2
    torch.testing.assert_close(public.received, by_hand.received, rtol=0, atol=0)


def test_unknown_keyword_names_the_analyzer():
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        measure_variance(tiny_model(), PROMPTS, bogus=1)
    with pytest.raises(TypeError, match=r"find_sinks\(\) got unexpected keyword arguments \['sink_treshold'\] "
                                        r"\(did you mean 'sink_threshold'\?\)\.$"):
        find_sinks(tiny_model(), PROMPTS, sink_treshold=0.5)
    with pytest.raises(TypeError, match=r"\['bogus'\]\.$"):  # nothing close: no suggestion
        find_sinks(tiny_model(), PROMPTS, bogus=1)
