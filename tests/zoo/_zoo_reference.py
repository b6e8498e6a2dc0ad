"""The architecture zoo: one analysed report per family, and an independent reference for it.

The reference never uses sinklens: under TransformerLens 4.x it is the plain Hugging Face model of the
same folder (:func:`~support.zoo.zoo_hf_model`, eager attention), run on each sequence alone
(no padding) with forward hooks on its layers for the residual stream and ``output_attentions`` for the
patterns; under TransformerLens 3.x (whose zoo models are built from a config, with their own weights)
it is the model's own full cache (``run_with_cache`` with a ``names_filter``), again one unpadded
sequence at a time. Which keys a query sees is written down here from the zoo's configs, not read from
:mod:`sinklens.visibility`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

from sinklens.analysis.report import SinkReport, analyze
from sinklens.inputs import TokenBatch, as_batches
from sinklens.options import RunOptions
from sinklens.testing.models import transformer_lens_major
from support.zoo import ENCODER_FAMILIES, FamilyUnavailableError, zoo_hf_model, zoo_model

#: Words of the zoo tokenizers (t5..t63); lengths 7, 3, 9 and 5 words: padded batches, and prompts longer
#: than the zoo's sliding window of 4 tokens.
PROMPTS = ["t5 t6 t7 t8 t9 t10 t11", "t12 t13 t14", "t15 t16 t17 t18 t19 t20 t21 t22 t23", "t24 t25 t26 t27 t28"]
BATCH_SIZE = 2
WINDOW = 4  # the zoo's default sliding window
#: Layers with a sliding window, per family (the zoo's configs: Mistral on every layer; Gemma 2/3 and
#: gpt-oss alternate, sliding first).
SLIDING_LAYERS = {"mistral": "all", "gemma2": "even", "gemma3": "even", "gptoss": "even"}
TL4 = transformer_lens_major() >= 4


def visible(family: str, layer: int, n: int) -> Tensor:
    """``[query, key]``: True where the family's attention lets query ``q`` see key ``k`` in ``layer``."""
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    if family in ENCODER_FAMILIES:
        return torch.ones(n, n, dtype=torch.bool)
    seen = k <= q
    rule = SLIDING_LAYERS.get(family)
    if rule == "all" or (rule == "even" and layer % 2 == 0):
        seen &= q - k < WINDOW
    return seen


@dataclass
class Reference:
    """Per sequence (unpadded): ``resid[s]`` residual stream ``s`` (``s < n_layers``: the input of layer
    ``s``; ``n_layers``: the output of the last layer), ``[stream, pos, d_model]``; ``pattern`` the attention
    pattern, ``[layer, head, query, key]``."""

    resid: list[Tensor]
    pattern: list[Tensor]
    source: str


@dataclass
class Analysed:
    family: str
    model: Any
    report: SinkReport
    batches: list[TokenBatch]
    reference: Reference


def _hf_layers(hf: Any) -> Any:
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "bert.encoder.layer"):
        obj = hf
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
            return obj
        except AttributeError:
            continue
    raise AttributeError(f"No decoder layers found on {type(hf).__name__}.")


def _hf_reference(family: str, sequences: list[Tensor]) -> Reference:
    hf = zoo_hf_model(family)
    layers = _hf_layers(hf)
    inputs: dict[int, Tensor] = {}
    outputs: dict[int, Tensor] = {}

    def pre(i):
        def hook(module, args, kwargs):
            inputs[i] = (args[0] if args else kwargs["hidden_states"]).detach()

        return hook

    def post(i):
        def hook(module, args, output):
            outputs[i] = (output[0] if isinstance(output, tuple) else output).detach()

        return hook

    handles = [layer.register_forward_pre_hook(pre(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles += [layer.register_forward_hook(post(i)) for i, layer in enumerate(layers)]
    resid, pattern = [], []
    try:
        with torch.no_grad():
            for tokens in sequences:
                out = hf(tokens[None], output_attentions=True)
                n_layers = len(layers)
                resid.append(torch.stack([inputs[i][0] for i in range(n_layers)] + [outputs[n_layers - 1][0]]))
                pattern.append(torch.stack([a[0] for a in out.attentions]))
    finally:
        for h in handles:
            h.remove()
    return Reference(resid, pattern, "plain Hugging Face model")


def _cache_reference(model: Any, sequences: list[Tensor]) -> Reference:
    n_layers = model.cfg.n_layers
    names = [f"blocks.{i}.hook_resid_pre" for i in range(n_layers)] + [f"blocks.{n_layers - 1}.hook_resid_post"]
    patterns = [f"blocks.{i}.attn.hook_pattern" for i in range(n_layers)]
    resid, pattern = [], []
    with torch.no_grad():
        for tokens in sequences:
            _, cache = model.run_with_cache(tokens[None], names_filter=lambda n: n in names or n in patterns)
            resid.append(torch.stack([cache[n][0] for n in names]))
            pattern.append(torch.stack([cache[n][0] for n in patterns]))
    return Reference(resid, pattern, "full cache")


def unpadded(batches: list[TokenBatch]) -> list[Tensor]:
    """Every sequence's real tokens, in order."""
    return [b.tokens[i][b.valid[i]].cpu() for b in batches for i in range(b.tokens.shape[0])]


_ANALYSED: dict[str, Analysed] = {}


@pytest.fixture
def analysed():
    """``analysed(family)``: the family's zoo model analysed on :data:`PROMPTS` (cached per process) with
    its reference; skips a family the installed TransformerLens cannot build."""

    def get(family: str) -> Analysed:
        if family not in _ANALYSED:
            try:
                model = zoo_model(family)
            except FamilyUnavailableError as err:
                pytest.skip(str(err))
            options = RunOptions(batch_size=BATCH_SIZE, progress=False)
            batches = as_batches(model, PROMPTS, batch_size=BATCH_SIZE)
            report = analyze(model, PROMPTS, abs_threshold=None, rel_threshold=2.0, options=options)
            sequences = unpadded(batches)
            ref = _hf_reference(family, sequences) if TL4 else _cache_reference(model, sequences)
            _ANALYSED[family] = Analysed(family, model, report, batches, ref)
        return _ANALYSED[family]

    return get


