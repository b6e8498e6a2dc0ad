"""DDP: two CPU processes (gloo, launched with torch.distributed.run) match one process on the same global batch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _train_cfg import build_cfg

from sinklens.train.data import build_source
from sinklens.distributed.ddp import DistContext
from sinklens.train.loop import forward_backward, micro_batch, train
from sinklens.sinklm.model import SinkLM

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    from _train_cfg import build_cfg
    from sinklens.train.data import build_source
    from sinklens.distributed.ddp import init_distributed
    from sinklens.train.loop import forward_backward, micro_batch, train
    from sinklens.sinklm.model import SinkLM
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    cfg = build_cfg(steps=3, batch_size=8)
    ctx, device = init_distributed("cpu")
    torch.manual_seed(cfg.seed)
    raw = SinkLM(cfg.model)
    model = DDP(raw)
    rows = build_source(cfg.data).batch("train", 0, cfg.batch_size)
    forward_backward(model, micro_batch(rows, 0, cfg, ctx), hook_owner=raw)
    grads = {{n: p.grad.clone() for n, p in raw.named_parameters()}}
    # train() destroys the process group when it ends; a DDP wrapper still alive then keeps gloo's threads
    # (and their tensors) into interpreter finalization, which now and then aborts the process (SIGABRT,
    # "terminate called without an active exception", seen under load; pytorch PR 179291)
    del model
    result = train(cfg, progress=False)  # the real loop, wrapped in DDP by itself
    if ctx.rank == 0:
        torch.save({{"grads": grads, "params": result.model.state_dict(), "losses": result.losses()}}, {out!r})
    """
)


def test_ddp_two_processes_match_single_process(tmp_path):
    out = tmp_path / "rank0.pt"
    script = tmp_path / "ddp_script.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent), out=str(out)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533", str(script)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp = torch.load(out)

    cfg = build_cfg(steps=3, batch_size=8)
    torch.manual_seed(cfg.seed)
    model = SinkLM(cfg.model)
    rows = build_source(cfg.data).batch("train", 0, cfg.batch_size)
    forward_backward(model, micro_batch(rows, 0, cfg, DistContext()), hook_owner=model)
    assert set(ddp["grads"]) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():  # DDP's all-reduced mean over 2 × 4 rows == the gradient on 8 rows
        torch.testing.assert_close(ddp["grads"][name], p.grad, atol=1e-6, rtol=1e-5, msg=name)
        assert p.grad.abs().sum() > 0

    single = train(cfg, progress=False)
    assert ddp["losses"] == pytest.approx(single.losses(), abs=1e-5)
    for name, value in single.model.state_dict().items():
        torch.testing.assert_close(ddp["params"][name], value, atol=1e-5, rtol=1e-4, msg=name)
