"""The pretend CUDA device itself: it raises where CUDA raises, runs what CUDA runs, and counts host syncs."""

from __future__ import annotations

import pytest
import torch

from sinklens.testing.fake_cuda import FakeCudaTensor, fake_cuda

MIXED = "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"


@pytest.mark.parametrize("mix", [
    lambda x: x + torch.ones(3),
    lambda x: torch.stack([x, torch.zeros(3)]),
    lambda x: torch.where(x > 0, x, torch.zeros(3)),
    lambda x: x[None] @ torch.ones(3, 1),
    lambda x: torch.cat([torch.zeros(0), x]),  # an empty CPU tensor too (find_super_neurons' bug on an H200)
])
def test_a_cpu_tensor_meeting_a_device_tensor_raises_as_on_cuda(mix):
    with fake_cuda():
        x = torch.arange(3.0, device="cuda")
        with pytest.raises(RuntimeError, match=MIXED):
            mix(x)


def test_what_cuda_accepts_runs_with_the_cpu_numbers():
    with fake_cuda():
        x = torch.arange(6.0).reshape(2, 3).to("cuda")
        assert isinstance(x, FakeCudaTensor) and x.device == torch.device("cuda", 0) and x.is_cuda
        y = x * torch.tensor(2.0) + 1  # a 0-dim CPU tensor is a scalar on CUDA too
        assert y.device.type == "cuda"
        assert y.cpu().tolist() == [[1.0, 3.0, 5.0], [7.0, 9.0, 11.0]] and type(y.cpu()) is torch.Tensor
        assert x[torch.tensor([1])].cpu().tolist() == [[3.0, 4.0, 5.0]]  # CPU index tensors are moved by CUDA
        z = torch.zeros(2, 3, device="cuda")
        z.copy_(torch.ones(2, 3))  # a copy across devices
        z.add_(x)
        assert z.cpu().sum().item() == 21.0
        assert torch.zeros_like(x).device.type == "cuda" and x.new_ones(2).device.type == "cuda"
        with pytest.raises(TypeError, match="cuda:0 device type tensor to numpy"):
            x.numpy()


def test_a_module_moves_in_place_and_trains():
    lin = torch.nn.Linear(3, 2)
    weight = lin.weight
    expected = lin(torch.ones(4, 3)).sum()
    expected.backward()
    with fake_cuda():
        lin.zero_grad()
        lin.to(device="cuda")
        assert lin.weight is weight and lin.weight.device.type == "cuda"  # one object: aliases of it stay valid
        loss = lin(torch.ones(4, 3, device="cuda")).sum()
        loss.backward()
        assert lin.weight.grad.device.type == "cuda"
        assert torch.equal(lin.weight.grad.cpu(), torch.full((2, 3), 4.0))
        assert loss.item() == pytest.approx(expected.item())


def test_host_syncs_are_counted():
    with fake_cuda() as device:
        x = torch.arange(4.0, device="cuda")
        y = (x * 2).sum()  # stays on the device
        assert device.host_syncs == 0
        y.item()
        float(y)
        bool(y > 0)
        x.tolist()
        x.cpu()
        x[x > 1]  # boolean-mask indexing waits for the count
        x.nonzero()
        assert device.host_syncs == 7
