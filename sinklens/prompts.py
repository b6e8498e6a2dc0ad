"""Prompt sets available offline: a small built-in set, and docstrings of the Python standard library."""

from __future__ import annotations

import ast
import platform
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sinklens.errors import InvalidArgumentError
from sinklens.validate import IntLike, as_seed, positive_int

#: A small, varied prompt set used when no text is given.
BUILTIN_PROMPTS: tuple[str, ...] = (
    "The attention sink is a token that receives a large share of attention regardless of its meaning.",
    "In 1869 the transcontinental railroad was completed, linking the eastern and western United States.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
    "Photosynthesis converts light energy into chemical energy stored in glucose and other sugars.",
    "She opened the old wooden door slowly, and the smell of dust and lavender filled the hallway.",
    "The mitochondria is often called the powerhouse of the cell because it produces most of its ATP.",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings.",
    "Interest rates rose for the third consecutive quarter as the central bank tried to curb inflation.",
    "A prime number has exactly two divisors: one and itself. The first few are 2, 3, 5, 7, 11 and 13.",
    "The recipe calls for two cups of flour, one egg, a pinch of salt and a tablespoon of melted butter.",
    "Mount Everest, at 8,849 metres, is the highest mountain above sea level on Earth.",
    "The quick brown fox jumps over the lazy dog while the cat watches from the windowsill.",
    "Neural networks learn representations by adjusting weights to minimise a loss on training data.",
    "Paris is the capital of France; Berlin is the capital of Germany; Madrid is the capital of Spain.",
    "He said he would be back by noon, but the train was delayed and he arrived in the evening instead.",
    "import numpy as np\nx = np.linspace(0, 1, 100)\ny = np.sin(2 * np.pi * x)\nprint(y.mean())",
)


def builtin_prompts() -> list[str]:
    """The built-in prompt set (16 short English, code and factual prompts)."""
    return list(BUILTIN_PROMPTS)


def _stdlib_sources() -> Iterator[str]:
    """The text of the running interpreter's top-level ``stdlib/*.py`` files, by name."""
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def stdlib_docstrings() -> Iterator[str]:
    """Every docstring (module, class, function) of the top-level ``stdlib/*.py`` files, in file
    order then ``ast.walk`` order; files that do not parse are skipped."""
    for source in _stdlib_sources():
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module, ast.AsyncFunctionDef)) and (
                    doc := ast.get_docstring(node)):
                yield doc


def stdlib_text_prompts(n_prompts: IntLike | None = 16, *, n_chars: IntLike = 800, seed: IntLike = 0,
                        what: str = "n_prompts") -> list[str]:
    """Real text available offline: ``n_prompts`` (None: all) standard-library docstrings of at least 30 words
    without doctests (941 on CPython 3.11), cut to ``n_chars``, shuffled by ``seed``; ``what`` names the argument."""
    n_prompts = None if n_prompts is None else positive_int(n_prompts, what=what)
    n_chars = positive_int(n_chars, what="n_chars")
    seed = as_seed(seed, what="seed")
    docs = [" ".join(doc.split())[:n_chars] for doc in stdlib_docstrings()
            if len(doc) >= 200 and ">>>" not in doc and len(doc.split()) >= 30]
    random.Random(seed).shuffle(docs)
    if n_prompts is None:
        return docs
    if n_prompts > len(docs):
        raise InvalidArgumentError(
            f"{what} {n_prompts} asks for more docstrings than this Python's standard library holds: {len(docs)} of at "
            f"least 30 words without doctests (Python {platform.python_version()}); pass at most {len(docs)}.")
    return docs[:n_prompts]


def stdlib_source_tokens(tokenizer: Any, n_tokens: IntLike) -> list[int]:
    """The first ``n_tokens`` token ids of the top-level ``stdlib/*.py`` sources by file name, each encoded
    without special tokens: long text available offline, the same on every run of one Python."""
    n_tokens = positive_int(n_tokens, what="n_tokens")
    ids: list[int] = []
    for source in _stdlib_sources():
        ids += tokenizer.encode(source, add_special_tokens=False)
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    raise InvalidArgumentError(f"n_tokens {n_tokens} is more than this Python's standard library sources hold "
                               f"({len(ids)} tokens).")
