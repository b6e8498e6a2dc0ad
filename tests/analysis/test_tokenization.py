"""Tokenization that respects the model: a real BOS for decoders, the tokenizer's own [CLS] … [SEP] for
encoders, never an [UNK] stand-in; results say what position 0 is and name the token at sink positions."""

import pytest

from sinklens.analysis.report import analyze
from sinklens.analysis.sinks import find_sinks
from sinklens.inputs import as_batches
from sinklens.testing import QUIET, transformer_lens_major
from support.zoo import bert_tokenizer, zoo_model

pytestmark = [
    pytest.mark.models,
    pytest.mark.skipif(transformer_lens_major() < 4, reason="BERT is a TransformerLens 4 zoo family"),
]

PROMPTS = ["t5 t6 t7 t8 t9 t10", "t11 t12", "t13 t14 t15 t16"]
PAD, UNK, CLS, SEP = 0, 1, 2, 3


def test_encoder_gets_cls_and_sep_the_tokenizers_own_way():
    model = zoo_model("bert")
    (batch,) = as_batches(model, PROMPTS, batch_size=8)
    own = bert_tokenizer(64)  # the tokenizer as saved, before any bridge rebuilt it
    for i, prompt in enumerate(PROMPTS):
        real = batch.tokens[i, batch.valid[i]].tolist()
        assert real == own(prompt, add_special_tokens=True)["input_ids"]
        assert real[0] == CLS and real[-1] == SEP and UNK not in real
    assert batch.special_tokens == ("[CLS]", "[SEP]")
    (unknown,) = as_batches(model, ["t5 qwerty t6 zzz"])  # words out of the vocabulary become [UNK] ...
    assert unknown.tokens[0].tolist() == [CLS, 5, UNK, 6, UNK, SEP]
    assert unknown.special_tokens == ("[CLS]", "[SEP]")  # ... which stand for text: not "added"
    (short,) = as_batches(model, PROMPTS[:1], max_length=4)
    assert short.tokens[0].tolist() == [CLS, 5, 6, SEP]  # truncation keeps the final [SEP]
    (bare,) = as_batches(model, PROMPTS[:1], prepend_bos=False)
    assert bare.tokens[0].tolist() == [5, 6, 7, 8, 9, 10] and bare.special_tokens == ()


def test_results_name_position_0_and_sink_tokens():
    bert = zoo_model("bert")
    sinks = find_sinks(bert, PROMPTS, options=QUIET)
    assert sinks.token_at(0) == "[CLS]"
    assert sinks.token_at(1) is None  # different tokens in different sequences
    assert "[CLS]" in sinks.describe_start() and "BOS" not in sinks.describe_start()
    data = sinks.to_dict()
    assert data["special_tokens"] == ["[CLS]", "[SEP]"] and data["position_tokens"]["0"] == "[CLS]"
    report = analyze(bert, PROMPTS, abs_threshold=None, rel_threshold=3.0, options=QUIET)
    text = report.summary(timing=False)
    assert "BOS prepended" not in text and "position 0 is '[CLS]'" in text

    llama = zoo_model("llama")
    sinks = find_sinks(llama, PROMPTS, options=QUIET)
    assert sinks.token_at(0) == "<s>" and sinks.special_tokens == ("<s>",)
    bare = find_sinks(llama, PROMPTS, options=QUIET.replace(prepend_bos=False))
    assert bare.special_tokens == () and "no special token" in bare.describe_start()
