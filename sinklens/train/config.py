"""Training configuration: nested dataclasses, loadable from JSON/TOML, overridable with ``key=value``.

``TrainConfig(model=ModelConfig, optim=OptimConfig, data=DataConfig, eval=EvalConfig, ...)``. Every
part validates itself in ``__post_init__`` and round-trips through ``to_dict``/``from_dict`` (a
checkpoint's ``config.json`` is exactly ``TrainConfig.to_dict()``). Unknown keys raise, naming the
known ones.

Examples:
    >>> cfg = TrainConfig.from_dict({"steps": 10, "optim": {"lr": 1e-3}})
    >>> cfg = apply_overrides(cfg, ["optim.lr=3e-4", "model.n_layers=1", "data.source=markov"])
    >>> cfg.optim.lr, cfg.model.n_layers, cfg.data.source
    (0.0003, 1, 'markov')
    >>> TrainConfig.from_dict(cfg.to_dict()) == cfg
    True
"""

from __future__ import annotations

import ast
import dataclasses
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from sinklens.train.model_config import ModelConfig

DataSource = Literal["bigram-backcopy", "markov", "text", "memmap", "hf"]
TokenizerKind = Literal["byte", "bpe"]
DATA_SOURCES: tuple[str, ...] = ("bigram-backcopy", "markov", "text", "memmap", "hf")


def _check_unknown(cls: type, data: dict[str, Any]) -> None:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"Unknown {cls.__name__} keys {unknown}; known keys are {sorted(known)}.")


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay to ``min_lr`` (see :func:`sinklens.train.loop.get_lr`).

    Attributes:
        lr: peak learning rate, reached after ``warmup_steps``.
        min_lr: learning rate at and after ``decay_steps`` (None: ``lr / 10``).
        warmup_steps: linear warmup from ``lr / warmup_steps`` to ``lr``.
        decay_steps: step where the cosine reaches ``min_lr`` (None: the run's total ``steps``).
        weight_decay: decoupled weight decay, applied only to parameters with >= 2 dimensions.
        grad_clip: clip the global gradient norm to this value (0 disables clipping).
        fused: use fused AdamW when available (CUDA) — None decides automatically.
    """

    lr: float = 1e-3
    min_lr: float | None = None
    warmup_steps: int = 10
    decay_steps: int | None = None
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    fused: bool | None = None

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}.")
        if self.min_lr is not None and not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optim.min_lr must be in [0, lr={self.lr}], got {self.min_lr}.")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}.")
        if self.decay_steps is not None and self.decay_steps < 1:
            raise ValueError(f"optim.decay_steps must be >= 1 or None, got {self.decay_steps}.")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError(f"weight_decay and grad_clip must be >= 0, got {self.weight_decay}, {self.grad_clip}.")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optim.{name} must be in [0, 1), got {getattr(self, name)}.")

    @property
    def final_lr(self) -> float:
        """``min_lr``, or ``lr / 10`` when it is None."""
        return self.lr / 10 if self.min_lr is None else float(self.min_lr)


@dataclass
class DataConfig:
    """Where training sequences come from (see :mod:`sinklens.train.data`).

    Every sequence is ``seq_len + 1`` tokens (inputs are the first ``seq_len``, targets the last);
    with ``bos`` the first token is the BOS id, so the sink has a fixed position-0 token.

    Attributes:
        source: ``"bigram-backcopy"`` (Guo et al. 2024), ``"markov"``, ``"text"`` (a file or folder),
            ``"memmap"`` (nanoGPT ``train.bin``/``val.bin`` of uint16), ``"hf"`` (a Hugging Face dataset).
        path: file or folder for ``text``/``memmap``; dataset name for ``hf``.
        seed: the *only* seed that decides which sequences are drawn, and in which order. Two runs with
            the same ``data`` config see identical batches whatever their model, variant or seed.
        val_fraction: share held out for validation (tail of the token stream; a separate seed
            stream for synthetic tasks). ``memmap`` uses ``val.bin`` when it exists.
        tokenizer: ``"byte"`` (256 bytes + ``<|endoftext|>``) or ``"bpe"`` trained on the train split
            with the ``tokenizers`` library (``vocab_size`` tokens), cached under ``cache_dir``.
        vocab_size: BPE size; for synthetic tasks the number of tokens (BOS included); for ``memmap``
            the token range when the folder has no ``meta.pkl``.
        glob: files to read from a ``text`` folder.
        n_triggers, alpha: bigram-backcopy/markov task: trigger tokens and Dirichlet concentration of
            the transition rows (small = peaked, predictable transitions).
        task_seed: seed of the synthetic task's transition matrix and triggers (not of the sampling).
        hf_config, hf_split, text_field, max_tokens: Hugging Face source options (``max_tokens``
            tokens are streamed once, then held in memory).
    """

    source: str = "bigram-backcopy"  # a DataSource
    path: str | None = None
    seq_len: int = 64
    seed: int = 1234
    val_fraction: float = 0.1
    bos: bool = True
    tokenizer: str = "byte"  # a TokenizerKind
    vocab_size: int | None = None
    glob: str = "**/*.txt"
    cache_dir: str | None = None
    n_triggers: int = 3
    alpha: float = 0.1
    task_seed: int = 0
    hf_config: str | None = None
    hf_split: str = "train"
    text_field: str = "text"
    max_tokens: int = 2_000_000

    def __post_init__(self) -> None:
        if self.source not in DATA_SOURCES:
            raise ValueError(f"Unknown data.source {self.source!r}; expected one of {list(DATA_SOURCES)}.")
        if self.seq_len < 1:
            raise ValueError(f"data.seq_len must be >= 1, got {self.seq_len}.")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}.")
        if self.tokenizer not in ("byte", "bpe"):
            raise ValueError(f"Unknown data.tokenizer {self.tokenizer!r}; expected 'byte' or 'bpe'.")
        if self.source in ("text", "memmap", "hf") and not self.path:
            raise ValueError(f"data.source={self.source!r} needs data.path (a file, folder or dataset name).")
        if self.vocab_size is not None and self.vocab_size < 2:
            raise ValueError(f"data.vocab_size must be >= 2, got {self.vocab_size}.")
        if self.n_triggers < 0 or self.alpha <= 0:
            raise ValueError(f"data.n_triggers must be >= 0 and data.alpha > 0, got {self.n_triggers}, {self.alpha}.")


@dataclass
class EvalConfig:
    """Periodic evaluation: validation loss and sink metrics on fixed held-out batches.

    Attributes:
        interval: evaluate every this many steps (and at the last step); 0 disables.
        batches, batch_size: held-out batches used by every evaluation (the same ones each time).
        sink_threshold: a head is a sink head when the mean attention its queries put on position 0
            exceeds this (the ε of Gu et al. 2024, "When attention sink emerges").
    """

    interval: int = 50
    batches: int = 2
    batch_size: int = 16
    sink_threshold: float = 0.3

    def __post_init__(self) -> None:
        if self.interval < 0 or self.batches < 1 or self.batch_size < 1:
            raise ValueError(
                f"eval.interval must be >= 0 and eval.batches/batch_size >= 1, got "
                f"{self.interval}, {self.batches}, {self.batch_size}."
            )
        if not 0 < self.sink_threshold < 1:
            raise ValueError(f"eval.sink_threshold must be in (0, 1), got {self.sink_threshold}.")


@dataclass
class TrainConfig:
    """Everything a training run needs; ``config.json`` of a run directory.

    Attributes:
        steps: optimizer steps.
        batch_size: sequences per optimizer step, over all micro-steps and all DDP processes.
        grad_accum: micro-steps per optimizer step (``batch_size`` must split evenly over
            ``grad_accum × world_size``).
        seed: model initialisation (and dropout) seed; the data order depends only on ``data.seed``.
        device: ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
        autocast: mixed precision on CUDA (``"bfloat16"``); ignored on CPU, which trains in float32.
        compile: wrap the model in ``torch.compile`` (hooks added during training then graph-break).
        interventions: training-time interventions, ``"name:key=value,key=value"`` strings resolved by
            :func:`sinklens.train.loop.resolve_interventions` (e.g. ``"restart:k=16"``).
        log_interval, checkpoint_interval: write a metrics line / a checkpoint every this many steps
            (a checkpoint is always written at the end when the run has an output directory).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    steps: int = 300
    batch_size: int = 16
    grad_accum: int = 1
    seed: int = 0
    device: str = "auto"
    autocast: str = "bfloat16"  # "bfloat16" | "float16" | "none"
    compile: bool = False
    interventions: list[str] = field(default_factory=list)
    log_interval: int = 1
    checkpoint_interval: int = 0

    def __post_init__(self) -> None:
        for name, part in (("model", ModelConfig), ("optim", OptimConfig), ("data", DataConfig), ("eval", EvalConfig)):
            value = getattr(self, name)
            if not isinstance(value, part):
                raise TypeError(f"TrainConfig.{name} must be a {part.__name__} (use TrainConfig.from_dict for dicts), got {type(value).__name__}.")
        if self.steps < 1 or self.batch_size < 1 or self.grad_accum < 1:
            raise ValueError(
                f"steps, batch_size and grad_accum must be >= 1, got {self.steps}, {self.batch_size}, {self.grad_accum}."
            )
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size={self.batch_size} must be divisible by grad_accum={self.grad_accum}.")
        if self.data.seq_len > self.model.n_ctx:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} is longer than the model context model.n_ctx={self.model.n_ctx}; "
                f"lower data.seq_len or raise model.n_ctx."
            )
        if self.autocast not in ("bfloat16", "float16", "none"):
            raise ValueError(f"autocast must be 'bfloat16', 'float16' or 'none', got {self.autocast!r}.")
        if self.log_interval < 1 or self.checkpoint_interval < 0:
            raise ValueError("log_interval must be >= 1 and checkpoint_interval >= 0.")
        self.interventions = list(self.interventions)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        _check_unknown(cls, data)
        parts = {"model": ModelConfig, "optim": OptimConfig, "data": DataConfig, "eval": EvalConfig}
        data = {k: _part_from_dict(parts[k], v) if k in parts and isinstance(v, dict) else v for k, v in _coerce(cls, data).items()}
        if "interventions" in data:
            data["interventions"] = list(data["interventions"])
        return cls(**data)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with top-level fields replaced (validated again)."""
        return TrainConfig.from_dict({**self.to_dict(), **{k: _plain(v) for k, v in changes.items()}})


def _plain(value: Any) -> Any:
    return asdict(value) if dataclasses.is_dataclass(value) else value


def _coerce(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """Ints given for float-only fields (``lr=1`` in a file or override) become floats."""
    types = {f.name: str(f.type) for f in fields(cls)}
    return {
        k: float(v) if isinstance(v, int) and not isinstance(v, bool) and "float" in types.get(k, "") and "int" not in types.get(k, "") else v
        for k, v in data.items()
    }


def _part_from_dict(cls: type, data: dict[str, Any]) -> Any:
    if cls is ModelConfig:
        return ModelConfig.from_dict(_coerce(ModelConfig, dict(data)))
    _check_unknown(cls, data)
    return cls(**_coerce(cls, data))


def load_config(path: str | Path) -> TrainConfig:
    """Read a :class:`TrainConfig` from a ``.json`` or ``.toml`` file (nested tables ``[model]``, ``[optim]``...)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Config file {str(path)!r} does not exist.")
    if path.suffix == ".json":
        data = json.loads(path.read_text())
    elif path.suffix == ".toml":
        import tomllib

        data = tomllib.loads(path.read_text())
    else:
        raise ValueError(f"Config file {str(path)!r} must end in .json or .toml.")
    return TrainConfig.from_dict(data)


def parse_value(text: str) -> Any:
    """Parse the right-hand side of ``key=value``: a Python/JSON literal if it is one, else the string.

    Examples:
        >>> parse_value("3e-4"), parse_value("true"), parse_value("none"), parse_value("llama")
        (0.0003, True, None, 'llama')
    """
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return text.strip()


def override_dict(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Apply ``"a.b=value"`` overrides to a nested config dict in place (no validation); return it."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"Override {item!r} is not of the form 'section.key=value' (e.g. 'optim.lr=3e-4').")
        *parents, leaf = key.strip().split(".")
        node = data
        for i, part in enumerate(parents):
            if not isinstance(node.get(part), dict):
                raise ValueError(f"Unknown config section {'.'.join(parents[: i + 1])!r} in override {item!r}.")
            node = node[part]
        if leaf not in node and not (parents and parents[-1] == "variant_options"):
            raise ValueError(f"Unknown config key {key.strip()!r}; known keys here are {sorted(node)}.")
        node[leaf] = parse_value(raw)
    return data


def apply_overrides(cfg: TrainConfig, overrides: list[str] | tuple[str, ...]) -> TrainConfig:
    """Apply ``"a.b=value"`` overrides (``--set`` on the command line) and validate the result.

    Raises ``ValueError`` for a malformed override, an unknown key or an invalid resulting config.
    """
    return TrainConfig.from_dict(override_dict(cfg.to_dict(), overrides))
