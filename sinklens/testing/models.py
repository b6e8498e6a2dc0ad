"""Tiny, seeded TransformerLens models for tests, doctests and tutorials: :func:`tiny_model` is a
``TransformerBridge`` under TransformerLens 4.x and a ``HookedTransformer`` under 3.x, with the same hook names."""

from __future__ import annotations

import atexit
import contextlib
import functools
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch

from sinklens.sinklm.config import ModelConfig
from sinklens.sinklm.init import sinklm_at_init

Arch = Literal["llama", "gpt2"]


@functools.cache
def transformer_lens_major() -> int:
    """Major version of the installed TransformerLens (3 or 4)."""
    from importlib.metadata import version

    return int(version("transformer-lens").split(".")[0])


@functools.cache
def tokenizer_root() -> Path:
    """The process-wide folder holding the word tokenizers (TransformerLens reloads a tokenizer from its
    ``name_or_path``, so it must exist on disk); created on first use, removed at exit."""
    root = tempfile.TemporaryDirectory(prefix="sinklens-testing-")
    atexit.register(root.cleanup)
    return Path(root.name)


def word_tokenizer(d_vocab: int) -> Any:
    """A Hugging Face fast tokenizer: ``<s>`` = 0 (put before each text), ``</s>`` = 1, word ``t{i}`` = ``i`` (files
    under :func:`tokenizer_root`)."""
    from transformers import AutoTokenizer

    folder = tokenizer_root() / f"wordtok-{d_vocab}"
    if not (folder / "tokenizer.json").exists():
        from tokenizers import Tokenizer, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        vocab = {"<s>": 0, "</s>": 1} | {f"t{i}": i for i in range(2, d_vocab)}
        core = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
        core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
        tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="</s>",
                                      unk_token="</s>")
        tok.save_pretrained(str(folder))
    return AutoTokenizer.from_pretrained(str(folder))


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore the global RNGs (torch CPU, Python ``random``, numpy) after the block."""
    import numpy as np

    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def tiny_model(arch: Arch = "llama", *, n_layers: int = 2, d_model: int = 16, n_heads: int = 4,
               n_kv_heads: int | None = None, d_mlp: int = 32, n_ctx: int = 64, d_vocab: int = 64,
               seed: int = 0) -> Any:
    """A randomly initialised decoder small enough for a unit test. Its weights depend only on
    ``seed``; the global RNG state (torch, ``random``, numpy) is the same before and after the call.

    Examples:
        >>> model = tiny_model(n_layers=2, d_model=16)
        >>> model.cfg.n_layers, "blocks.1.attn.hook_pattern" in model.hook_dict
        (2, True)
    """
    if d_model % n_heads:
        raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}.")
    if arch not in ("llama", "gpt2"):
        raise ValueError(f"Unknown arch {arch!r}; expected 'llama' or 'gpt2'.")
    n_kv_heads = n_kv_heads or n_heads
    with preserved_rng():
        torch.manual_seed(seed)
        if transformer_lens_major() < 4:
            from transformer_lens import HookedTransformer, HookedTransformerConfig

            common = dict(n_layers=n_layers, d_model=d_model, n_heads=n_heads, d_head=d_model // n_heads, d_mlp=d_mlp,
                          n_ctx=n_ctx, d_vocab=d_vocab, seed=seed, default_prepend_bos=True)
            if arch == "llama":
                cfg = HookedTransformerConfig(
                    **common, act_fn="silu", normalization_type="RMS", positional_embedding_type="rotary",
                    gated_mlp=True, n_key_value_heads=n_kv_heads if n_kv_heads != n_heads else None)
            else:
                cfg = HookedTransformerConfig(**common, act_fn="gelu_new", normalization_type="LN")
            return HookedTransformer(cfg, tokenizer=word_tokenizer(d_vocab)).eval()
        from transformer_lens.model_bridge import TransformerBridge
        from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

        if arch == "llama":
            hf = LlamaForCausalLM(LlamaConfig(
                vocab_size=d_vocab, hidden_size=d_model, intermediate_size=d_mlp, num_hidden_layers=n_layers,
                num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, max_position_embeddings=n_ctx,
                bos_token_id=0, eos_token_id=1, pad_token_id=1, tie_word_embeddings=False, attn_implementation="eager"))
        else:
            hf = GPT2LMHeadModel(GPT2Config(
                vocab_size=d_vocab, n_embd=d_model, n_inner=d_mlp, n_layer=n_layers, n_head=n_heads, n_positions=n_ctx,
                bos_token_id=0, eos_token_id=1, attn_implementation="eager"))
        return TransformerBridge.boot_transformers(f"sinklens-tiny-{arch}", hf_model=hf.eval(),
                                                   tokenizer=word_tokenizer(d_vocab), device="cpu")


def tiny_sinklm(variant: str = "baseline", *, family: Literal["llama", "gpt2"] = "llama", seed: int = 0,
                **variant_options: Any) -> Any:
    """A step-0 :class:`~sinklens.sinklm.model.SinkLM` (2 layers, d_model 32, context 16, vocabulary 512) with a
    trainer attention variant, built as ``sinklens train`` builds it (``headwise_rms`` gains drawn from [0.5, 2])."""
    cfg = ModelConfig.from_dict(dict(family=family, n_layers=2, d_model=32, n_heads=4, d_mlp=64, n_ctx=16, d_vocab=512,
                                     variant=variant, variant_options=variant_options))
    model = sinklm_at_init(cfg, seed)
    if variant == "headwise_rms":
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for gain in (block.attn.variant.gain for block in model.blocks):
                gain.copy_(torch.rand(gain.shape, generator=gen) * 1.5 + 0.5)
    return model
