"""The GPU lane: public functions and commands run on a device and compared with the CPU.

``pytest tests/devices --device cuda`` runs them on a GPU (skipped when CUDA is absent); without
``--device`` (or with ``cpu``/``fake-cuda``) they run on :mod:`sinklens.testing.fake_cuda`'s pretend CUDA
device, which raises where a tensor made on the CPU meets the activations, so CI finds device bugs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from sinklens.testing.fake_cuda import FakeCudaTensor, fake_cuda

#: Float tolerances (relative to the value, and to the largest magnitude of the same field) per dtype.
TOLERANCE = {torch.float32: (1e-3, 1e-4), torch.bfloat16: (5e-2, 5e-2)}
#: Share of non-float leaves (counts, indices, flags, names) allowed to differ in bfloat16, where a device's
#: own rounding can move a value across a threshold; none may differ in float32.
BF16_DISCRETE_SHARE = 0.1
#: Fields that legitimately differ between runs (wall time, the device's own name).
SKIPPED = ("seconds", "device", "elapsed", "tokens_per_second")


class Lane:
    """Where the lane runs (:attr:`device`) and how it compares with the CPU."""

    def __init__(self, name: str):
        self.name = name
        self.fake = name == "fake-cuda"
        self.device = torch.device("cuda" if self.fake else name)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The block in which the device exists (the pretend device needs its mode; a GPU needs nothing)."""
        with fake_cuda() if self.fake else contextlib.nullcontext():
            yield

    def assert_same(self, cpu: Any, device: Any, dtype: torch.dtype) -> None:
        """``device``'s result holds only host tensors and equals ``cpu``'s within ``dtype``'s tolerance."""
        assert_on_host(device)
        want, got = dict(leaves(cpu)), dict(leaves(device))
        assert want.keys() == got.keys(), f"fields differ: {sorted(want.keys() ^ got.keys())[:5]}"
        rtol, scale_tol = TOLERANCE[dtype]
        floats_off, discrete_off, n_discrete = [], [], 0
        for key, a in want.items():
            b = got[key]
            if isinstance(a, list):  # one numeric field: tolerance relative to its largest magnitude
                if len(a) != len(b):
                    discrete_off.append(key)
                    n_discrete += 1
                    continue
                scale = max((abs(x) for x in a if math.isfinite(x)), default=0.0)
                for x, y in zip(a, b):
                    if not (x == y or math.isnan(x) and math.isnan(y)
                            or abs(x - y) <= rtol * abs(x) + scale_tol * scale + 1e-12):
                        floats_off.append(f"{key}: {x} vs {y}")
                        break
            else:
                n_discrete += 1
                if a != b:
                    discrete_off.append(f"{key}: {a!r} vs {b!r}")
        assert not floats_off, f"{len(floats_off)} fields differ from the CPU's, e.g. {floats_off[:3]}"
        allowed = int(BF16_DISCRETE_SHARE * n_discrete) if dtype == torch.bfloat16 else 0
        assert len(discrete_off) <= allowed, f"{len(discrete_off)} values differ from the CPU's: {discrete_off[:5]}"


def as_plain(value: Any) -> Any:
    """A result as plain data: ``to_dict()`` where it has one, tensors as lists."""
    if hasattr(value, "to_dict"):
        return as_plain(value.to_dict())
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().double().tolist() if value.is_floating_point() else value.tolist()
    if isinstance(value, dict):
        return {str(k): as_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_plain(v) for v in value]
    return value


def leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, leaf)`` pairs of a result; a run of numbers is one leaf (a list of floats)."""
    value = as_plain(value)
    if isinstance(value, dict):
        for k, v in value.items():
            if not any(skip in k for skip in SKIPPED):
                yield from leaves(v, f"{path}.{k}")
    elif isinstance(value, list) and value and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                    for v in _flat(value)):
        flat = list(_flat(value))
        if any(isinstance(v, float) for v in flat):
            yield path, [float(v) for v in flat]
        else:
            yield path, flat
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from leaves(v, f"{path}[{i}]")
    elif isinstance(value, float):
        yield path, [value]
    else:
        yield path, value


def _flat(value: Any) -> Iterator[Any]:
    for v in value:
        if isinstance(v, list):
            yield from _flat(v)
        else:
            yield v


def assert_on_host(value: Any, path: str = "result", seen: set[int] | None = None) -> None:
    """Every tensor a result holds is on the CPU (results move to the host once, in ``result()``)."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        assert not isinstance(value, FakeCudaTensor) and value.device.type == "cpu", f"{path} is on {value.device}"
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            assert_on_host(getattr(value, field.name), f"{path}.{field.name}", seen)
    elif isinstance(value, dict):
        for k, v in value.items():
            assert_on_host(v, f"{path}[{k!r}]", seen)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            assert_on_host(v, f"{path}[{i}]", seen)


@pytest.fixture(scope="session")
def lane(request) -> Lane:
    name = request.config.getoption("--device")
    name = "fake-cuda" if name == "cpu" else name  # the lane compares a device with the CPU: pretend on a CPU
    if name != "fake-cuda":
        if torch.device(name).type != "cuda":
            pytest.fail(f"--device {name!r}: the lane runs on cpu, fake-cuda, cuda or cuda:N")
        if not torch.cuda.is_available():
            pytest.skip(f"--device {name}: CUDA is not available here (torch {torch.__version__}, "
                        f"torch.cuda.is_available() is False)")
    return Lane(name)


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request) -> torch.dtype:
    return request.param
