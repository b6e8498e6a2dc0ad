"""Tokenizers for training on text: byte-level, or a BPE trained with ``tokenizers``, both as
``PreTrainedTokenizerFast`` with ``<|endoftext|>`` as BOS, EOS and pad (GPT-2 style).

Examples:
    >>> tok = byte_tokenizer()
    >>> tok("hé", add_special_tokens=False)["input_ids"], tok.bos_token_id, len(tok)
    ([104, 195, 169], 256, 257)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

SPECIAL = "<|endoftext|>"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]  # mapped past 255, in byte order
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


def _wrap(core: Any) -> Any:
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=SPECIAL, eos_token=SPECIAL, pad_token=SPECIAL,
                                   unk_token=None)


def byte_tokenizer() -> Any:
    """Byte-level tokenizer: byte ``b`` is id ``b``; ``<|endoftext|>`` is id 256 (vocabulary of 257)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    vocab[SPECIAL] = 256
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([SPECIAL])
    return _wrap(core)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Any:
    """Train a byte-level BPE of ``vocab_size`` tokens (``<|endoftext|>`` is id 0) on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    if vocab_size < 257 + 1:
        raise ValueError(f"A byte-level BPE needs vocab_size >= 258 (256 bytes + <|endoftext|> + merges), got {vocab_size}.")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[SPECIAL], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(texts, trainer=trainer)
    return _wrap(core)


def load_tokenizer(path: str) -> Any:
    """Load a tokenizer saved with ``save_pretrained`` (a run's ``tokenizer/`` folder)."""
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(path)
