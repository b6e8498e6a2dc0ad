"""Inputs for the analyzers: natural text, a built-in prompt set and random-token sequences.

Every source ends up as a list of :class:`TokenBatch` — right-padded token ids plus a ``valid``
mask. Right padding keeps every sequence's first token at position 0 (where the sink lives) and,
with causal attention, leaves the activations of real tokens untouched by the pads; analyzers
only have to drop padded positions from their reductions.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from sinklens.errors import InvalidArgumentError, SequenceTooLongError
from sinklens.hooks import model_device, model_dims
from sinklens.validate import IntLike, as_bool, as_int, check_vocab, optional_positive_int, positive_int, prompt_list, token_ids


@dataclass
class TokenBatch:
    """A right-padded batch of token ids.

    Attributes:
        tokens: token ids, padded on the right.
        valid: True at real tokens, False at padding.
        prepend_bos: whether position 0 of each sequence is a prepended BOS token (it moves the sink,
            so every result records it).
    """

    tokens: Int[Tensor, "batch pos"]
    valid: Bool[Tensor, "batch pos"]
    prepend_bos: bool

    @property
    def lengths(self) -> Int[Tensor, " batch"]:
        return self.valid.sum(dim=1)

    def to(self, device: torch.device | str) -> TokenBatch:
        return TokenBatch(self.tokens.to(device), self.valid.to(device), self.prepend_bos)


Inputs = Union[str, Sequence[str], Tensor, TokenBatch, Sequence[TokenBatch]]

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


def stdlib_text_prompts(n_prompts: IntLike = 16, *, n_chars: IntLike = 800, seed: IntLike = 0) -> list[str]:
    """Real text available offline: docstrings from the Python standard library's own sources.

    Docstrings of at least 30 words without doctest examples (English prose written by people),
    read from the running interpreter's ``stdlib`` directory: the same call gives the same text on
    every machine with the same Python build.
    """
    n_prompts = positive_int(n_prompts, what="n_prompts")
    n_chars = positive_int(n_chars, what="n_chars")
    seed = as_int(seed, what="seed")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs: list[str] = []
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                # Prose only: long enough, and no doctest examples (code, not text).
                if doc and len(doc) >= 200 and ">>>" not in doc and len(doc.split()) >= 30:
                    docs.append(" ".join(doc.split())[:n_chars])
    random.Random(seed).shuffle(docs)
    return docs[:n_prompts]


def _pad_right(rows: list[Tensor], pad_id: int, prepend_bos: bool) -> TokenBatch:
    width = max(int(r.numel()) for r in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    valid = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, row in enumerate(rows):
        tokens[i, : row.numel()] = row
        valid[i, : row.numel()] = True
    return TokenBatch(tokens, valid, prepend_bos)


def bos_token_id(model: Any) -> int:
    """The id put at position 0 when ``prepend_bos``: the tokenizer's BOS when it is a real special
    token of the model, else its CLS token (BERT-style tokenizers start every sequence with it).

    Refused (:class:`~sinklens.errors.InvalidArgumentError`) when the tokenizer has neither, or when its
    ``bos_token_id`` is the unknown token (a bridge fills it with ``[UNK]`` on BERT).
    """
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise InvalidArgumentError("prepend_bos=True but the model has no tokenizer to name a BOS token; "
                                   "use prepend_bos=False (CLI: --no-bos) or put the BOS id in the tokens yourself.")
    unk = getattr(tok, "unk_token_id", None)
    special = set(getattr(tok, "all_special_ids", []) or [])
    for attr in ("bos_token_id", "cls_token_id"):
        idx = getattr(tok, attr, None)
        if isinstance(idx, int) and idx != unk and (not special or idx in special):
            return idx
    bos = getattr(tok, "bos_token", None)
    raise InvalidArgumentError(
        f"prepend_bos=True but the tokenizer has no BOS (or CLS) token of its own (bos_token={bos!r}"
        f"{', the unknown token' if getattr(tok, 'bos_token_id', None) == unk and unk is not None else ''}); "
        "use prepend_bos=False (CLI: --no-bos)."
    )


def _check_length(length: int, n_ctx: int) -> None:
    if length > n_ctx:
        raise SequenceTooLongError(
            f"A sequence of {length} tokens is longer than the model's context of {n_ctx} tokens "
            f"(cfg.n_ctx); pass max_length={n_ctx} or shorter to truncate."
        )


def tokenize_prompts(
    model: Any,
    prompts: Sequence[str],
    *,
    batch_size: IntLike = 8,
    prepend_bos: bool = True,
    max_length: IntLike | None = None,
) -> list[TokenBatch]:
    """Tokenise prompts with the model's tokenizer into right-padded batches.

    Args:
        prepend_bos: put the tokenizer's BOS token at position 0 (the sink moves with it).
        max_length: truncate each prompt to this many tokens (BOS included); without it a prompt
            longer than ``cfg.n_ctx`` raises :class:`SequenceTooLongError`.
    """
    prompts = prompt_list(prompts)
    batch_size = positive_int(batch_size, what="batch_size")
    prepend_bos = as_bool(prepend_bos, what="prepend_bos")
    max_length = optional_positive_int(max_length, what="max_length")
    if getattr(model, "tokenizer", None) is None:
        raise InvalidArgumentError(
            "This model has no tokenizer; pass token ids (an int tensor [batch, pos]) instead of strings."
        )
    bos = bos_token_id(model) if prepend_bos else None
    n_ctx = model_dims(model).n_ctx
    pad_id = model.tokenizer.pad_token_id
    if pad_id is None:
        pad_id = model.tokenizer.eos_token_id or 0
    rows = []
    for prompt in prompts:
        ids = model.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if bos is not None:
            ids = [bos, *ids]
        if max_length is not None:
            ids = ids[:max_length]
        _check_length(len(ids), n_ctx)
        if not ids:
            raise InvalidArgumentError(f"Prompt {prompt!r} tokenises to no tokens.")
        rows.append(torch.tensor(ids, dtype=torch.long))
    return [_pad_right(rows[i : i + batch_size], pad_id, prepend_bos) for i in range(0, len(rows), batch_size)]


def random_token_batches(
    model: Any,
    *,
    n_sequences: IntLike = 16,
    seq_len: IntLike = 64,
    batch_size: IntLike = 8,
    prepend_bos: bool = False,
    seed: IntLike = 0,
) -> list[TokenBatch]:
    """Uniformly random token sequences: the theory's setting, with no semantic first token.

    With ``prepend_bos=True`` position 0 is the tokenizer's BOS (or token 0 for models without a
    tokenizer) and the remaining ``seq_len - 1`` tokens are random.
    """
    n_sequences = positive_int(n_sequences, what="n_sequences")
    seq_len = positive_int(seq_len, what="seq_len")
    batch_size = positive_int(batch_size, what="batch_size")
    prepend_bos = as_bool(prepend_bos, what="prepend_bos")
    seed = as_int(seed, what="seed")
    dims = model_dims(model)
    _check_length(seq_len, dims.n_ctx)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, dims.d_vocab, (n_sequences, seq_len), generator=gen)
    if prepend_bos:
        tokens[:, 0] = bos_token_id(model) if getattr(model, "tokenizer", None) is not None else 0
    valid = torch.ones_like(tokens, dtype=torch.bool)
    return [
        TokenBatch(tokens[i : i + batch_size], valid[i : i + batch_size], prepend_bos)
        for i in range(0, n_sequences, batch_size)
    ]


def as_batches(
    model: Any,
    inputs: Inputs | None = None,
    *,
    batch_size: IntLike = 8,
    prepend_bos: bool = True,
    max_length: IntLike | None = None,
) -> list[TokenBatch]:
    """Normalise any accepted input into right-padded :class:`TokenBatch` es on the model's device.

    Accepts a string, a list of strings, an int tensor ``[batch, pos]`` (all tokens valid; its
    first column counts as BOS when ``prepend_bos``), one :class:`TokenBatch` or a list of them.
    ``None`` means the built-in prompt set.

    Every argument is checked here, once (:mod:`sinklens.validate`): ``batch_size`` and
    ``max_length`` must be positive, a prompt list must hold only strings, and every token id must
    lie in ``0..d_vocab-1`` (checked on the CPU before the batches move to the model's device).
    """
    batch_size = positive_int(batch_size, what="batch_size")
    prepend_bos = as_bool(prepend_bos, what="prepend_bos")
    max_length = optional_positive_int(max_length, what="max_length")
    if inputs is None:
        inputs = builtin_prompts()
    if isinstance(inputs, Sequence) and not isinstance(inputs, str) and len(inputs) == 0:
        raise InvalidArgumentError("No prompts given: pass at least one string, token sequence or TokenBatch.")
    dims = model_dims(model)
    device = model_device(model)
    if isinstance(inputs, TokenBatch):
        batches = [inputs]
    elif isinstance(inputs, Tensor):
        inputs = token_ids(inputs, dims.d_vocab, what="token ids")
        _check_length(inputs.shape[1], dims.n_ctx)
        valid = torch.ones(inputs.shape, dtype=torch.bool)
        batches = [
            TokenBatch(inputs[i : i + batch_size], valid[i : i + batch_size], prepend_bos)
            for i in range(0, inputs.shape[0], batch_size)
        ]
    elif isinstance(inputs, str) or (isinstance(inputs, Sequence) and isinstance(inputs[0], str)):
        batches = tokenize_prompts(model, prompt_list(inputs), batch_size=batch_size, prepend_bos=prepend_bos, max_length=max_length)
    elif isinstance(inputs, Iterable) and not isinstance(inputs, (bytes, dict)):
        batches = list(inputs)
        for i, b in enumerate(batches):
            if not isinstance(b, TokenBatch):
                raise InvalidArgumentError(
                    f"inputs[{i}] is a {type(b).__name__} ({b!r:.60}); expected strings, a token tensor "
                    "[batch, pos], or TokenBatch objects."
                )
        if not batches:
            raise InvalidArgumentError("No inputs given: the iterable of TokenBatch objects is empty.")
    else:
        raise InvalidArgumentError(
            f"Cannot use {type(inputs).__name__} as input; expected strings, a token tensor or TokenBatch."
        )
    for i, b in enumerate(batches):
        if b.tokens.shape != b.valid.shape or b.tokens.ndim != 2:
            raise InvalidArgumentError(
                f"TokenBatch {i}: tokens {tuple(b.tokens.shape)} and valid {tuple(b.valid.shape)} must be equal 2-D shapes."
            )
        _check_length(b.tokens.shape[1], dims.n_ctx)
        check_vocab(b.tokens, dims.d_vocab, what=f"token ids (batch {i})")
    return [b.to(device) for b in batches]
