"""The architecture zoo: tiny, seeded models of every family sinklens claims to support.

Each family is built from its Hugging Face config with random weights, saved with a word-level tokenizer and
loaded back through :func:`sinklens.load_model` as a user's model folder would be; :func:`zoo_hf_model` gives
the plain Hugging Face model of that folder as an independent reference. Under TransformerLens 3.x the
families ``HookedTransformerConfig`` can express are built as ``HookedTransformer`` s; the others raise
:class:`FamilyUnavailableError`.

=========  ===================================================================  =========
family     what it exercises                                                    TL 3.x
=========  ===================================================================  =========
llama      RMSNorm, rotary, SwiGLU, grouped-query attention (2 KV heads)         yes
gemma2     post-attention/post-MLP norms, alternating sliding/full layers,       yes
           soft-capping
gemma3     post-norms, QK-norm, sliding/full layers                              no
mistral    sliding window on every layer                                         yes
qwen2      QKV biases, GQA                                                       yes
qwen3      QK-norm, GQA                                                          no
gpt2       LayerNorm, learned positions, biases                                  yes
neox       parallel attention and MLP (Pythia)                                   yes
bert       bidirectional encoder, ``[CLS] … [SEP]``                              no
gptoss     learned per-head sink logits, mixture-of-experts MLP, sliding layers  no
=========  ===================================================================  =========

Sliding-window families use ``window`` (default 4) tokens.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import torch

from sinklens.testing.models import preserved_rng, tokenizer_root, transformer_lens_major, word_tokenizer

Family = Literal["llama", "gemma2", "gemma3", "mistral", "qwen2", "qwen3", "gpt2", "neox", "bert", "gptoss"]

#: Every family of the zoo, in the order tests parametrize them.
FAMILIES: tuple[str, ...] = ("llama", "gemma2", "gemma3", "mistral", "qwen2", "qwen3", "gpt2", "neox", "bert", "gptoss")
#: Families with a norm after attention and after the MLP, before the residual add.
POST_NORM_FAMILIES: tuple[str, ...] = ("gemma2", "gemma3")
#: Families with sliding-window layers (``window`` tokens).
SLIDING_FAMILIES: tuple[str, ...] = ("gemma2", "gemma3", "mistral", "gptoss")
#: Encoders (bidirectional attention).
ENCODER_FAMILIES: tuple[str, ...] = ("bert",)
#: Families whose MLP is a mixture of experts (no single ``W_out`` per layer).
MOE_FAMILIES: tuple[str, ...] = ("gptoss",)
#: Families that TransformerLens 3.x ``HookedTransformerConfig`` can express.
TL3_FAMILIES: tuple[str, ...] = ("llama", "gemma2", "mistral", "qwen2", "gpt2", "neox")


class FamilyUnavailableError(RuntimeError):
    """The family cannot be built with the installed TransformerLens (tests skip it)."""


def _bert_tokenizer_dir(d_vocab: int) -> str:
    """A word-level BERT-style tokenizer: ``[PAD]`` 0, ``[UNK]`` 1, ``[CLS]`` 2, ``[SEP]`` 3, ``[MASK]`` 4,
    word ``t{i}`` = ``i`` for ``5 <= i < d_vocab``; encoding adds ``[CLS] … [SEP]`` like BERT's."""
    folder = tokenizer_root() / f"berttok-{d_vocab}"
    if not (folder / "tokenizer.json").exists():
        from tokenizers import Tokenizer, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        special = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4}
        vocab = special | {f"t{i}": i for i in range(5, d_vocab)}
        core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        core.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
        )
        tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                      sep_token="[SEP]", mask_token="[MASK]")
        tok.save_pretrained(str(folder))
    return str(folder)


def bert_tokenizer(d_vocab: int = 64) -> Any:
    """The zoo's BERT-style tokenizer (see :func:`_bert_tokenizer_dir`)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_bert_tokenizer_dir(d_vocab))


def _hf_config(family: str, *, n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, d_mlp: int, n_ctx: int,
               d_vocab: int, window: int) -> Any:
    import transformers as T

    d_head = d_model // n_heads
    common = dict(vocab_size=d_vocab, hidden_size=d_model, intermediate_size=d_mlp, num_hidden_layers=n_layers,
                  num_attention_heads=n_heads, max_position_embeddings=n_ctx)
    decoder_ids = dict(bos_token_id=0, eos_token_id=1, pad_token_id=1)
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    if family == "llama":
        return T.LlamaConfig(**common, **decoder_ids, num_key_value_heads=n_kv_heads, tie_word_embeddings=False)
    if family == "gemma2":
        return T.Gemma2Config(**common, **decoder_ids, num_key_value_heads=n_kv_heads, head_dim=d_head,
                              sliding_window=window, layer_types=alternating, query_pre_attn_scalar=d_head)
    if family == "gemma3":
        return T.Gemma3TextConfig(**common, **decoder_ids, num_key_value_heads=n_kv_heads, head_dim=d_head,
                                  sliding_window=window, layer_types=alternating, query_pre_attn_scalar=d_head)
    if family == "mistral":
        return T.MistralConfig(**common, **decoder_ids, num_key_value_heads=n_kv_heads, sliding_window=window,
                               tie_word_embeddings=False)
    if family == "qwen2":
        return T.Qwen2Config(**common, **decoder_ids, num_key_value_heads=n_kv_heads, tie_word_embeddings=False)
    if family == "qwen3":
        return T.Qwen3Config(**common, **decoder_ids, num_key_value_heads=n_kv_heads, head_dim=d_head,
                             tie_word_embeddings=False)
    if family == "gpt2":
        return T.GPT2Config(vocab_size=d_vocab, n_embd=d_model, n_inner=d_mlp, n_layer=n_layers, n_head=n_heads,
                            n_positions=n_ctx, bos_token_id=0, eos_token_id=1)
    if family == "neox":
        return T.GPTNeoXConfig(**common, **decoder_ids, use_parallel_residual=True)
    if family == "bert":
        return T.BertConfig(**common, pad_token_id=0)
    if family == "gptoss":
        return T.GptOssConfig(**common, **decoder_ids, num_key_value_heads=n_kv_heads, head_dim=d_head,
                              num_local_experts=4, num_experts_per_tok=2, sliding_window=window,
                              layer_types=alternating)
    raise ValueError(f"Unknown zoo family {family!r}; expected one of {list(FAMILIES)}.")


def _hf_class(family: str) -> Any:
    import transformers as T

    return {
        "llama": T.LlamaForCausalLM, "gemma2": T.Gemma2ForCausalLM, "gemma3": T.Gemma3ForCausalLM,
        "mistral": T.MistralForCausalLM, "qwen2": T.Qwen2ForCausalLM, "qwen3": T.Qwen3ForCausalLM,
        "gpt2": T.GPT2LMHeadModel, "neox": T.GPTNeoXForCausalLM, "bert": T.BertForMaskedLM,
        "gptoss": T.GptOssForCausalLM,
    }[family]


def zoo_dir(family: str, *, n_layers: int = 2, d_model: int = 16, n_heads: int = 4, n_kv_heads: int = 2,
            d_mlp: int = 32, n_ctx: int = 64, d_vocab: int = 64, window: int = 4, seed: int = 0) -> Path:
    """The folder holding the family's seeded Hugging Face model and tokenizer (written once per process)."""
    if family not in FAMILIES:
        raise ValueError(f"Unknown zoo family {family!r}; expected one of {list(FAMILIES)}.")
    sizes = dict(n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_mlp=d_mlp,
                 n_ctx=n_ctx, d_vocab=d_vocab, window=window)
    key = hashlib.sha1(json.dumps([family, seed, sizes], sort_keys=True).encode()).hexdigest()[:12]
    folder = tokenizer_root() / f"zoo-{family}-{key}"
    if not (folder / "config.json").exists():
        config = _hf_config(family, **sizes)
        config._attn_implementation = "eager"
        with preserved_rng():
            torch.manual_seed(seed)
            hf = _hf_class(family)(config)
        hf.save_pretrained(str(folder))
        tok = bert_tokenizer(d_vocab) if family in ENCODER_FAMILIES else word_tokenizer(d_vocab)
        tok.save_pretrained(str(folder))
    return folder


def zoo_hf_model(family: str, **sizes: Any) -> Any:
    """The plain Hugging Face model (eager attention, eval mode) of :func:`zoo_model`'s folder: an
    independent reference that shares no code with TransformerLens or sinklens."""
    folder = zoo_dir(family, **sizes)
    return _hf_class(family).from_pretrained(str(folder), attn_implementation="eager").eval()


def zoo_model(family: str, **sizes: Any) -> Any:
    """A tiny seeded model of ``family`` (:data:`FAMILIES`) loaded through :func:`sinklens.load_model`, a fresh
    copy each call. ``sizes``: ``n_layers`` (2), ``d_model`` (16), ``n_heads`` (4), ``n_kv_heads`` (2),
    ``d_mlp`` (32), ``n_ctx`` (64), ``d_vocab`` (64), ``window`` (4), ``seed`` (0). Under TransformerLens 3.x a
    family outside :data:`TL3_FAMILIES` raises :class:`FamilyUnavailableError`.

    Examples:
        >>> model = zoo_model("gemma2")
        >>> "blocks.0.ln2_post.hook_scale" in model.hook_dict
        True
    """
    if transformer_lens_major() < 4:
        return _zoo_hooked_transformer(family, **sizes)
    from sinklens.loading import load_model

    model = load_model(str(zoo_dir(family, **sizes)), device="cpu")
    if family in _MODEL_TYPE_TOKENIZER:
        # transformers 5 loads the model type's own tokenizer class whatever tokenizer_config.json says
        # (Qwen2Tokenizer's byte-level BPE drops every zoo word), so the zoo's word tokenizer is set here.
        model.tokenizer = word_tokenizer(sizes.get("d_vocab", 64))
    return model


#: Families whose folder's tokenizer ``AutoTokenizer`` replaces by the model type's own class.
_MODEL_TYPE_TOKENIZER: tuple[str, ...] = ("qwen2",)


def _zoo_hooked_transformer(family: str, *, n_layers: int = 2, d_model: int = 16, n_heads: int = 4,
                            n_kv_heads: int = 2, d_mlp: int = 32, n_ctx: int = 64, d_vocab: int = 64,
                            window: int = 4, seed: int = 0) -> Any:
    if family not in TL3_FAMILIES:
        raise FamilyUnavailableError(f"TransformerLens 3.x cannot build the {family!r} family from a config.")
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    common = dict(n_layers=n_layers, d_model=d_model, n_heads=n_heads, d_head=d_model // n_heads, d_mlp=d_mlp,
                  n_ctx=n_ctx, d_vocab=d_vocab, seed=seed, default_prepend_bos=True)
    llama_like = dict(act_fn="silu", normalization_type="RMS", positional_embedding_type="rotary", gated_mlp=True,
                      n_key_value_heads=n_kv_heads)
    if family in ("llama", "qwen2"):
        cfg = HookedTransformerConfig(**common, **llama_like)
    elif family == "mistral":
        cfg = HookedTransformerConfig(**common, **llama_like, use_local_attn=True, window_size=window,
                                      attn_types=["local"] * n_layers)
    elif family == "gemma2":
        cfg = HookedTransformerConfig(
            **common, act_fn="gelu_pytorch_tanh", normalization_type="RMS", positional_embedding_type="rotary",
            gated_mlp=True, n_key_value_heads=n_kv_heads, use_normalization_before_and_after=True,
            use_local_attn=True, window_size=window,
            attn_types=["local" if i % 2 == 0 else "global" for i in range(n_layers)],
            attn_scores_soft_cap=50.0, output_logits_soft_cap=30.0,
        )
    elif family == "gpt2":
        cfg = HookedTransformerConfig(**common, act_fn="gelu_new", normalization_type="LN")
    else:  # neox
        cfg = HookedTransformerConfig(**common, act_fn="gelu", normalization_type="LN", positional_embedding_type="rotary",
                                      rotary_dim=d_model // n_heads, parallel_attn_mlp=True)
    with preserved_rng():
        torch.manual_seed(seed)
        model = HookedTransformer(cfg, tokenizer=word_tokenizer(d_vocab))
        if family == "qwen2":  # QKV biases (HookedTransformer initialises them to zero)
            with torch.no_grad():
                for block in model.blocks:
                    for bias in (block.attn.b_Q, block.attn._b_K, block.attn._b_V):
                        bias.normal_(std=0.1)
    return model.eval()
