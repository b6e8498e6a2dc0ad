"""Test utilities shipped with sinklens: tiny config-built models and models with planted mechanisms.

* :func:`tiny_model` (:mod:`sinklens.testing.models`): seeded tiny Llama/GPT-2 style models on
  whichever TransformerLens is installed; :func:`tiny_sinklm`: a step-0 sinklens ``SinkLM`` with any of the
  trainer's attention variants.
* :func:`no_hooks_left`, :func:`public_dataclasses`, :data:`TINY_PROMPTS`, :data:`VARIED_PROMPTS`, :data:`PLANTED_PROMPTS`, :data:`QUIET`
  (:mod:`sinklens.testing.checks`): shared test checks, prompts and run options.
* :func:`planted_model` (:mod:`sinklens.testing.planted`): tiny models with a hand-planted super
  neuron, eraser and query-key locking, for analyzers to find.
"""

from sinklens.testing.checks import (
    PLANTED_PROMPTS,
    QUIET,
    TINY_PROMPTS,
    VARIED_PROMPTS,
    attached_hook_count,
    no_hooks_left,
    public_dataclasses,
)
from sinklens.testing.models import Arch, tiny_model, tiny_sinklm, transformer_lens_major, word_tokenizer
from sinklens.testing.planted import PlantedSpec, planted_model

__all__ = [
    "PLANTED_PROMPTS", "QUIET", "TINY_PROMPTS", "VARIED_PROMPTS", "attached_hook_count", "no_hooks_left", "public_dataclasses", "Arch", "PlantedSpec", "planted_model", "tiny_model", "tiny_sinklm", "transformer_lens_major", "word_tokenizer"]
