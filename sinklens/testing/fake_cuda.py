"""A pretend CUDA device on a CPU-only build: inside :func:`fake_cuda`, tensors made or moved with ``device="cuda"``
report ``cuda:0``, compute on CPU data and raise a GPU's error when mixed with CPU tensors (CUDA's exceptions
allowed: copies, CPU index tensors, 0-dim scalars). :attr:`FakeCuda.host_syncs` counts host reads (``.item()``,
``.tolist()``, ``.cpu()``) and data-dependent shapes (``nonzero``, mask indexing, ``unique``, ``torch.equal``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map_only

DEVICE = torch.device("cuda", 0)
_CPU = torch.device("cpu")
aten = torch.ops.aten

#: Ops that read device data on the host or whose output shape depends on it: each waits for a GPU.
_SYNC_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default, aten.equal.default,
             aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default, aten.is_nonzero.default}
#: Ops CUDA runs with CPU tensors among their arguments: a copy across devices and CPU index tensors.
_CROSS_DEVICE = {aten.copy_.default, aten._to_copy.default, aten.index.Tensor, aten.index_put_.default,
                 aten.index_put.default, aten._index_put_impl_.default}


class FakeCudaTensor(torch.Tensor):
    """A tensor whose ``.device`` is ``cuda:0`` and whose data is the CPU tensor ``self.cpu_data``."""

    cpu_data: torch.Tensor

    @staticmethod
    def __new__(cls, real: torch.Tensor) -> FakeCudaTensor:
        with torch.inference_mode(False):  # a view of a normal tensor must be normal (it shares a version counter)
            fake = torch.Tensor._make_wrapper_subclass(
                cls, real.shape, strides=real.stride(), storage_offset=real.storage_offset(), dtype=real.dtype,
                layout=real.layout, device=_CPU, requires_grad=real.requires_grad)
        fake.cpu_data = real
        return fake

    # Torch's own kernels see a CPU tensor (so autograd runs on this build); Python code sees cuda:0.
    device = property(lambda self: DEVICE)
    is_cuda = property(lambda self: True)
    is_cpu = property(lambda self: False)

    def get_device(self) -> int:
        return 0

    def untyped_storage(self) -> torch.UntypedStorage:  # what shares memory with what (safetensors asks)
        return self.cpu_data.untyped_storage()

    def data_ptr(self) -> int:
        return self.cpu_data.data_ptr()

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"FakeCudaTensor({self.cpu_data!r}, device='cuda:0')"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return _dispatch(func, args, kwargs or {})


@dataclass(eq=False)
class FakeCuda:
    """The state of one :func:`fake_cuda` block: :attr:`host_syncs` counts the host synchronisations."""

    host_syncs: int = 0


_ACTIVE: list[FakeCuda] = []


def _is_cuda(device: Any) -> bool:
    return device is not None and not isinstance(device, int) and torch.device(device).type == "cuda"


def _dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    fakes = [t for t in tensors if isinstance(t, FakeCudaTensor)]
    if fakes and func not in _CROSS_DEVICE and any(not isinstance(t, FakeCudaTensor) and t.dim() > 0 for t in tensors):
        raise RuntimeError("Expected all tensors to be on the same device, but found at least two devices, cuda:0 and "
                           f"cpu! ({func})")
    # A host move is caught in _FakeCudaMode; a _to_copy naming the CPU here is a kernel's own cast (softmax's dtype=,
    # a backward) taking the wrapper's device: it stays on the fake device.
    to_host = func is aten.copy_.default and not isinstance(args[0], FakeCudaTensor)
    if fakes and _ACTIVE and (func in _SYNC_OPS or to_host or func is aten.index.Tensor and any(
            i is not None and i.dtype == torch.bool for i in args[1])):
        _ACTIVE[-1].host_syncs += 1
    by_real = {id(t.cpu_data): t for t in fakes}
    real_args, real_kwargs = tree_map_only(FakeCudaTensor, lambda t: t.cpu_data, (args, kwargs))
    if made_here := _is_cuda(real_kwargs.get("device")):
        real_kwargs["device"] = _CPU
    out = func(*real_args, **real_kwargs)
    if to_host or not (fakes or made_here):
        return out
    return tree_map_only(torch.Tensor, lambda t: by_real[id(t)] if id(t) in by_real else FakeCudaTensor(t), out)


class _ToHost(torch.autograd.Function):
    """A fake tensor's data as a plain CPU tensor (a host sync), with gradients flowing back to the fake one."""

    @staticmethod
    def forward(ctx: Any, fake: FakeCudaTensor) -> torch.Tensor:
        if _ACTIVE:
            _ACTIVE[-1].host_syncs += 1
        return fake.cpu_data.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> FakeCudaTensor:
        return FakeCudaTensor(grad)


class _FakeCudaMode(TorchFunctionMode):
    """Turns ``device="cuda"`` in a call into CPU data wrapped as :class:`FakeCudaTensor` (a CPU-only build
    refuses to make a CUDA tensor before any dispatch could see it)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            to_kwargs = {k: v for k, v in kwargs.items() if k != "copy"}
            device, dtype = (DEVICE, None) if func is torch.Tensor.cuda else torch._C._nn._parse_to(*args[1:], **to_kwargs)[:2]
            if _is_cuda(device):
                self_ = args[0]
                real = self_.cpu_data if isinstance(self_, FakeCudaTensor) else self_
                moved = real.to(dtype=dtype or real.dtype, copy=bool(kwargs.get("copy", False)))
                return self_ if moved is real and isinstance(self_, FakeCudaTensor) else FakeCudaTensor(moved)
            if isinstance(args[0], FakeCudaTensor) and device is not None:  # to the host (a CPU kernel sees no move)
                return _ToHost.apply(args[0]).to(*args[1:], **kwargs)
        elif func in (torch.Tensor.cpu, torch.Tensor.tolist) and isinstance(args[0], FakeCudaTensor):
            host = _ToHost.apply(args[0])
            return host if func is torch.Tensor.cpu else host.tolist()
        elif func in (torch.Tensor.numpy, torch.Tensor.__array__) and isinstance(args[0], FakeCudaTensor):
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
                            "host memory first.")
        elif func in (torch.Tensor.pin_memory, torch.Tensor.is_pinned):
            return args[0] if func is torch.Tensor.pin_memory else False
        elif _is_cuda(kwargs.get("device")) and func is not torch._C._nn._parse_to:  # (Module.to parses, then calls .to)
            out = func(*args, **{**kwargs, "device": _CPU})
            return tree_map_only(torch.Tensor, lambda t: t if isinstance(t, FakeCudaTensor) else FakeCudaTensor(t), out)
        return func(*args, **kwargs)


#: What ``torch.cuda`` answers inside :func:`fake_cuda`: one GPU, named as what it is.
_CUDA_API: dict[str, Any] = {
    "is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
    "get_device_name": lambda device=None: "sinklens fake CUDA (CPU)", "synchronize": lambda device=None: None,
    "get_device_capability": lambda device=None: (8, 0),
}


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeCuda]:
    """A block in which ``cuda`` is the pretend device and ``torch.cuda`` answers as for one GPU; yields the
    :class:`FakeCuda` (host-sync count)."""
    state = FakeCuda()
    _ACTIVE.append(state)
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # model.to() keeps each parameter object
    try:
        with _FakeCudaMode(), mock.patch.multiple(torch.cuda, **_CUDA_API):
            yield state
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
        _ACTIVE.remove(state)

