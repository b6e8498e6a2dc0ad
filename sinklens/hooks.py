"""Hook names, ``cfg`` and weight properties: all sinklens reads of a model, the same on a
TransformerBridge, a HookedTransformer and sinklens' own models."""

from __future__ import annotations

import difflib
import functools
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from sinklens.errors import InvalidArgumentError
from sinklens.validate import optional_index_list

#: Per-layer hook sites used across sinklens, relative to ``blocks.{layer}``.
PATTERN = "attn.hook_pattern"
SCORES = "attn.hook_attn_scores"
Q = "attn.hook_q"
K = "attn.hook_k"
ROT_Q, ROT_K = "attn.hook_rot_q", "attn.hook_rot_k"  # rotary models: the rotated queries and keys
V = "attn.hook_v"
Z = "attn.hook_z"
ATTN_OUT = "hook_attn_out"
MLP_PRE = "mlp.hook_pre"
MLP_POST = "mlp.hook_post"
MLP_OUT = "hook_mlp_out"
RESID_PRE = "hook_resid_pre"
RESID_MID = "hook_resid_mid"
RESID_POST = "hook_resid_post"


def hook_name(layer: int, site: str) -> str:
    """Full hook name of a per-layer ``site``, e.g. ``blocks.3.attn.hook_pattern``."""
    return f"blocks.{layer}.{site}"


def head_output_site(model: Any) -> str:
    """The attention hook site whose per-head outputs enter ``W_O``: ``attn.hook_z``, or the site a
    SinkLM variant that transforms the aggregation declares as ``head_output_site``."""
    return site if isinstance(site := getattr(model, "head_output_site", None), str) else Z


def head_output_gain(model: Any, layer: int) -> Tensor | None:
    """``γ[head, d_head]`` when the head outputs are ``c[b, t, h] · (γ[h] ⊙ hook_z[b, t, h])``: ones
    at ``attn.hook_z``, a SinkLM variant's declared gain, or None for another transform."""
    if head_output_site(model) == Z:
        dims = model_dims(model)
        return torch.ones(dims.n_heads, dims.d_head, dtype=torch.float32)
    gain = getattr(model, "head_output_gain", None)
    return gain(layer) if callable(gain) else None


def layer_of(name: str) -> int:
    """Layer index of a per-layer hook name (12 for ``blocks.12.mlp.hook_post``)."""
    parts = name.split(".")
    if len(parts) < 3 or parts[0] != "blocks" or not parts[1].isdigit():
        raise InvalidArgumentError(f"{name!r} is not a per-layer hook name of the form 'blocks.<layer>.<site>'.")
    return int(parts[1])


@dataclass(frozen=True)
class ModelDims:
    """The sizes sinklens needs, from ``cfg``: ``d_mlp`` is 0 without MLPs (``cfg.attn_only``),
    ``d_vocab_out`` the number of logits."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_model: int
    d_mlp: int
    n_ctx: int
    d_vocab: int
    d_vocab_out: int


def model_dims(model: Any) -> ModelDims:
    """Read :class:`ModelDims` from any TransformerLens-style model's ``cfg``."""
    cfg = getattr(model, "cfg", None)
    if cfg is None:
        raise TypeError(
            f"Expected a TransformerLens model with a .cfg (TransformerBridge, HookedTransformer or a "
            f"sinklens model), got {type(model).__name__}.")
    n_heads = int(cfg.n_heads)
    n_kv = getattr(cfg, "n_key_value_heads", None) or getattr(cfg, "n_kv_heads", None) or n_heads
    d_mlp = 0 if getattr(cfg, "attn_only", False) is True else getattr(cfg, "d_mlp", None) or 0
    d_vocab_out = getattr(cfg, "d_vocab_out", None)
    return ModelDims(
        n_layers=int(cfg.n_layers), n_heads=n_heads, n_kv_heads=int(n_kv), d_head=int(cfg.d_head),
        d_model=int(cfg.d_model), d_mlp=int(d_mlp), n_ctx=int(cfg.n_ctx), d_vocab=int(cfg.d_vocab),
        d_vocab_out=int(d_vocab_out) if isinstance(d_vocab_out, int) and d_vocab_out > 0 else int(cfg.d_vocab))


def model_device(model: Any) -> torch.device:
    """The device the model's parameters live on."""
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device(getattr(model.cfg, "device", None) or "cpu")


def check_model_device(model: Any, device: torch.device | None) -> None:
    """Refuse a model not on ``device`` (None: no check); ``cuda`` matches any ``cuda:N``."""
    if device is None:
        return
    actual = model_device(model)
    if actual.type != device.type or device.index is not None and (actual.index or 0) != device.index:
        raise InvalidArgumentError(
            f"RunOptions(device={str(device)!r}), but the model runs on {actual}: move it first "
            f"(model.to({str(device)!r})) or leave device=None.")


def model_dtype(model: Any) -> torch.dtype:
    """The dtype of the model's floating-point parameters: float32 when it has none."""
    params = getattr(model, "parameters", lambda: ())()
    return next((p.dtype for p in params if p.dtype.is_floating_point), torch.float32)


def check_hook_names(model: Any, names: Iterable[str]) -> None:
    """Refuse a missing hook name, naming the closest real ones."""
    available = model.hook_dict
    for name in names:
        if name not in available:
            close = difflib.get_close_matches(name, list(available), n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else "."
            raise InvalidArgumentError(
                f"Unknown hook {name!r}{hint} The model has {len(available)} hook points "
                f"(see model.hook_dict); per-layer ones look like 'blocks.0.attn.hook_pattern'.")


def resolve_layers(layers: int | Sequence[int] | None, n_layers: int) -> list[int]:
    """A ``layers=`` argument as a list (None = all, an int, or a sequence; negatives from the end)."""
    return optional_index_list(layers, n_layers, what="Layer")


def expand_kv_heads(weight: Float[Tensor, "... kv_head a b"], n_heads: int) -> Float[Tensor, "... head a b"]:
    """Repeat grouped-query key/value weights to one slice per query head."""
    n_kv = weight.shape[-3]
    if n_kv == n_heads:
        return weight
    if n_heads % n_kv:
        raise ValueError(f"{n_heads} query heads cannot share {n_kv} key/value heads evenly.")
    return weight.repeat_interleave(n_heads // n_kv, dim=-3)


_WEIGHT_CACHES: dict[int, dict[str, Tensor]] = {}


def with_cached_weights(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn(model, ...)`` with :func:`weight` stacking each of the model's weights only once."""
    @functools.wraps(fn)
    def wrapped(model: Any, *args: Any, **kwargs: Any) -> Any:
        outer = id(model) in _WEIGHT_CACHES
        _WEIGHT_CACHES.setdefault(id(model), {})
        try:
            return fn(model, *args, **kwargs)
        finally:
            if not outer:
                _WEIGHT_CACHES.pop(id(model), None)
    return wrapped


def weight(model: Any, name: str) -> Tensor:
    """A stacked weight property (``W_Q``, ``W_O``, ``W_in``, ``W_U``, ...), detached; key/value
    weights expanded per query head. ``AttributeError`` if the model has none."""
    cache = _WEIGHT_CACHES.get(id(model))
    if cache is not None and name in cache:
        return cache[name]
    try:
        w = getattr(model, name)
    except AttributeError as err:
        raise AttributeError(f"{type(model).__name__} exposes no weight property {name!r}.") from err
    if w is None:
        raise AttributeError(f"{type(model).__name__} has no {name!r} (e.g. no gated MLP).")
    w = w.detach()
    if name in ("W_K", "W_V"):
        w = expand_kv_heads(w, model_dims(model).n_heads)
    if cache is not None:
        cache[name] = w
    return w


@functools.lru_cache(maxsize=256)
def _checksum_vector(length: int, salt: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Fixed weights in [0.5, 1.5) for :func:`weight_fingerprint`'s checksum, the same in every process."""
    generator = torch.Generator().manual_seed(1_000_003 * length + salt)
    return (torch.rand(length, generator=generator, dtype=torch.float64) + 0.5).to(device=device, dtype=dtype)


def _weight_checksum(param: Tensor) -> Tensor:
    """``sᵀ X r`` over the tensor viewed as ``X = [rows, last dim]``, with fixed weights ``r``,
    ``s``: reads every entry once; any edit above rounding moves it, a permutation included."""
    x = param.detach()
    x = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=x.device)
    if not x.dtype.is_floating_point or x.element_size() < 4:  # half precision, integers: float32 products
        x = x.float()
    rows = x @ _checksum_vector(x.shape[1], 1, x.device, x.dtype)
    return rows.double() @ _checksum_vector(x.shape[0], 2, x.device, torch.float64)


def weight_fingerprint(model: Any) -> tuple:
    """A key that changes when the model's weights change: per parameter its address, version
    counter, shape and :func:`_weight_checksum` (which catches writes through ``.data``)."""
    keys, sums = [], []
    with torch.no_grad():
        for param in model.parameters():
            try:
                version = param._version
            except RuntimeError:  # an inference tensor has no version counter
                version = -1
            keys.append((param.data_ptr(), version, tuple(param.shape)))
            sums.append(None if param.is_meta else _weight_checksum(param))
    host: dict[int, float] = {}
    for device in {value.device for value in sums if value is not None}:
        where = [i for i, value in enumerate(sums) if value is not None and value.device == device]
        host.update(zip(where, torch.stack([sums[i] for i in where]).tolist()))
    return tuple(key + (host.get(i),) for i, key in enumerate(keys))


#: The block submodule holding each per-layer weight property.
_BLOCK_WEIGHTS = {"W_in": "mlp", "W_gate": "mlp", "W_out": "mlp", "W_Q": "attn", "W_K": "attn", "W_V": "attn", "W_O": "attn"}


def layer_weight(model: Any, name: str, layer: int) -> Tensor:
    """``weight(model, name)[layer]`` without stacking: ``model.blocks[layer].{mlp|attn}.{name}``
    when it has the stacked slice's shape, else the stacked property sliced."""
    cache = _WEIGHT_CACHES.get(id(model))
    if cache is not None and name in cache:
        return cache[name][layer]
    try:
        w = getattr(getattr(model.blocks[layer], _BLOCK_WEIGHTS[name]), name)
    except (KeyError, AttributeError, IndexError, TypeError):
        w = None
    if isinstance(w, Tensor):
        d = model_dims(model)
        w = w.detach()
        if name == "W_O" and w.dim() == 2 and w.numel() == d.n_heads * d.d_head * d.d_model:
            w = w.reshape(d.n_heads, d.d_head, d.d_model)  # fused [d_model, d_model] output projection
        if name in ("W_K", "W_V") and w.dim() == 3:
            w = expand_kv_heads(w, d.n_heads)
        expected = {"W_in": (d.d_model, d.d_mlp), "W_gate": (d.d_model, d.d_mlp), "W_out": (d.d_mlp, d.d_model),
                    "W_O": (d.n_heads, d.d_head, d.d_model)}.get(name, (d.n_heads, d.d_model, d.d_head))
        if tuple(w.shape) == expected:
            return w
    return weight(model, name)[layer]


def weight_cached(model: Any, key: Hashable, compute: Callable[[], Any]) -> Any:
    """``compute()``, kept per model under ``key`` until its :func:`weight_fingerprint` changes
    (taken on every call, or once inside :func:`with_cached_weights`)."""
    stack = _WEIGHT_CACHES.get(id(model), {})
    if "__fingerprint__" not in stack:
        stack["__fingerprint__"] = weight_fingerprint(model)
    try:
        known, values = _STAT_CACHES.get(model, (None, {}))
    except TypeError:  # not weak-referenceable: no cache
        return compute()
    if known != stack["__fingerprint__"]:
        values = {}
        _STAT_CACHES[model] = (stack["__fingerprint__"], values)
    if key not in values:
        values[key] = compute()
    return values[key]


#: model -> (weight fingerprint, {key: value}); see :func:`weight_cached`.
_STAT_CACHES: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


#: model -> the lock its hooked passes hold (:func:`exclusive_use`); ids of the models this thread is running.
_LOCKS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()
_RUNNING = threading.local()


@contextmanager
def exclusive_use(model: Any) -> Iterator[None]:
    """Hold ``model`` while sinklens hooks and runs it, so two passes never fire each other's hooks:
    another thread waits; a pass started from a hook of one :func:`running` here is refused."""
    if id(model) in getattr(_RUNNING, "models", ()):
        raise InvalidArgumentError(
            f"A sinklens pass on this {type(model).__name__} was started from inside a hook of another pass on it, "
            "which would mix both results: collect what the hook needs and run the analysis after the pass.")
    try:
        with _LOCKS_GUARD:
            lock = _LOCKS.setdefault(model, threading.RLock())
    except TypeError:  # not weak-referenceable: nothing to hold it by
        lock = nullcontext()
    with lock:
        yield


@contextmanager
def running(model: Any) -> Iterator[None]:
    """Mark this thread as inside a hooked forward of ``model`` (see :func:`exclusive_use`)."""
    models = _RUNNING.__dict__.setdefault("models", set())
    models.add(id(model))
    try:
        yield
    finally:
        models.discard(id(model))


@contextmanager
def hooks_silenced(module: torch.nn.Module) -> Iterator[None]:
    """Run ``module`` without the forward hooks already on it and its submodules (the user's and
    sinklens' trampolines); the hook tables are restored when the block ends."""
    saved = [(table, dict(table)) for m in module.modules() for table in (m._forward_hooks, m._forward_pre_hooks) if table]
    try:
        for table, _ in saved:
            table.clear()  # emptied in place: no module attribute is set (a bridge re-collects aliases on that)
        yield
    finally:
        for table, hooks in saved:
            table.clear()
            table.update(hooks)


@contextmanager
def eval_mode(model: Any) -> Iterator[None]:
    """Run ``model`` in eval mode inside the block, then give every submodule (a bridge's
    ``original_model`` included) back the mode it had."""
    roots = (model, getattr(model, "original_model", None)) if isinstance(model, torch.nn.Module) else ()
    modules = {id(m): m for r in roots if isinstance(r, torch.nn.Module) for m in r.modules()}
    training = {key for key, m in modules.items() if m.training}
    was_training = id(model) in training
    if training:  # else already in eval mode (or no module): nothing to switch
        model.eval()  # through the model's own eval(): a wrapper may pass it on to a model it holds
    try:
        yield
    finally:
        if was_training:
            model.train()
        for key, m in modules.items():
            m.training = key in training


def refuse_meta_model(model: Any) -> None:
    """Refuse a model whose parameters are on the ``meta`` device."""
    if model_device(model).type == "meta":
        raise InvalidArgumentError(
            "The model's parameters are on the meta device (shapes without values), so nothing can be measured: "
            "materialise it first (model.to_empty(device='cpu') then load_state_dict, or load it with real weights).")
