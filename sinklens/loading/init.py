"""Models at initialization: the same architecture with fresh weights, from the model's own init scheme.

Spec syntax (also accepted by :func:`sinklens.load_model` and every CLI ``--model``):

* ``SPEC@init:S`` — the architecture of ``SPEC`` with weights freshly drawn after seeding with ``S``;
* ``SPEC@init`` — the same with ``S = 0``, except for a ``sinklens train`` run directory, where it
  is exactly the run's step-0 weights (its config and its ``seed``).

Init schemes (``scheme=``):

* ``"native"`` (default) — the model's own: for Hugging Face models ``from_config`` under
  ``torch.manual_seed(S)`` (``PreTrainedModel.post_init`` → ``_init_weights``, e.g. Llama: every
  linear and embedding ``N(0, initializer_range²)``, norms 1); for a sinklens ``SinkLM``
  ``torch.manual_seed(S); SinkLM(cfg)`` — the very calls :func:`sinklens.train.train` makes, so
  ``RUN@init`` is bit-identical to the run's step 0 on CPU.
* ``"normal"`` — after the native init, every parameter with ≥ 2 dimensions is redrawn
  ``N(0, std²)`` (``std`` default 0.02), in ``named_parameters`` order, from the same seed; 1-D
  parameters (norm gains, biases) keep their native values (1 and 0).
* ``"torch"`` — after the native init, every submodule with a ``reset_parameters`` method (PyTorch's
  own default: Kaiming-uniform linears, ``N(0, 1)`` embeddings) resets itself, in ``modules()``
  order. Only Hugging Face models (SinkLM keeps its weights as bare parameters).

The global torch RNG is left as it was (``torch.random.fork_rng``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sinklens import model_files
from sinklens.errors import InvalidArgumentError, NotFoundError, OfflineError
from sinklens.model_files import EMBEDDED_MODELS, convert_gguf, fetch_embedded_gguf
from sinklens.sinklm.checkpoint import is_run_dir, load_train_config
from sinklens.sinklm.init import Scheme, reinit, sinklm_at_init
from sinklens.sinklm.tokenizer import load_tokenizer
from sinklens.validate import as_seed, choice, finite_number

_INIT_SPEC = re.compile(r"^(?P<base>.+)@init(?::(?P<seed>-?\d+))?$")


@dataclass(frozen=True)
class InitSpec:
    """A parsed ``SPEC@init[:S]``: the base spec and the seed (None = the run's own / 0)."""

    base: str
    seed: int | None


def parse_init_spec(spec: str) -> InitSpec | None:
    """``InitSpec`` for ``"X@init"`` / ``"X@init:S"``, None for a spec without ``@init``.

    Examples:
        >>> parse_init_spec("smollm2-135m@init:3")
        InitSpec(base='smollm2-135m', seed=3)
        >>> parse_init_spec("runs/a@init")
        InitSpec(base='runs/a', seed=None)
        >>> parse_init_spec("runs/a") is None
        True
        >>> parse_init_spec("runs/a@init:x")
        Traceback (most recent call last):
        ...
        sinklens.errors.InvalidArgumentError: Bad init spec 'runs/a@init:x': write SPEC@init or SPEC@init:SEED with an integer SEED.
    """
    if "@init" not in spec:
        return None
    match = _INIT_SPEC.match(spec)
    if match is None:
        raise InvalidArgumentError(f"Bad init spec {spec!r}: write SPEC@init or SPEC@init:SEED with an integer SEED.")
    seed = match.group("seed")
    return InitSpec(match.group("base"), None if seed is None else as_seed(int(seed), what=f"the seed of {spec!r}"))


def _hf_source_dir(base: str) -> str:
    """A local HF directory (or Hub id) for ``base``, resolving embedded names and GGUF files."""
    key = base.lower()
    if key in EMBEDDED_MODELS:
        return str(convert_gguf(fetch_embedded_gguf(key)))
    path = Path(base).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(convert_gguf(path))
    return base


def hf_at_init(source: str | Any, seed: int, *, device: str, dtype: torch.dtype, scheme: Scheme = "native",
               std: float = 0.02, tokenizer: Any = None) -> Any:
    """A ``TransformerBridge`` over ``AutoModelForCausalLM.from_config(config)`` drawn after ``torch.manual_seed(seed)``.

    ``source``: an HF directory / Hub id, or an HF ``PretrainedConfig``. Eager attention (so
    ``hook_pattern`` runs); the tokenizer is the source's when it has one.
    """
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if isinstance(source, str):
        config = AutoConfig.from_pretrained(source)
        try:
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError):
            tokenizer = None
        name = source
    else:
        config, name = source, getattr(source, "_name_or_path", "") or "sinklens-init"
    config = config.__class__.from_dict(config.to_dict())
    config._attn_implementation = "eager"
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        reinit(hf, scheme, std, seed)
    hf = hf.to(device=device, dtype=dtype).eval()  # boot_transformers records a given hf_model's device, moves nothing
    kwargs = {"tokenizer": tokenizer} if tokenizer is not None else {}
    return TransformerBridge.boot_transformers(str(name), hf_model=hf, device=device, dtype=dtype, **kwargs)


def load_at_init(
    spec: Any,
    *,
    init_seed: int | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    scheme: Scheme = "native",
    std: float = 0.02,
) -> Any:
    """The model that ``spec`` names, at initialization (see the module docstring).

    Args:
        spec: a spec string (with or without ``@init[:S]``) or an already-built TransformerLens
            model (a ``SinkLM``, a ``TransformerBridge`` over a Hugging Face model, or a 3.x
            ``HookedTransformer``, re-built with ``cfg.seed = S`` by its own ``init_weights``), whose
            architecture is re-drawn.
        init_seed: the seed; overrides one written in the spec. None = the spec's seed, else the
            run's own seed (sinklens runs), else 0.
        scheme: ``"native"``, ``"normal"`` (with ``std``) or ``"torch"``.

    Examples:
        >>> from sinklens.sinklm.model import SinkLM
        >>> from sinklens.sinklm.config import ModelConfig
        >>> cfg = ModelConfig.from_preset("tiny", n_ctx=16, d_vocab=32)
        >>> a = sinklm_at_init(cfg, 3)
        >>> b = load_at_init(a, init_seed=3)
        >>> torch.equal(a.W_E, b.W_E), torch.equal(a.W_E, load_at_init(a, init_seed=4).W_E)
        (True, False)
    """
    scheme = choice(scheme, ("native", "normal", "torch"), what="scheme")  # type: ignore[assignment]
    std = finite_number(std, what="std", low=0.0, low_open=True)
    seed = None if init_seed is None else as_seed(init_seed, what="init_seed")
    if not isinstance(spec, (str, Path)):
        return _model_at_init(spec, 0 if seed is None else seed, device=device, dtype=dtype, scheme=scheme, std=std)
    parsed = parse_init_spec(str(spec)) or InitSpec(str(spec), None)
    seed = seed if seed is not None else parsed.seed
    base = parsed.base
    path = Path(base).expanduser()
    if path.is_dir() and is_run_dir(path) or (path / "config.json").is_file() and _is_run_config(path):
        cfg = load_train_config(path)
        model = sinklm_at_init(cfg.model, cfg.seed if seed is None else seed, device=device, scheme=scheme, std=std)
        if (path / "tokenizer").is_dir():
            model.tokenizer = load_tokenizer(str(path / "tokenizer"))
        model.train_config = cfg
        return model.to(dtype)
    source = _hf_source_dir(base)
    if not Path(source).expanduser().exists() and "/" not in source:
        raise InvalidArgumentError(f"Unknown model {base!r} for an init spec. Embedded models: {sorted(EMBEDDED_MODELS)}; "
                                   "otherwise a local Hugging Face directory, a .gguf file, a sinklens run or a Hub id.")
    if not Path(source).expanduser().exists():
        if base.startswith((".", "/", "~")) or base.endswith(".gguf") or base.count("/") > 1:
            raise NotFoundError(f"No model file or directory at {base!r}.")
        if not model_files.hub_reachable():
            raise OfflineError(f"{base!r} looks like a Hugging Face Hub id, but the Hub cannot be reached.")
        try:
            return hf_at_init(source, 0 if seed is None else seed, device=device, dtype=dtype, scheme=scheme, std=std)
        except OSError as err:
            raise OfflineError(f"Could not fetch the config of {base!r}: {str(err)[:200]}") from err
    return hf_at_init(source, 0 if seed is None else seed, device=device, dtype=dtype, scheme=scheme, std=std)


def _is_run_config(path: Path) -> bool:
    import json

    try:
        data = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "model" in data and "optim" in data


def _model_at_init(model: Any, seed: int, *, device: str, dtype: torch.dtype, scheme: Scheme, std: float) -> Any:
    from sinklens.sinklm.model import SinkLM

    if isinstance(model, SinkLM):
        fresh = sinklm_at_init(model.cfg, seed, device=device, scheme=scheme, std=std)
        fresh.tokenizer = model.tokenizer
        return fresh.to(dtype)
    hf = getattr(model, "original_model", None)
    if hf is not None and hasattr(hf, "config"):
        return hf_at_init(hf.config, seed, device=device, dtype=dtype, scheme=scheme, std=std,
                          tokenizer=getattr(model, "tokenizer", None))
    if type(model).__name__ == "HookedTransformer":  # TransformerLens 3.x: its own init_weights, seeded by cfg.seed
        import copy

        cfg = copy.deepcopy(model.cfg)
        cfg.seed = seed
        with torch.random.fork_rng(devices=[]):
            fresh = type(model)(cfg, tokenizer=getattr(model, "tokenizer", None))
            reinit(fresh, scheme, std, seed)
        return fresh.to(device).to(dtype).eval()
    raise InvalidArgumentError(
        f"Cannot re-initialise a {type(model).__name__}: pass a spec string, a SinkLM, a HookedTransformer or a "
        "TransformerBridge over a Hugging Face model."
    )
