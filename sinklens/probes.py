"""What a model's forward pass does with hooks, probed once per model with a 2- or 3-token forward:
hooks never fired, attention hooks fired after the fact, attention both ways, a copied resid_mid."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Hashable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor

from sinklens.errors import UnsupportedArchitectureError
from sinklens.hooks import (
    MLP_OUT, PATTERN, RESID_MID, RESID_POST, SCORES, Z, eval_mode, exclusive_use, hook_name,
    hooks_silenced, model_device, model_dims, refuse_meta_model,
)

#: model -> {probe key: answer}; see :func:`_probed`.
_PROBES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _probed(model: Any, key: Hashable, probe: Callable[[], Any]) -> Any:
    """``probe()`` once per model and ``key``, with the model's hooks silenced and in eval mode (weak map)."""
    try:
        known = _PROBES.setdefault(model, {})
    except TypeError:  # not weak-referenceable: probed every time
        known = {}
    if key not in known:
        refuse_meta_model(model)
        silenced = hooks_silenced(model) if isinstance(model, torch.nn.Module) else nullcontext()
        with exclusive_use(model), silenced, eval_mode(model):
            known[key] = probe()
    return known[key]


def _run_probe(model: Any, hooks: list, n_tokens: int) -> None:
    """One forward of ``n_tokens`` zero tokens with ``hooks`` attached."""
    tokens = torch.zeros(1, n_tokens, dtype=torch.long, device=model_device(model))
    with torch.inference_mode(), model.hooks(fwd_hooks=hooks):
        model(tokens, return_type=None)


def _recorder(seen: dict[str, Tensor], key: str) -> Callable[[Tensor, Any], None]:
    """A hook keeping a float copy of its activation in ``seen[key]`` (keys in firing order)."""
    def hook(act: Tensor, hook: Any) -> None:
        seen[key] = act.detach().float().clone()
    return hook


def silent_hooks(model: Any, names: Sequence[str]) -> list[str]:
    """The hooks among ``names`` that exist but never run in a forward (e.g. GPT-NeoX's ``attn.hook_rot_q``)."""
    present = [n for n in names if n in model.hook_dict]
    if not present:
        return []
    def probe() -> list[str]:
        fired: dict[str, Tensor] = {}
        _run_probe(model, [(n, _recorder(fired, n)) for n in present], 2)
        return [n for n in present if n not in fired]
    return _probed(model, ("silent", tuple(present)), probe)


def post_hoc_attention(model: Any) -> str | None:
    """Why ``hook_attn_scores`` / ``hook_pattern`` fire after the attention ran (edits are discarded, as in the
    4.x BERT bridge), or None when they are seams. A 3-token probe lets each query see only its own key at layer
    0's scores: attention elsewhere in ``hook_pattern``, or ``hook_pattern`` after ``hook_z``, is post hoc."""
    names = [hook_name(0, site) for site in (SCORES, PATTERN, Z)]
    if any(n not in model.hook_dict for n in names[:2]):
        return None
    def probe() -> str | None:
        seen: dict[str, Tensor] = {}
        def only_own_key(scores: Tensor, hook: Any) -> Tensor:
            n_q, n_k = scores.shape[-2:]
            own = torch.eye(n_k, dtype=torch.bool, device=scores.device)[n_k - n_q:]
            return scores.masked_fill(~own, float("-inf"))
        hooks = [(names[0], only_own_key), (names[1], _recorder(seen, PATTERN))]
        if names[2] in model.hook_dict:
            hooks.append((names[2], _recorder(seen, Z)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TransformerLens' "edit is discarded" warning: reported below instead
            _run_probe(model, hooks, min(3, model_dims(model).n_ctx))
        if (pattern := seen.get(PATTERN)) is None:
            return None
        n_q, n_k = pattern.shape[-2:]
        other_keys = ~torch.eye(n_k, dtype=torch.bool, device=pattern.device)[n_k - n_q:]
        discarded = bool((pattern.abs() * other_keys).amax() > 0)
        order = list(seen)
        late = Z in order and order.index(PATTERN) > order.index(Z)
        if not (discarded or late):
            return None
        return ("its attention runs inside the wrapped Hugging Face module and TransformerLens fires "
                "hook_attn_scores and hook_pattern afterwards, with the post-softmax weights (an edit there is "
                "discarded, and hook_attn_scores holds probabilities, not pre-softmax scores)")
    return _probed(model, "post_hoc_attention", probe)


def require_attention_seams(model: Any, what: str) -> None:
    """Refuse ``model`` when its attention hooks are post hoc (:func:`post_hoc_attention`): ``what``
    (e.g. ``"mask interventions"``) would silently do nothing there."""
    if (reason := post_hoc_attention(model)) is not None:
        raise UnsupportedArchitectureError(
            f"{what.capitalize()} cannot run on this model, whose attention scores and pattern cannot be edited: "
            f"{reason}. Analyses that only read activations (find_sinks, measure_variance, ...) work on it.")


def attends_to_later_keys(model: Any) -> bool:
    """True when query 0 of layer 0 attends to key 1 (a 2-token probe of ``hook_pattern``): the model attends
    both ways, whatever ``cfg.attention_dir`` says."""
    name = hook_name(0, PATTERN)
    if name not in model.hook_dict:
        return False
    def probe() -> bool:
        seen: dict[str, Tensor] = {}
        _run_probe(model, [(name, _recorder(seen, PATTERN))], 2)
        return PATTERN in seen and bool((seen[PATTERN][..., 0, 1] > 0).any())
    return _probed(model, "attends_to_later_keys", probe)


def resid_mid_is_a_copy(model: Any) -> bool:
    """True when an edit returned from ``blocks.l.hook_resid_mid`` reaches the MLP but not the residual stream
    (4.x bridges fire it on a copy, as ``ln2.hook_in``): a 2-token probe adds 1 there and checks whether
    ``hook_resid_post − hook_mlp_out`` moved."""
    names = [hook_name(0, site) for site in (RESID_MID, MLP_OUT, RESID_POST)]
    if any(n not in model.hook_dict for n in names):
        return False
    def probe() -> bool:
        seen: dict[str, Tensor] = {}
        def shift(act: Tensor, hook: Any) -> Tensor:
            seen["mid"] = act.detach().float().clone()
            return act + 1.0
        _run_probe(model, [(names[0], shift), (names[1], _recorder(seen, "mlp")),
                           (names[2], _recorder(seen, "post"))], 2)
        if len(seen) < 3:
            return False
        skip = seen["post"] - seen["mlp"]  # the residual the block carried past its MLP
        return bool((skip - seen["mid"]).abs().max() < (skip - seen["mid"] - 1.0).abs().max())
    return _probed(model, "resid_mid_is_a_copy", probe)
