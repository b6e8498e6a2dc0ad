"""Which query sees which key, per layer: ``k <= q`` in causal models (every ``k`` in encoders), and
``|q - k| < w`` in a sliding-window layer of ``w`` tokens; read from ``cfg`` or a bridge's Hugging Face config.

Examples:
    >>> Visibility(causal=True, windows=(None, 2)).describe()
    'causal; sliding window of 2 tokens in layers [1]'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool
from torch import Tensor

from sinklens.errors import UnsupportedArchitectureError
from sinklens.probes import attends_to_later_keys


@dataclass(frozen=True)
class Visibility:
    """A model's attention layout: ``causal`` (False for encoders), each layer's window or None."""

    causal: bool
    windows: tuple[int | None, ...]

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: full attention)."""
        return self.windows[layer]

    def visible(self, layer: int, n_pos: int, device: torch.device | str | None = None) -> Bool[Tensor, "query key"]:
        """``[query, key]``: True where the query may attend to the key in ``layer``."""
        pos = torch.arange(n_pos, device=device)
        return self.block(layer, pos, pos)

    def block(self, layer: int, queries: Tensor, keys: Tensor) -> Bool[Tensor, "query key"]:
        """:meth:`visible` for the query positions ``queries`` and key positions ``keys`` (1-D) only."""
        q, k = queries[:, None], keys[None, :]
        seen = (k <= q) | (not self.causal)
        w = self.windows[layer]
        return seen if w is None else seen & ((q - k).abs() < w)

    def batch_mask(self, layer: int, valid: Bool[Tensor, "batch pos"]) -> Bool[Tensor, "batch query key"]:
        """``[batch, query, key]``: visible pairs whose query and key are both real (non-padding) tokens."""
        seen = self.visible(layer, valid.shape[1], valid.device)
        return seen[None] & valid[:, :, None] & valid[:, None, :]

    def describe(self) -> str:
        """One line for summaries, e.g. ``'causal; sliding window of 4 tokens in layers [0, 2]'``."""
        parts = [f"sliding window of {w} tokens in layers {[i for i, v in enumerate(self.windows) if v == w]}"
                 for w in sorted({w for w in self.windows if w is not None})]
        return f"{'causal' if self.causal else 'bidirectional'}; " + ("; ".join(parts) or "full attention in every layer")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"attention": "causal"|"bidirectional", "windows": [w or null per layer]}``."""
        return {"attention": "causal" if self.causal else "bidirectional", "windows": list(self.windows)}


def _hf_windows(config: Any, n_layers: int) -> tuple[int | None, ...]:
    window = getattr(config, "sliding_window", None)
    layer_types: Sequence[str] | None = getattr(config, "layer_types", None)
    if layer_types is not None:
        unknown = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
        if unknown:
            raise UnsupportedArchitectureError(f"Layer types {unknown} (from the Hugging Face config's layer_types) "
                                               "are not supported: sinklens knows full and sliding-window attention.")
        if any(t == "sliding_attention" for t in layer_types) and not window:
            raise UnsupportedArchitectureError("The config has sliding_attention layers but no sliding_window size.")
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    use = window and getattr(config, "use_sliding_window", True) is not False
    return (int(window) if use else None,) * n_layers


def _tl_windows(cfg: Any, n_layers: int) -> tuple[int | None, ...]:
    attn_types = getattr(cfg, "attn_types", None)
    window = getattr(cfg, "window_size", None)
    if not attn_types:
        return (None,) * n_layers
    if any(t == "local" for t in attn_types) and not window:
        raise UnsupportedArchitectureError("cfg.attn_types has 'local' layers but cfg.window_size is not set.")
    return tuple(int(window) if t == "local" else None for t in attn_types)


def attention_direction(model: Any) -> str:
    """``cfg.attention_dir`` (``"causal"`` or ``"bidirectional"``), unless a probe shows a "causal"
    model attending both ways (:func:`~sinklens.probes.attends_to_later_keys`)."""
    direction = getattr(model.cfg, "attention_dir", "causal") or "causal"
    if direction not in ("causal", "bidirectional"):
        raise UnsupportedArchitectureError(f"cfg.attention_dir={direction!r}; expected 'causal' or 'bidirectional'.")
    return "bidirectional" if direction == "causal" and attends_to_later_keys(model) else direction


def attention_visibility(model: Any) -> Visibility:
    """The :class:`Visibility` of any TransformerLens-style model."""
    n_layers = int(model.cfg.n_layers)
    config = getattr(getattr(model, "original_model", None), "config", None)
    windows = _hf_windows(config, n_layers) if config is not None else _tl_windows(model.cfg, n_layers)
    if len(windows) != n_layers:
        raise UnsupportedArchitectureError(f"{len(windows)} per-layer attention types for {n_layers} layers.")
    return Visibility(causal=attention_direction(model) == "causal", windows=windows)
