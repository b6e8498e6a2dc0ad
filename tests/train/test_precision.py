"""Mixed precision of a training run (sinklens.train.precision): CPU bfloat16 autocast is opt-in,
runs the forward in bfloat16, keeps weights float32, resumes exactly, and warns where it is emulated."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _train_cfg import build_cfg

from sinklens.cli import main
from sinklens.errors import InvalidArgumentError
from sinklens.train import precision
from sinklens.sinklm.config import apply_overrides
from sinklens.train.data import build_source
from sinklens.train.loop import train
from sinklens.sinklm.model import SinkLM

pytestmark = pytest.mark.models


def _first_step_loss(cfg, autocast: bool) -> float:
    """The loss of step 0, computed here: the model initialised as ``train`` does, the first train
    batch, a plain cross-entropy of ``rows[:, 1:]`` under (or outside) CPU bfloat16 autocast."""
    torch.manual_seed(cfg.seed)
    model = SinkLM(cfg.model)
    rows = build_source(cfg.data).batch("train", 0, cfg.batch_size)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(rows[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten()).item()


def test_cpu_bfloat16_autocast_runs_the_forward_in_bfloat16_and_keeps_weights_float32():
    seen: list[torch.dtype] = []

    def record_q(model):
        def fn(q, hook):
            seen.append(q.dtype)
        return [("blocks.0.attn.hook_q", fn)]

    cfg = build_cfg(steps=2, cpu_autocast="bfloat16")
    result = train(cfg, progress=False, interventions=[record_q])
    assert result.autocast == "bfloat16"
    assert seen == [torch.bfloat16, torch.bfloat16]
    assert all(p.dtype == torch.float32 for p in result.model.parameters())
    bf16, fp32 = _first_step_loss(cfg, autocast=True), _first_step_loss(cfg, autocast=False)
    assert abs(bf16 - fp32) > 1e-6  # ≈27 float32 ulps at init: bfloat16 products change the loss
    assert result.losses()[0] == bf16  # the same operations, bit for bit

    default = train(build_cfg(steps=1), progress=False, interventions=[record_q])
    assert default.autocast == "none" and seen[-1] == torch.float32
    assert default.losses()[0] == fp32


def test_resume_under_cpu_bfloat16_autocast_is_exact(tmp_path):
    cfg = build_cfg(steps=6, cpu_autocast="bfloat16")
    full = train(cfg, out_dir=tmp_path / "full", progress=False)
    train(cfg, out_dir=tmp_path / "cut", progress=False, until=3)
    resumed = train(cfg, out_dir=tmp_path / "cut", progress=False, resume=True)
    assert resumed.losses() == full.losses()
    for p, q in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)


def test_cli_trains_under_cpu_autocast_and_says_so(tmp_path, capsys):
    code = main(["train", "--preset", "tiny", "--steps", "2", "--device", "cpu", "--no-progress", "--cpu-autocast",
                 "bfloat16", "--set", "eval.interval=0", "--out", str(tmp_path / "run")])
    assert code == 0
    assert "device: cpu, autocast bfloat16, compile off" in capsys.readouterr().out
    assert '"cpu_autocast": "bfloat16"' in (tmp_path / "run" / "config.json").read_text()


def test_cpu_autocast_refuses_other_dtypes():
    # through the CLI's parser (the constructor's own check is type-checked away under the test suite's
    # jaxtyping hook, which rejects the Literal first)
    with pytest.raises(InvalidArgumentError) as err:
        apply_overrides(build_cfg(), ["cpu_autocast=float16"])
    assert "'float16'" in str(err.value) and "--cpu-autocast" in str(err.value) and "'bfloat16', 'none'" in str(err.value)


def test_bfloat16_on_a_cpu_without_native_support_warns(monkeypatch):
    monkeypatch.setattr(precision, "native_cpu_bf16", lambda: False)
    with pytest.warns(RuntimeWarning, match="emulated"):
        mp = precision.mixed_precision(build_cfg(cpu_autocast="bfloat16"), torch.device("cpu"))
    assert mp.dtype == "bfloat16" and mp.scaler is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 sha_ni\n", True),
        ("processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n", True),
        ("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni\n", False),
        ("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n", True),
        ("processor\t: 0\nFeatures\t: fp asimd\n", False),
        ("processor\t: 0\n", None),
    ],
)
def test_native_cpu_bf16_reads_the_cpu_flags(tmp_path, text, expected):
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    assert precision.native_cpu_bf16(str(path)) is expected
    assert precision.native_cpu_bf16(str(tmp_path / "missing")) is None
