"""The shared analyzer body (``sinklens.analysis._common.run_analyzer``): deprecation warnings point at the
caller, and a public analyzer gives what streaming its reducer by hand gives."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sinklens
from sinklens.analysis.sinks import SinkReducer, find_sinks
from sinklens.analysis.variance import measure_variance
from sinklens.options import RunOptions
from sinklens.streaming import run
from sinklens.testing import tiny_model

PROMPTS = ["t3 t4 t5 t6", "t7 t8"]


_CALLER = """
import warnings
from sinklens.analysis.sinks import find_sinks
from sinklens.analysis.variance import measure_variance
from sinklens.options import RunOptions
from sinklens.testing import tiny_model

model = tiny_model()
calls = {
    "find_sinks(progress=) is deprecated": lambda: find_sinks(model, PROMPTS, progress=False),
    "eps= is deprecated": lambda: find_sinks(model, PROMPTS, eps=0.3, options=RunOptions(progress=False)),
    "measure_variance(progress=) is deprecated": lambda: measure_variance(model, PROMPTS, progress=False),
}
for expected, call in calls.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    found = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(found) == 1 and expected in str(found[0].message), [str(w.message) for w in caught]
    print(found[0].filename)
"""


def test_deprecation_warnings_point_at_the_caller(tmp_path):
    # In a fresh interpreter: under pytest the jaxtyping import hook wraps sinklens functions in extra frames.
    script = tmp_path / "caller.py"
    script.write_text(f"PROMPTS = {PROMPTS!r}\n" + _CALLER)
    root = Path(sinklens.__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(script)] * 3


def test_public_analyzer_equals_its_reducer_streamed_by_hand():
    model = tiny_model()
    options = RunOptions(progress=False, batch_size=1)
    public = find_sinks(model, PROMPTS, layers=[1], min_query=2, options=options)
    (by_hand,) = run(model, PROMPTS, SinkReducer(model, layers=[1], min_query=2), options=options)
    assert public.layers == by_hand.layers == [1]
    assert public.settings.min_query == 2
    torch.testing.assert_close(public.received, by_hand.received, rtol=0, atol=0)


def test_unknown_keyword_names_the_analyzer():
    with pytest.raises(TypeError, match=r"measure_variance\(\) got unexpected keyword arguments \['bogus'\]"):
        measure_variance(tiny_model(), PROMPTS, bogus=1)
    with pytest.raises(TypeError, match=r"find_sinks\(\) got unexpected keyword arguments \['sink_treshold'\] "
                                        r"\(did you mean 'sink_threshold'\?\)\.$"):
        find_sinks(tiny_model(), PROMPTS, sink_treshold=0.5)
    with pytest.raises(TypeError, match=r"\['bogus'\]\.$"):  # nothing close: no suggestion
        find_sinks(tiny_model(), PROMPTS, bogus=1)
