"""SinkLM at initialization: the weights ``sinklens train`` starts from, and the init schemes that
:func:`sinklens.loading.init.load_at_init` also applies to Hugging Face models."""

from __future__ import annotations

from typing import Any, Literal

import torch

from sinklens.errors import InvalidArgumentError

Scheme = Literal["native", "normal", "torch"]


def reinit(model: torch.nn.Module, scheme: str, std: float, seed: int) -> None:
    """Redraw ``model``'s weights by ``scheme`` after its native init (see :mod:`sinklens.loading.init`)."""
    if scheme == "native":
        return
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if scheme == "normal":
            for p in model.parameters():
                if p.ndim >= 2:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(std).to(p.dtype))
        elif scheme == "torch":
            modules = [m for m in model.modules() if hasattr(m, "reset_parameters") and m is not model]
            if not modules:
                raise InvalidArgumentError(f"scheme='torch' needs modules with reset_parameters (Hugging Face models); "
                                           f"{type(model).__name__} has none. Use scheme='native' or 'normal'.")
            for module in modules:
                module.reset_parameters()


def sinklm_at_init(cfg: Any, seed: int, *, device: str | torch.device = "cpu", scheme: Scheme = "native",
                   std: float = 0.02) -> Any:
    """A ``SinkLM`` built as ``sinklens train`` builds it at step 0: ``torch.manual_seed(seed); SinkLM(cfg)``."""
    from sinklens.sinklm.model import SinkLM  # transformer_lens: not at `import sinklens`
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SinkLM(cfg)
        if scheme == "torch":
            raise InvalidArgumentError("scheme='torch' is not available for SinkLM (bare parameters); use 'native' or 'normal'.")
        reinit(model, scheme, std, seed)
    return model.to(device).eval()
