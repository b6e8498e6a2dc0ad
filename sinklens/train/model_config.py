"""Architecture config of sinklens' trainable decoder (a dataclass that checkpoints carry)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

Family = Literal["llama", "gpt2"]

#: Size/architecture presets for :meth:`ModelConfig.from_preset`. ``tiny`` runs in tests on a CPU;
#: ``124m`` is the GPT-2-small shape (12 layers, d_model 768, 12 heads, n_ctx 1024, 50304 vocab,
#: i.e. GPT-2's 50257 padded to a multiple of 64); ``124m-gpt2`` is the same with GPT-2 blocks.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(family="llama", n_layers=2, d_model=64, n_heads=4, n_ctx=128, d_vocab=256),
    "tiny-gpt2": dict(family="gpt2", n_layers=2, d_model=64, n_heads=4, n_ctx=128, d_vocab=256),
    "small": dict(family="llama", n_layers=4, d_model=256, n_heads=4, n_ctx=256, d_vocab=50304),
    "medium": dict(family="llama", n_layers=8, d_model=512, n_heads=8, n_ctx=512, d_vocab=50304),
    "124m": dict(family="llama", n_layers=12, d_model=768, n_heads=12, n_ctx=1024, d_vocab=50304),
    "124m-gpt2": dict(family="gpt2", n_layers=12, d_model=768, n_heads=12, n_ctx=1024, d_vocab=50304),
}


@dataclass
class ModelConfig:
    """Shape and attention variant of a :class:`sinklens.train.model.SinkLM`.

    ``family="llama"``: RMSNorm, SwiGLU, RoPE, tied embeddings, optional GQA (``n_kv_heads``).
    ``family="gpt2"``: LayerNorm, GELU, learned positions, tied embeddings.
    ``variant`` names an attention variant registered in :mod:`sinklens.train.variants`;
    ``variant_options`` are passed to it (e.g. ``{"gain": "per_head", "init": "first_token"}``).
    ``dtype`` is stored as a string (``"float32"``, ``"bfloat16"``) so the config stays JSON.
    """

    family: Family = "llama"
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int | None = None
    d_mlp: int | None = None
    n_ctx: int = 128
    d_vocab: int = 256
    variant: str = "baseline"
    variant_options: dict[str, Any] = field(default_factory=dict)
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    dropout: float = 0.0
    init_std: float = 0.02
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "n_ctx", "d_vocab"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}.")
        if self.family not in ("llama", "gpt2"):
            raise ValueError(f"Unknown family {self.family!r}; expected 'llama' or 'gpt2'.")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"n_heads={self.n_heads} does not divide d_model={self.d_model}; pick n_heads among "
                f"{[h for h in range(1, self.d_model + 1) if self.d_model % h == 0]}."
            )
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}.")
        if self.d_mlp is None:
            self.d_mlp = 4 * self.d_model if self.family == "gpt2" else int(8 * self.d_model / 3 / 8 + 0.999) * 8
        if self.family == "llama" and self.d_head % 2:
            raise ValueError(f"RoPE needs an even head width; d_model/n_heads = {self.d_head}.")
        if self.dtype not in ("float32", "bfloat16", "float16", "float64"):
            raise ValueError(f"dtype must be 'float32', 'bfloat16', 'float16' or 'float64', got {self.dtype!r}.")
        from sinklens.train.variants import get_attention_variant  # lazy: variants import this module

        get_attention_variant(self.variant).check_options(self.variant_options)

    @property
    def d_head(self) -> int:
        """Width of one attention head, ``d_model // n_heads``."""
        return self.d_model // self.n_heads

    @property
    def n_key_value_heads(self) -> int:
        """Alias of ``n_kv_heads`` (the name TransformerLens 4.x uses)."""
        return int(self.n_kv_heads or self.n_heads)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A config from :data:`PRESETS` with some fields replaced.

        Examples:
            >>> ModelConfig.from_preset("tiny", variant="headwise_rms").d_head
            16
        """
        if name not in PRESETS:
            raise ValueError(f"Unknown model preset {name!r}; known presets are {sorted(PRESETS)}.")
        return cls.from_dict({**PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Unknown ModelConfig fields {unknown}; known fields are {sorted(known)}.")
        return cls(**data)
