"""The statistics behind SeedPrint (:mod:`sinklens.origins.fingerprint`)."""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor


def format_p_value(p_value: float, log10_p: float) -> str:
    """``"p = 0.0123"``, or ``"p = 10^-412.3"`` from ``log10_p`` where ``p_value`` underflows float64 to 0.

    Examples:
        >>> format_p_value(0.01234, -1.9087), format_p_value(0.0, -412.345)
        ('p = 0.0123', 'p = 10^-412.3')
    """
    return f"p = {p_value:.3g}" if p_value > 0.0 or not math.isfinite(log10_p) else f"p = 10^{log10_p:.1f}"

def shared_last_token_share(n_samples: int, vocab: int) -> float:
    """Expected share of ``n_samples`` uniform sequences whose last token another also ends with:
    ``1 - (1 - 1/vocab)^(n_samples - 1)``.

    Examples:
        >>> round(shared_last_token_share(300, 4096), 3), round(shared_last_token_share(64, 64), 3)
        (0.07, 0.629)
    """
    return 1.0 - (1.0 - 1.0 / vocab) ** (n_samples - 1)

def kendall_tau_null_std(n: int) -> float:
    """Standard deviation of Kendall τ between two independent samples of size ``n``: ``sqrt(2(2n+5) / (9n(n-1)))``."""
    return math.sqrt(2.0 * (2 * n + 5) / (9.0 * n * (n - 1)))


def per_dim_kendall(a: Float[Tensor, "sample dim"], b: Float[Tensor, "sample dim"]) -> Float[Tensor, " dim"]:
    """Kendall τ-b between column ``i`` of ``a`` and column ``i`` of ``b``, for every ``i`` (scipy)."""
    from scipy.stats import kendalltau

    columns = zip(a.double().numpy().T, b.double().numpy().T)
    return torch.tensor([kendalltau(x, y).statistic for x, y in columns], dtype=torch.float64)

def max_shared_input_z(alpha: float) -> float:
    """The largest shared-input ``z`` shift ``δ`` keeping false positives under ``2 alpha``:
    ``Φ̄⁻¹(α/2) − Φ̄⁻¹(2α)``."""
    from scipy.stats import norm

    return float(norm.isf(alpha / 2) - norm.isf(min(2 * alpha, 1.0)))

def samples_for_share(share: float, vocab: int) -> int:
    """The largest ``N`` with :func:`shared_last_token_share` ``(N, vocab) <= share``."""
    return 1 + int(math.log(1.0 - share) / math.log(1.0 - 1.0 / vocab)) if vocab > 1 else 1
