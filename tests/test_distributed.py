"""Scale-out: reducers merge their statistics, and ``torchrun`` runs equal one-process runs.

* Every reducer in the package, streamed over a split of the batches and merged (through
  ``state_dict``/``load_state_dict``, as :func:`sinklens.streaming.combine_across_ranks` does), gives
  the one-pass result: exact for maxima, counts and sequence indices, 1e-6 for float sums.
* ``torchrun --nproc_per_node 2 -m sinklens.cli analyze`` (gloo, CPU) writes the report a
  one-process run writes, with an odd number of batches (unequal shards), only rank 0 writing; and
  a run with one batch (rank 1 streams none) returns the one-process result on both ranks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from sinklens import distributed
from sinklens.analysis.attention import AttentionReceivedReducer
from sinklens.analysis.disparity import MassiveActivationsReducer, MassiveSettings
from sinklens.analysis.neurons import SuperNeuronReducer
from sinklens.analysis.normalized_disparity import NormalizedDisparityReducer
from sinklens.analysis.long_context import MassiveShareReducer
from sinklens.analysis.qk_attention import KeyAttentionReducer
from sinklens.analysis.qk_locking import QKLockingReducer
from sinklens.analysis.sinks import SinkReducer
from sinklens.analysis.variance import VarianceReducer
from sinklens.analysis.weight_super_neurons import SinkInputReducer
from sinklens.inputs import as_batches, random_token_batches
from sinklens.interventions.experiments import PositionResidualReducer
from sinklens.interventions.variance import MeanActivationReducer
from sinklens.options import RunOptions
from sinklens.origins.contraction import ContractionReducer
from sinklens.origins.fingerprint import _LastFinalState, _RandomInputs
from sinklens.origins.positional import PositionalReducer
from sinklens.origins.preference import TokenPreferenceReducer
from sinklens.streaming import Reducer, stream
from sinklens.testing import tiny_model
from sinklens.train.sink_metrics import FirstTokenNormReducer

QUIET = RunOptions(progress=False)
# Unequal lengths (right padding), 7 prompts in batches of 2: 4 batches, the last with one sequence.
PROMPTS = ["t5 t6 t7 t8 t9 t10", "t11 t12 t13", "t14 t15 t16 t17 t18 t19 t20 t21", "t22 t23 t24 t25",
           "t26 t27 t28 t29 t30", "t31 t32 t33 t34 t35 t36 t37", "t38 t39 t40"]
SEQ_LEN = 6


def _text(model):
    return as_batches(model, PROMPTS, batch_size=2)


def _random(model):  # fixed-length sequences for the origins reducers: 7 sequences in batches of 3
    return random_token_batches(model, n_sequences=7, seq_len=SEQ_LEN, batch_size=3, prepend_bos=False, seed=1)


#: name -> (reducer factory, inputs). Every Reducer subclass in sinklens is here (see test_every_reducer_is_covered).
from sinklens.analysis.value_drain import ValueDrainReducer  # noqa: E402
from sinklens.origins.persistence import FinalDirectionReducer  # noqa: E402
from sinklens.analysis.weight_super_neurons import SinkMeanReducer  # noqa: E402

REDUCERS = {
    "AttentionReceivedReducer": (lambda m: AttentionReceivedReducer(m, min_query=1), _text),
    "SinkReducer": (lambda m: SinkReducer(m, top_k=5), _text),
    "SinkReducer_qk": (lambda m: SinkReducer(m, top_k=5, method="qk"), _text),
    "KeyAttentionReducer": (lambda m: KeyAttentionReducer(m, positions=[0, 2]), _text),
    "MassiveShareReducer": (lambda m: MassiveShareReducer(m, abs_threshold=None, rel_threshold=2.0), _text),
    "VarianceReducer": (VarianceReducer, _text),
    "MassiveActivationsReducer": (
        lambda m: MassiveActivationsReducer(m, settings=MassiveSettings(abs_threshold=None, rel_threshold=2.0)), _text),
    "SuperNeuronReducer": (SuperNeuronReducer, _text),
    "SinkInputReducer": (SinkInputReducer, _text),
    "NormalizedDisparityReducer": (NormalizedDisparityReducer, _text),
    "QKLockingReducer": (QKLockingReducer, _text),
    "FirstTokenNormReducer": (FirstTokenNormReducer, _text),
    "MeanActivationReducer": (lambda m: MeanActivationReducer(m, "attn.hook_z"), _text),
    "PositionResidualReducer": (lambda m: PositionResidualReducer(m, [0, 3]), _text),
    "TokenPreferenceReducer": (lambda m: TokenPreferenceReducer(m, SEQ_LEN), _random),
    "PositionalReducer": (lambda m: PositionalReducer(m, SEQ_LEN), _random),
    "ContractionReducer": (lambda m: ContractionReducer(m, SEQ_LEN), _random),
    "ValueDrainReducer": (ValueDrainReducer, _text),
    "FinalDirectionReducer": (lambda m: FinalDirectionReducer(m, SEQ_LEN), _random),
    "SinkMeanReducer": (
        lambda m: SinkMeanReducer(m, 0, ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre", "blocks.1.hook_resid_post"]),
        _text),
    "_LastFinalState": (
        lambda m: _LastFinalState(m, _RandomInputs(7, SEQ_LEN, 3, mode="token", high=64, seed=1, device=torch.device("cpu"))),
        _random),
}


def assert_same(a: Any, b: Any, path: str = "result") -> None:
    """Recursive equality: tensors to 1e-6 (NaN equal, same dtype and shape), floats likewise, the rest exactly."""
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        assert type(a) is type(b), path
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, (path, a, b)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9, equal_nan=True, msg=lambda m: f"{path}: {m}")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), (path, len(a), len(b))
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and not isinstance(b, bool):
        assert (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9), (path, a, b)
    else:
        assert a == b, (path, a, b)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_every_reducer_is_covered():
    """Every Reducer subclass in the package is in REDUCERS, so a new one is merged-tested too."""
    import importlib
    import pkgutil

    import sinklens

    for info in pkgutil.walk_packages(sinklens.__path__, "sinklens."):
        if "plotting" not in info.name:
            importlib.import_module(info.name)

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    found = {c.__name__ for c in subclasses(Reducer)  # module-level classes of the package (not doctest ones)
             if c.__module__.startswith("sinklens.") and getattr(sys.modules[c.__module__], c.__name__, None) is c}
    assert found == {name.split("_qk")[0] for name in REDUCERS}


@pytest.mark.parametrize("name", sorted(REDUCERS))
def test_statistics_declared(model, name):
    """Every tensor/container statistic that reset() assigns is declared (else it would not travel)."""
    factory, _ = REDUCERS[name]
    reducer = factory(model)
    before = dict(vars(reducer))
    reducer.reset()
    assigned = {k for k, v in vars(reducer).items()
                if (k not in before or v is not before[k]) and not isinstance(v, (bool, int, float))}
    assert assigned <= set(reducer.statistics), sorted(assigned - set(reducer.statistics))
    assert set(reducer.statistics) <= set(vars(reducer))
    assert set(reducer.maxima) <= set(reducer.statistics)


@pytest.mark.parametrize("name", sorted(REDUCERS))
@pytest.mark.parametrize("cuts", [(1, 2)], ids=["1+1+rest"])
def test_merge_equals_one_pass(model, name, cuts):
    """Stream contiguous shares separately, send each state through state_dict, merge in order: the
    result equals one pass over all batches (odd shares exercise the sequence offsets and parities)."""
    factory, inputs = REDUCERS[name]
    batches = list(inputs(model))
    (expected,) = stream(model, batches, [factory(model)], options=QUIET)
    bounds = [0, *cuts, len(batches)]
    parts = []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        reducer = factory(model)
        stream(model, batches[start:stop], [reducer], options=QUIET)
        parts.append(reducer.state_dict())
    merged = factory(model)
    merged.load_state_dict(parts[0])
    for state in parts[1:]:
        other = merged.shallow_copy()
        other.load_state_dict(state)
        merged.merge(other)
    assert_same(merged.result(), expected)


def test_merge_changes_the_result(model):
    """The merged result is not just the first share's: the check above can fail."""
    batches = _text(model)
    (full,) = stream(model, batches, [SinkReducer(model, top_k=5)], options=QUIET)
    first = SinkReducer(model, top_k=5)
    stream(model, batches[:1], [first], options=QUIET)
    with pytest.raises(AssertionError):
        assert_same(first.result(), full)


def test_sink_top_occurrences_keep_global_sequence_indices(model):
    """A share's top occurrences point at sequences counted from the start of the whole run."""
    batches = _text(model)
    (full,) = stream(model, batches, [SinkReducer(model, top_k=50)], options=QUIET)
    a, b = SinkReducer(model, top_k=50), SinkReducer(model, top_k=50)
    stream(model, batches[:2], [a], options=QUIET)  # sequences 0-3
    stream(model, batches[2:], [b], options=QUIET)  # sequences 4-6, numbered 0-2 within b
    assert max(o.sequence for o in b.result().top_occurrences) <= 2
    a.merge(b)
    got = {(o.sequence, o.position) for o in a.result().top_occurrences}
    assert got == {(o.sequence, o.position) for o in full.top_occurrences}
    assert max(s for s, _ in got) >= 4


def test_shard_bounds_cover_every_batch_once():
    for n in range(0, 9):
        for world in (1, 2, 3, 5):
            spans = [distributed.shard_bounds(n, rank=r, world_size=world) for r in range(world)]
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            sizes = [stop - start for start, stop in spans]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_outside_a_session_nothing_is_sharded(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with distributed.session("cpu") as device:
        assert device == "cpu" and not distributed.active() and distributed.is_main()
        assert distributed.local_batches([1, 2, 3]) == [1, 2, 3]


# ------------------------------------------------------------------------------------------ two processes
_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from sinklens import cli, distributed
    from sinklens.analysis.report import analyze
    from sinklens.loading import load_model
    from sinklens.options import RunOptions

    model_dir, out, prompts = sys.argv[1], sys.argv[2], sys.argv[3:]
    torch.set_num_threads(1)
    with distributed.session("cpu") as device:
        assert distributed.active() and distributed.world_size() == 2
        code = cli.main(["analyze", "--model", model_dir, "--text", *prompts, "--batch-size", "2",
                         "--out", out + "/cli", "--no-figures"])
        assert code == 0, code
        model = load_model(model_dir, device=device)
        report = analyze(model, prompts[:2], abs_threshold=None, rel_threshold=2.0,
                         options=RunOptions(batch_size=2, progress=False))  # one batch: rank 1 streams none
        with open(f"{out}/one_batch_rank{distributed.rank()}.json", "w") as f:
            json.dump(report.to_dict(), f)
""")


def _without_seconds(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _without_seconds(v) for k, v in d.items() if k != "seconds"}
    if isinstance(d, list):
        return [_without_seconds(v) for v in d]
    return d


def test_torchrun_two_processes_equal_one(tmp_path):
    """``torchrun --nproc_per_node 2`` (gloo): the CLI report (5 prompts in batches of 2: 3 batches, shares
    of 2 and 1) equals the one-process report to 1e-6 and only rank 0 writes; a one-batch run (rank 1
    streams nothing) returns the one-process report on both ranks."""
    from sinklens import cli
    from sinklens.analysis.report import analyze
    from sinklens.loading import load_model
    from support.zoo import zoo_dir

    model_dir = str(zoo_dir("llama"))
    prompts = PROMPTS[:5]  # batches of 2: 3 batches, shares of 2 and 1
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT)
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
         model_dir, str(tmp_path), *prompts],
        env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("wrote ") == 1  # rank 0 alone printed the summary and wrote

    single = tmp_path / "single"
    assert cli.main(["analyze", "--model", model_dir, "--text", *prompts, "--batch-size", "2", "--out", str(single),
                     "--no-figures"]) == 0
    assert sorted(p.name for p in (tmp_path / "cli").iterdir()) == sorted(p.name for p in single.iterdir())
    got = json.loads((tmp_path / "cli" / "report.json").read_text())
    want = json.loads((single / "report.json").read_text())
    assert_same(_without_seconds(got), _without_seconds(want))

    model = load_model(model_dir, device="cpu")
    one = analyze(model, prompts[:2], abs_threshold=None, rel_threshold=2.0, options=RunOptions(batch_size=2, progress=False))
    want_one = _without_seconds(json.loads(json.dumps(one.to_dict())))
    for rank in (0, 1):
        got_one = json.loads((tmp_path / f"one_batch_rank{rank}.json").read_text())
        assert_same(_without_seconds(got_one), want_one)


_QK_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from sinklens import distributed
    from sinklens.analysis.qk_attention import attention_to_keys
    from sinklens.analysis.sinks import find_sinks
    from sinklens.options import RunOptions
    from sinklens.testing import tiny_model

    out, prompts = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    with distributed.session("cpu"):
        assert distributed.active() and distributed.world_size() == 2
        options = RunOptions(batch_size=2, progress=False)
        result = find_sinks(tiny_model(), prompts, method="qk", options=options)
        weights = attention_to_keys(tiny_model(), prompts, positions=[0, 2], options=options)
        torch.save({"result": {k: v for k, v in vars(result).items() if isinstance(v, torch.Tensor)},
                    "sink_rate": result.sink_rate(), "weights": weights}, f"{out}/qk_rank{distributed.rank()}.pt")
""")


def test_torchrun_two_processes_equal_one_on_the_qk_path(tmp_path):
    """``torchrun --nproc_per_node 2`` (gloo): ``find_sinks(method="qk")`` and ``attention_to_keys`` over 7 prompts in
    batches of 2 (4 batches, 2 per rank) give, on both ranks, what one process gives over all of them."""
    from sinklens.analysis.qk_attention import attention_to_keys
    from sinklens.analysis.sinks import find_sinks

    script = tmp_path / "run_qk.py"
    script.write_text(_QK_SCRIPT)
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), str(tmp_path), *PROMPTS], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    options = RunOptions(batch_size=2, progress=False)
    model = tiny_model()
    one = find_sinks(model, PROMPTS, method="qk", options=options)
    want = {"result": {k: v for k, v in vars(one).items() if isinstance(v, torch.Tensor)}, "sink_rate": one.sink_rate(),
            "weights": attention_to_keys(model, PROMPTS, positions=[0, 2], options=options)}
    assert want["weights"].shape[1] == len(PROMPTS)
    for rank in (0, 1):
        assert_same(torch.load(tmp_path / f"qk_rank{rank}.pt", weights_only=True), want)


# ------------------------------------------------------------------------------------------ split models
@pytest.mark.parametrize("method", ["pattern", "qk"])
def test_a_model_split_over_devices_feeds_reducers_on_the_statistics_device(model, monkeypatch, method):
    """A model whose parameters span devices (``n_devices`` / ``device_map``) gets every reducer hook
    wrapped to read its activation on the first parameter's device, and the results are unchanged.
    (CPU only here: a meta-device parameter makes the tiny model "split"; no GPU was available.)"""
    from sinklens import streaming

    batches = _text(model)
    (plain,) = stream(model, batches, [SinkReducer(model, top_k=5, method=method)], options=QUIET)
    assert streaming._stats_device_if_split(model) is None
    params = list(model.parameters())
    elsewhere = torch.nn.Parameter(torch.zeros(1, device="meta"))
    monkeypatch.setattr(model, "parameters", lambda *a, **k: iter([*params, elsewhere]), raising=False)
    seen = []
    original = streaming._moved_to

    def spy(fn, device):
        seen.append(device)
        return original(fn, device)

    monkeypatch.setattr(streaming, "_moved_to", spy)
    assert streaming._stats_device_if_split(model) == torch.device("cpu")
    (split,) = stream(model, batches, [SinkReducer(model, top_k=5, method=method)], options=QUIET)
    monkeypatch.undo()
    assert seen and set(seen) == {torch.device("cpu")}
    assert_same(split, plain)


@pytest.mark.parametrize("method", ["pattern", "qk"])
def test_layers_on_two_devices_give_the_one_device_sink_statistics(method):
    """Layer 0 on the CPU, layer 1 on the pretend GPU (:mod:`sinklens.testing.fake_cuda`, which raises where the two
    meet), activations moved between them as accelerate's ``device_map`` dispatch does: ``find_sinks`` runs unchanged
    and equals the one-device result exactly."""
    from accelerate.utils import send_to_device

    from sinklens.analysis.sinks import find_sinks
    from sinklens.testing.fake_cuda import fake_cuda

    model = tiny_model()
    options = RunOptions(progress=False, batch_size=2)
    want = find_sinks(model, PROMPTS, method=method, options=options)
    with fake_cuda():
        layer = model.original_model.model.layers[1]
        layer.to("cuda")
        layer.register_forward_pre_hook(lambda m, a, k: (send_to_device(a, "cuda"), send_to_device(k, "cuda")),
                                        with_kwargs=True)
        layer.register_forward_hook(lambda m, a, out: send_to_device(out, "cpu"))
        assert {p.device.type for p in model.parameters()} == {"cpu", "cuda"}
        got = find_sinks(model, PROMPTS, method=method, options=options)
    assert got.attention_path == method
    assert_same(got, want)
