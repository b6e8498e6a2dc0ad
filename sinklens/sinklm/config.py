"""Training configuration: nested dataclasses validated in ``__post_init__``, parsed from flags by tyro; a run's
``config.json`` is ``TrainConfig.to_dict()``. ``sinklens train --fields`` prints the ``Attributes:`` entries."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import typing
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from sinklens.errors import InvalidArgumentError, NotFoundError, tomllib  # tomli on Python 3.10
from sinklens.options import SEQ_LEN, SINK_THRESHOLD
from sinklens.sinklm.variants import get_attention_variant
from sinklens.specs import parse_value
from sinklens.validate import as_bool, as_seed, choice, closest, did_you_mean, finite_number, positive_int

Family = Literal["llama", "gpt2"]
DType = Literal["float32", "bfloat16", "float16", "float64"]
DataSource = Literal["bigram-backcopy", "markov", "text", "memmap", "hf"]
TokenizerKind = Literal["byte", "bpe"]
Autocast = Literal["bfloat16", "float16", "none"]
CpuAutocast = Literal["bfloat16", "none"]
OnNonFinite = Literal["stop", "skip"]
LogTo = Literal["none", "wandb", "tensorboard"]
#: The ``data.source`` values whose ``data.path`` is a file or folder on this machine.
LOCAL_DATA_SOURCES: tuple[str, ...] = ("text", "memmap")
#: The synthetic tasks of :mod:`sinklens.train.data`: every sequence starts with BOS (id 0).
SYNTHETIC_SOURCES: tuple[str, ...] = ("bigram-backcopy", "markov")

#: Presets of :meth:`ModelConfig.from_preset`: ``124m`` is GPT-2 small (vocabulary padded to 50304);
#: ``headnorm-cpu`` is the CPU configuration of the head-wise RMSNorm authors' comparison.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(family="llama", n_layers=2, d_model=64, n_heads=4, n_ctx=128, d_vocab=256),
    "tiny-gpt2": dict(family="gpt2", n_layers=2, d_model=64, n_heads=4, n_ctx=128, d_vocab=256),
    "small": dict(family="llama", n_layers=4, d_model=256, n_heads=4, n_ctx=256, d_vocab=50304),
    "medium": dict(family="llama", n_layers=8, d_model=512, n_heads=8, n_ctx=512, d_vocab=50304),
    "124m": dict(family="llama", n_layers=12, d_model=768, n_heads=12, n_ctx=1024, d_vocab=50304),
    "124m-gpt2": dict(family="gpt2", n_layers=12, d_model=768, n_heads=12, n_ctx=1024, d_vocab=50304),
    "headnorm-cpu": dict(family="llama", n_layers=4, d_model=256, n_heads=4, d_mlp=1024, n_ctx=256, d_vocab=512,
                         variant="headwise_rms"),
}


def _check_unknown(cls: type, data: dict[str, Any]) -> None:
    if not isinstance(data, dict):
        raise InvalidArgumentError(f"{cls.__name__} must be given as a mapping of its fields, got {data!r}.")
    known = {f.name for f in fields(cls)}
    if unknown := sorted(set(data) - known):
        close = {key: closest(key, sorted(known)) for key in unknown}
        hints = [f"{match!r}" + (f" for {key!r}" if len(unknown) > 1 else "") for key, match in close.items() if match]
        hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
        raise InvalidArgumentError(f"Unknown {cls.__name__} keys {unknown}{hint}; known keys are {sorted(known)}.")


class _Part:
    """``to_dict``/``from_dict`` shared by every config dataclass (``__post_init__`` makes float fields floats)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        """A config from ``to_dict()`` output (a ``config.json``); TrainConfig's sections are built from their dicts."""
        _check_unknown(cls, data)
        return cls(**{k: _PARTS[k].from_dict(v) if k in _PARTS and not isinstance(v, _PARTS[k]) else v
                      for k, v in data.items()})


@dataclass
class ModelConfig(_Part):
    """Shape and attention variant of a :class:`sinklens.sinklm.model.SinkLM`.

    ``variant_options`` are the registered ``variant``'s options; ``d_vocab="auto"`` takes the data's vocabulary
    (:func:`sinklens.train.loop.train`). :attr:`DERIVED` fields left None follow the others: ``n_kv_heads = n_heads``,
    ``d_mlp = 4·d_model`` (gpt2) or ``8·d_model/3`` rounded up to a multiple of 8 (llama, SwiGLU)."""

    DERIVED: typing.ClassVar[tuple[str, ...]] = ("n_kv_heads", "d_mlp")

    family: Family = "llama"
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int | None = None
    d_mlp: int | None = None
    n_ctx: int = 128
    d_vocab: int | Literal["auto"] = 256
    variant: str = "baseline"
    variant_options: dict[str, Any] = field(default_factory=dict)
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    dropout: float = 0.0
    init_std: float = 0.02
    dtype: DType = "float32"

    def __post_init__(self) -> None:
        self.family = choice(self.family, typing.get_args(Family), what="model.family")
        for name in ("n_layers", "d_model", "n_heads", "n_ctx"):
            setattr(self, name, positive_int(getattr(self, name), what=f"model.{name}"))
        if self.d_vocab != "auto":
            self.d_vocab = positive_int(self.d_vocab, what="model.d_vocab (or 'auto')")
        if self.d_model % self.n_heads:
            raise InvalidArgumentError(f"n_heads={self.n_heads} does not divide d_model={self.d_model}; pick n_heads "
                                       f"among {[h for h in range(1, self.d_model + 1) if self.d_model % h == 0]}.")
        self.n_kv_heads = self.n_heads if self.n_kv_heads is None else positive_int(self.n_kv_heads, what="model.n_kv_heads")
        if self.n_heads % self.n_kv_heads:
            raise InvalidArgumentError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}.")
        if self.d_mlp is None:
            self.d_mlp = 4 * self.d_model if self.family == "gpt2" else int(8 * self.d_model / 3 / 8 + 0.999) * 8
        self.d_mlp = positive_int(self.d_mlp, what="model.d_mlp")
        if self.family == "llama" and self.d_head % 2:
            raise InvalidArgumentError(f"RoPE needs an even head width; d_model/n_heads = {self.d_head}.")
        for name in ("rope_base", "norm_eps", "init_std"):
            setattr(self, name, finite_number(getattr(self, name), what=f"model.{name}", low=0.0, low_open=True))
        self.dropout = finite_number(self.dropout, what="model.dropout", low=0.0, high=1.0, high_open=True)
        self.dtype = choice(self.dtype, typing.get_args(DType), what="model.dtype")
        if not isinstance(self.variant_options, dict):
            raise InvalidArgumentError(f"model.variant_options must be a mapping, got {self.variant_options!r}.")
        get_attention_variant(self.variant).check_options(self.variant_options)  # names here; values at build

    @property
    def d_head(self) -> int:
        """Width of one attention head, ``d_model // n_heads``."""
        return self.d_model // self.n_heads

    @property
    def n_key_value_heads(self) -> int:
        """Alias of ``n_kv_heads`` (the name TransformerLens 4.x uses)."""
        return int(self.n_kv_heads or self.n_heads)

    def unset_derived(self, *, keep: typing.Iterable[str] = ()) -> ModelConfig:
        """A copy (not validated) with the :attr:`DERIVED` fields not in ``keep`` set to None, to derive again."""
        template = dataclasses.replace(self)
        for name in set(self.DERIVED) - set(keep):
            setattr(template, name, None)
        return template

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A config from :data:`PRESETS` with some fields replaced."""
        if name not in PRESETS:
            raise InvalidArgumentError(f"Unknown model preset {name!r}{did_you_mean(name, PRESETS)}; known presets are "
                                       f"{sorted(PRESETS)}.")
        return cls.from_dict({**PRESETS[name], **overrides})


@dataclass
class OptimConfig(_Part):
    """AdamW with linear warmup then cosine decay to ``min_lr`` (see :func:`sinklens.train.optim.get_lr`).

    Attributes:
        lr: peak learning rate, reached after ``warmup_steps``.
        min_lr: learning rate at and after ``decay_steps`` (None: ``lr / 10``).
        warmup_steps: linear warmup from ``lr / warmup_steps`` to ``lr``.
        decay_steps: step where the cosine reaches ``min_lr`` (None: the run's total ``steps``).
        weight_decay: decoupled weight decay, applied only to parameters with >= 2 dimensions.
        grad_clip: clip the global gradient norm to this value (0 disables clipping).
        fused: None: fused AdamW on CUDA and the CPU, ``foreach`` elsewhere; True forces fused, False ``foreach``."""

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
        self.lr = finite_number(self.lr, what="optim.lr", low=0.0, low_open=True)
        if self.min_lr is not None:
            self.min_lr = finite_number(self.min_lr, what="optim.min_lr")
            if not 0 <= self.min_lr <= self.lr:
                raise InvalidArgumentError(f"optim.min_lr must be in [0, lr={self.lr}], got {self.min_lr}.")
        self.warmup_steps = positive_int(self.warmup_steps, what="optim.warmup_steps", minimum=0)
        if self.decay_steps is not None:
            self.decay_steps = positive_int(self.decay_steps, what="optim.decay_steps")
        self.weight_decay = finite_number(self.weight_decay, what="optim.weight_decay", low=0.0)
        self.grad_clip = finite_number(self.grad_clip, what="optim.grad_clip", low=0.0)
        for name in ("beta1", "beta2"):
            setattr(self, name, finite_number(getattr(self, name), what=f"optim.{name}", low=0.0, high=1.0, high_open=True))
        self.eps = finite_number(self.eps, what="optim.eps", low=0.0, low_open=True)
        if self.fused is not None and not isinstance(self.fused, bool):
            raise InvalidArgumentError(f"optim.fused must be true, false or none, got {self.fused!r}.")

    @property
    def final_lr(self) -> float:
        """``min_lr``, or ``lr / 10`` when it is None."""
        return self.lr / 10 if self.min_lr is None else float(self.min_lr)


@dataclass
class DataConfig(_Part):
    """Where training sequences come from (see :mod:`sinklens.train.data`); each is ``seq_len + 1`` tokens.

    Attributes:
        source: "bigram-backcopy" (Guo et al. 2024), "markov", "text" (file or folder), "memmap" (nanoGPT
            ``train.bin``/``val.bin``), "hf" (a Hugging Face dataset).
        path: file or folder for text/memmap; dataset name for hf.
        seed: the only seed of which sequences are drawn, in which order, whatever the model or its seed.
        val_fraction: share held out for validation (the stream's tail; ``val.bin`` for memmap when present).
        tokenizer: "byte" (256 bytes + ``<|endoftext|>``) or "bpe" trained on the train split (``vocab_size``).
        bos: start every text/hf sequence with the BOS token (synthetic tasks always do; memmap never).
        vocab_size: BPE size; synthetic tasks' token count (BOS included); memmap's range without ``meta.pkl``.
        glob: files to read from a text folder.
        n_triggers, alpha: synthetic task: trigger tokens and Dirichlet concentration of the transition rows.
        task_seed: seed of the synthetic task's transition matrix and triggers (not of the sampling).
        hf_config, hf_split, text_field, max_tokens: Hugging Face options (``max_tokens`` streamed once)."""

    source: DataSource = "bigram-backcopy"
    path: str | None = None
    seq_len: int = SEQ_LEN
    seed: int = 1234
    val_fraction: float = 0.1
    bos: bool = True
    tokenizer: TokenizerKind = "byte"
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
        self.source = choice(self.source, typing.get_args(DataSource), what="data.source")
        for name, minimum in (("seq_len", 1), ("n_triggers", 0), ("max_tokens", 1)):
            setattr(self, name, positive_int(getattr(self, name), what=f"data.{name}", minimum=minimum))
        self.seed = as_seed(self.seed, what="data.seed")
        self.task_seed = as_seed(self.task_seed, what="data.task_seed")
        self.val_fraction = finite_number(self.val_fraction, what="data.val_fraction", low=0.0, high=1.0, low_open=True, high_open=True)
        self.tokenizer = choice(self.tokenizer, typing.get_args(TokenizerKind), what="data.tokenizer")
        self.bos = as_bool(self.bos, what="data.bos")
        if not self.bos and self.source in SYNTHETIC_SOURCES:
            raise InvalidArgumentError(f"data.bos=False: the {self.source} task always starts its sequences with its "
                                       "BOS token (id 0); bos applies to text and hf data.")
        if self.source in ("text", "memmap", "hf") and not self.path:
            raise InvalidArgumentError(f"data.source={self.source!r} needs data.path (a file, folder or dataset name).")
        if self.vocab_size is not None:
            self.vocab_size = positive_int(self.vocab_size, what="data.vocab_size", minimum=2)
        self.alpha = finite_number(self.alpha, what="data.alpha", low=0.0, low_open=True)

    def with_absolute_path(self) -> DataConfig:
        """This config with a local ``path`` made absolute (``~`` expanded), as ``config.json`` records it."""
        local = self.source in LOCAL_DATA_SOURCES and self.path
        return dataclasses.replace(self, path=os.path.abspath(Path(str(self.path)).expanduser())) if local else self


@dataclass
class EvalConfig(_Part):
    """Periodic evaluation: validation loss and sink metrics on fixed held-out batches.

    Attributes:
        interval: evaluate every this many steps (and at the last step); 0 disables.
        batches, batch_size: held-out batches used by every evaluation (the same ones each time).
        sink_threshold: a head is a sink head when its queries' mean attention on position 0 exceeds this (Gu's ε).
        persistence_sequences: random sequences on which each evaluation compares the token preference and
            contraction direction with step 0 (:mod:`sinklens.train.persistence`); 0 disables.
        persistence_seq_len: their length (capped at data.seq_len).
        persistence_seed: the seed that draws them."""

    interval: int = 50
    batches: int = 2
    batch_size: int = 16
    sink_threshold: float = SINK_THRESHOLD
    persistence_sequences: int = 8
    persistence_seq_len: int = SEQ_LEN
    persistence_seed: int = 0

    def __post_init__(self) -> None:
        for name, minimum in (("interval", 0), ("batches", 1), ("batch_size", 1), ("persistence_sequences", 0),
                              ("persistence_seq_len", 2)):
            setattr(self, name, positive_int(getattr(self, name), what=f"eval.{name}", minimum=minimum))
        self.sink_threshold = finite_number(self.sink_threshold, what="eval.sink_threshold", low=0.0, high=1.0,
                                            low_open=True, high_open=True)
        if self.persistence_sequences == 1:
            raise InvalidArgumentError("eval.persistence_sequences must be 0 (off) or at least 2, got 1.")
        self.persistence_seed = as_seed(self.persistence_seed, what="eval.persistence_seed")


_PARTS: dict[str, type[_Part]] = {"model": ModelConfig, "optim": OptimConfig, "data": DataConfig, "eval": EvalConfig}


@dataclass
class TrainConfig(_Part):
    """Everything a training run needs; ``config.json`` of a run directory.

    Attributes:
        steps: optimizer steps.
        batch_size: sequences per optimizer step, over all micro-steps and DDP processes.
        grad_accum: micro-steps per optimizer step.
        seed: model initialisation (and dropout) seed; the data order depends only on data.seed.
        device: "auto" (CUDA when available), "cpu", "cuda", "cuda:1"...
        autocast: mixed precision on CUDA; a CPU run follows cpu_autocast.
        cpu_autocast: "bfloat16" runs a CPU forward under bfloat16 autocast (weights, optimizer, loss float32).
        compile: torch.compile model and loss: "auto" on CUDA only; a failed compile warns and runs eagerly.
        interventions: training-time interventions, "name:key=value,..." specs of the intervention registry.
        log: also send metrics to "wandb" or "tensorboard" (``out_dir/tensorboard``), besides metrics.jsonl.
        log_interval: write a metrics line every this many steps.
        checkpoint_interval: write a checkpoint every this many steps (0: only at the end).
        keep_every: keep every keep_every-th periodic checkpoint; 0 keeps the newest and the one before.
        on_nonfinite: on a NaN/inf loss or gradient norm (only the loss under float16), "stop" raises
            TrainingDivergedError (the last finite checkpoint stays); "skip" drops the update, max_skips times in a row.
        max_skips: non-finite steps skipped in a row before the run stops."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    steps: int = 300
    batch_size: int = 16
    grad_accum: int = 1
    seed: int = 0
    device: str = "auto"
    autocast: Autocast = "bfloat16"
    cpu_autocast: CpuAutocast = "none"
    compile: bool | Literal["auto"] = "auto"
    interventions: list[str] = field(default_factory=list)
    log: LogTo = "none"
    log_interval: int = 1
    checkpoint_interval: int = 0
    keep_every: int = 0
    on_nonfinite: OnNonFinite = "stop"
    max_skips: int = 10

    def __post_init__(self) -> None:
        for name, part in _PARTS.items():
            if not isinstance(got := getattr(self, name), part):
                raise TypeError(f"TrainConfig.{name} must be a {part.__name__} (use TrainConfig.from_dict for "
                                f"dicts), got {type(got).__name__}.")
        for name, minimum in (("steps", 1), ("batch_size", 1), ("grad_accum", 1), ("log_interval", 1),
                              ("checkpoint_interval", 0), ("keep_every", 0), ("max_skips", 1)):
            setattr(self, name, positive_int(getattr(self, name), what=name, minimum=minimum))
        self.seed = as_seed(self.seed, what="seed")
        if self.batch_size % self.grad_accum:
            raise InvalidArgumentError(f"batch_size={self.batch_size} must be divisible by grad_accum={self.grad_accum}.")
        if self.data.seq_len > self.model.n_ctx:
            raise InvalidArgumentError(f"data.seq_len={self.data.seq_len} is longer than the model context "
                                       f"model.n_ctx={self.model.n_ctx}; lower data.seq_len or raise model.n_ctx.")
        if not isinstance(self.compile, bool) and self.compile != "auto":
            raise InvalidArgumentError(f"compile must be true, false or 'auto', got {self.compile!r}.")
        for name, kind in (("autocast", Autocast), ("cpu_autocast", CpuAutocast), ("on_nonfinite", OnNonFinite),
                           ("log", LogTo)):
            setattr(self, name, choice(getattr(self, name), typing.get_args(kind), what=name))
        if isinstance(self.interventions, str) or not all(isinstance(s, str) for s in self.interventions):
            raise InvalidArgumentError(f"interventions must be a list of 'name:key=value' strings, got {self.interventions!r}.")
        self.interventions = list(self.interventions)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with top-level fields replaced (validated again)."""
        plain = {k: asdict(v) if dataclasses.is_dataclass(v) else v for k, v in changes.items()}
        return TrainConfig.from_dict({**self.to_dict(), **plain})


def read_config_file(path: Path) -> Any:
    """The parsed text of a ``.json`` or ``.toml`` config file."""
    text = path.read_text()
    return json.loads(text) if path.suffix == ".json" else tomllib.loads(text)


def load_config(path: str | Path) -> TrainConfig:
    """Read a :class:`TrainConfig` from a ``.json`` or ``.toml`` file (nested tables ``[model]``, ``[optim]``...)."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise InvalidArgumentError(f"Config file {str(path)!r} is a folder; give a .json or .toml file.")
    if not path.is_file():
        raise NotFoundError(f"Config file {str(path)!r} does not exist.")
    if path.suffix not in (".json", ".toml"):
        raise InvalidArgumentError(f"Config file {str(path)!r} must end in .json or .toml.")
    try:
        return TrainConfig.from_dict(read_config_file(path))
    except ValueError as error:  # a syntax error (JSON, TOML, not UTF-8), an unknown key or a bad value
        raise InvalidArgumentError(f"Config file {str(path)!r}: {error}") from error


#: Lower-case spellings of tyro's ``True``/``False``/``None`` values, accepted by :func:`parse_flags`.
_WORDS = {"true": "True", "false": "False", "none": "None", "null": "None"}
_VARIANT_OPTION = "model.variant_options."


def flag_keys() -> list[str]:
    """Every config field's key (``steps``, ``optim.lr``), in declaration order; its flag is ``--`` + the key
    with hyphens. ``model.variant_options`` is set by ``--variant`` or ``--set model.variant_options.NAME=V``."""
    top = [f.name for f in fields(TrainConfig) if f.name not in _PARTS]
    return [f"{p}.{f.name}" for p, part in _PARTS.items() for f in fields(part) if f.name != "variant_options"] + top


def field_class(key: str) -> type:
    """The dataclass holding the field ``key`` (``"optim.lr"`` → :class:`OptimConfig`)."""
    return _PARTS.get(key.rpartition(".")[0], TrainConfig)


def parse_flags(base: TrainConfig, args: Sequence[str]) -> TrainConfig:
    """``base`` with field flags (``--optim.lr 3e-4 --data.seq-len 128``) applied by tyro, then validated once by
    the dataclasses. ``--model.variant-options.NAME VALUE`` adds one variant option; a ``--model.variant`` among
    ``args`` naming another variant drops ``base``'s options (they were for its variant). A bad flag or value raises one
    :class:`~sinklens.errors.InvalidArgumentError` naming it."""
    import tyro
    args, variant = [str(a) for a in args], base.model.variant
    for arg, after in zip(args, [*args[1:], ""]):
        if arg.partition("=")[0] == "--model.variant":
            variant = arg.partition("=")[2] or after
    flags, options = [], dict(base.model.variant_options) if variant == base.model.variant else {}
    items, flag = iter(args), ""
    for arg in items:
        if arg.startswith("--" + _VARIANT_OPTION.replace("_", "-")):
            key, eq, value = arg.partition("=")
            options[key.rpartition(".")[2]] = parse_value(value if eq else next(items, ""))
            continue
        name, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        if "_" in name:  # one spelling: tyro would also take the key's underscores
            raise InvalidArgumentError(f"Unknown flag {name} (did you mean {name.replace('_', '-')}?); "
                                       "sinklens train --fields lists them.")
        flag = name or flag
        key = flag[2:].replace("-", "_")
        choices = str(typing.get_type_hints(field_class(key)).get(key.rpartition(".")[2]))  # a Literal 'none' stays
        flags.append(name + eq + (value if f"'{value}'" in choices else _WORDS.get(value.lower(), value)))
    model = copy.copy(base.model)
    model.variant_options = options  # checked by tyro's ModelConfig, with the final variant
    try:
        with _tyro_errors(flags):
            return tyro.cli(TrainConfig, default=dataclasses.replace(base, model=model), args=flags,
                            prog="sinklens train", config=(tyro.conf.FlagConversionOff,))
    except SystemExit as error:  # a tyro without the error hook: it printed the reason
        raise InvalidArgumentError(f"Bad config flags {' '.join(flags)}; sinklens train --fields lists them.") from error


def apply_overrides(cfg: TrainConfig, overrides: Sequence[str]) -> TrainConfig:
    """``cfg`` with ``--set`` items ``key=value`` (``optim.lr=3e-4``) applied: each is the flag ``--key value``."""
    return parse_flags(cfg, set_flags(overrides))


def set_flags(overrides: Sequence[str]) -> list[str]:
    """``--set`` items ``key=value`` as the flags ``--key value``; an unknown key raises, naming the closest."""
    flags: list[str] = []
    for item in overrides:
        key, sep, value = str(item).partition("=")
        if not sep or not key.strip():
            raise InvalidArgumentError(f"Override {item!r} is not of the form 'section.key=value' (e.g. 'optim.lr=3e-4').")
        if key.strip() not in flag_keys() and not key.startswith(_VARIANT_OPTION):
            raise InvalidArgumentError(f"Unknown config key {key.strip()!r}{did_you_mean(key.strip(), flag_keys())}.")
        flags += ["--" + key.strip().replace("_", "-"), value]
    return flags


def _tyro_errors(args: list[str]) -> Any:
    """A context in which tyro's parse errors raise one :class:`InvalidArgumentError` instead of printing a panel."""
    from tyro import _errors

    def reject(event: Any) -> None:
        arg = getattr(event, "argument", None)
        name = arg.lowered.name_or_flags[0] if arg is not None else None
        if isinstance(event, _errors.UnrecognizedArgs):
            flag = event.tokens[0]
            hint = closest(flag, ["--" + k.replace("_", "-") for k in flag_keys()])
            raise InvalidArgumentError(f"Unknown flag {flag}{f' (did you mean {hint}?)' if hint else ''}; "
                                       "sinklens train --fields lists them.")
        if isinstance(event, _errors.InvalidChoice):
            raise InvalidArgumentError(f"{name} must be one of {list(event.choices)}, got {event.value!r}"
                                       f"{did_you_mean(event.value, event.choices)}.")
        if isinstance(event, _errors.BadValue):
            raise InvalidArgumentError(f"{name} needs a value ({arg.lowered.metavar}).")
        message = (str(getattr(event, "message", "")).strip().splitlines() or [""])[0]
        if name is None:  # the dataclasses' own check: their message as written
            raise InvalidArgumentError(message or f"Bad config flags {' '.join(args)}.")
        given = next((v for a, v in zip(args, args[1:]) if a == name), "")
        kinds = {"INT": "an integer", "FLOAT": "a number", "{None}": "None"}
        kind = " or ".join(kinds.get(k, k) for k in str(arg.lowered.metavar).split("|"))
        raise InvalidArgumentError(f"{name} must be {kind}, got {given!r}.")

    return _errors.on_parse_error(reject)
