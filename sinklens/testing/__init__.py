"""Tiny models for examples and tests (:func:`planted_model`: known sink mechanisms), a pretend CUDA device
(:mod:`.fake_cuda`) and :data:`QUIET`, run options without a progress bar. The tests' zoo: ``tests/support/zoo.py``."""

from sinklens.options import RunOptions
from sinklens.testing.models import Arch, tiny_model, tiny_sinklm, transformer_lens_major, word_tokenizer
from sinklens.testing.planted import PlantedSpec, planted_model

QUIET = RunOptions(progress=False)

__all__ = ["QUIET", "Arch", "PlantedSpec", "planted_model", "tiny_model", "tiny_sinklm", "transformer_lens_major",
           "word_tokenizer"]
