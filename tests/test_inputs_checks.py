"""Inputs are checked before any forward pass, with named errors: TokenBatch dtypes, empty and mixed batches,
prompts that are not text, encoders' max_length, the sink position against every sequence, and extra hooks
that never run."""

import re
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import sinklens
from sinklens.errors import InvalidArgumentError, UnsupportedArchitectureError
from sinklens.inputs import TokenBatch, as_batches, tokenize_prompts
from sinklens.options import checked_options, settings_from
from sinklens.streaming import stream
from sinklens.testing import QUIET, transformer_lens_major

pytestmark = pytest.mark.models

T = torch.tensor
TOKENS = T([[0, 5, 6, 7, 9, 11], [0, 8, 9, 1, 1, 1]])
VALID = T([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]).bool()


def raw(tokens, valid, prepend_bos=True, special_tokens=()):
    """A TokenBatch holding tensors of any dtype, as built where no runtime type checker runs (the test
    suite's jaxtyping hook would refuse them in ``__init__``); ``as_batches`` must check them itself."""
    batch = TokenBatch(torch.zeros(tokens.shape, dtype=torch.long), torch.zeros(valid.shape, dtype=torch.bool),
                       prepend_bos, special_tokens)
    batch.tokens, batch.valid = tokens, valid
    return batch


# ---- TokenBatch dtypes, empty and mixed batches -------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.uint8])
def test_a_0_1_integer_valid_mask_means_the_same_as_a_bool_one(tiny_llama, dtype):
    """An int64 mask used to crash inside find_sinks (an IndexError from index_add_), a uint8 one ran with
    ``~valid`` a bitwise not (wrong token ids at the padded positions)."""
    ref = sinklens.find_sinks(tiny_llama, TokenBatch(TOKENS, VALID, True), options=QUIET)
    (batch,) = as_batches(tiny_llama, raw(TOKENS.to(torch.int32), VALID.to(dtype)))
    assert batch.valid.dtype == torch.bool and batch.tokens.dtype == torch.long
    assert batch.valid.tolist() == VALID.tolist() and batch.tokens.tolist() == TOKENS.tolist()
    got = sinklens.find_sinks(tiny_llama, raw(TOKENS, VALID.to(dtype)), options=QUIET)
    assert got.position_token_ids.tolist() == ref.position_token_ids.tolist()
    torch.testing.assert_close(got.received, ref.received, equal_nan=True)


def test_token_batches_of_the_wrong_dtype_are_refused_by_name(tiny_llama):
    with pytest.raises(InvalidArgumentError, match=r"TokenBatch 0: valid must be a bool mask .*got dtype torch.float32"):
        as_batches(tiny_llama, raw(TOKENS, VALID.float()))
    with pytest.raises(InvalidArgumentError, match=r"TokenBatch 0: valid must be a bool mask or 0/1 integers, got 2 at \[1, 0\]"):
        as_batches(tiny_llama, raw(TOKENS, T([[1] * 6, [2, 1, 1, 0, 0, 0]])))
    with pytest.raises(InvalidArgumentError, match=r"TokenBatch 1: tokens must be integer token ids, got dtype torch.float32"):
        sinklens.find_sinks(tiny_llama, [TokenBatch(TOKENS, VALID, True), raw(TOKENS.float(), VALID)],
                            options=QUIET)


def test_empty_token_batches_are_refused_by_name(tiny_llama):
    empty = TokenBatch(torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 4, dtype=torch.bool), True)
    with pytest.raises(InvalidArgumentError, match=re.escape("TokenBatch 0 is empty (tokens of shape (0, 4))")):
        sinklens.find_sinks(tiny_llama, empty, options=QUIET)
    with pytest.raises(InvalidArgumentError, match=re.escape("TokenBatch 1 is empty (tokens of shape (0, 4))")):
        sinklens.measure_variance(tiny_llama, [TokenBatch(TOKENS, VALID, True), empty], options=QUIET)


def test_a_row_without_a_valid_token_is_refused_by_name(tiny_llama):
    """An all-padding row was counted as a sequence (n_sequences 2 for one prompt)."""
    valid = VALID.clone()
    valid[1] = False
    with pytest.raises(InvalidArgumentError, match=re.escape("TokenBatch 1: row 1 has no valid token")):
        sinklens.analyze(tiny_llama, [TokenBatch(TOKENS, VALID, True), TokenBatch(TOKENS, valid, True)], options=QUIET)


def test_an_activation_cache_is_refused_with_what_to_pass(tiny_llama):
    """Its hook names used to be tokenised as prompts (one sequence per cached hook)."""
    tokens = TOKENS[:1]
    _, cache = tiny_llama.run_with_cache(tokens, names_filter=lambda name: name.endswith("hook_pattern"))
    with pytest.raises(InvalidArgumentError, match=r"Cannot use a ActivationCache as input.*Pass the tokens or text"):
        sinklens.find_sinks(tiny_llama, cache, options=QUIET)
    with pytest.raises(InvalidArgumentError, match="Cannot use a dict as input"):
        sinklens.find_sinks(tiny_llama, dict(cache.items()), options=QUIET)


def test_a_min_query_beyond_every_sequence_is_refused(tiny_llama):
    """It returned an empty result with no word; min_query 5 on 6 tokens still counts one query."""
    with pytest.raises(InvalidArgumentError, match=re.escape("min_query=6 leaves no query to count: the longest "
                                                             "sequence has 6 tokens")):
        sinklens.find_sinks(tiny_llama, TokenBatch(TOKENS, VALID, True), min_query=6, options=QUIET)
    result = sinklens.find_sinks(tiny_llama, TokenBatch(TOKENS, VALID, True), min_query=5, options=QUIET)
    assert bool(torch.isfinite(result.received[..., :6]).all())


def test_token_batches_made_differently_are_not_pooled(tiny_llama):
    with_bos = TokenBatch(T([[0, 5, 6, 7]]), T([[True] * 4]), True, ("<s>",))
    without = TokenBatch(T([[5, 6, 7, 8]]), T([[True] * 4]), False, ())
    for order, (a, b) in (([with_bos, without], ("True, special_tokens=('<s>',)", "False, special_tokens=()")),
                          ([without, with_bos], ("False, special_tokens=()", "True, special_tokens=('<s>',)"))):
        with pytest.raises(InvalidArgumentError, match=re.escape(f"TokenBatch 0 has prepend_bos={a} but TokenBatch 1 "
                                                                 f"has prepend_bos={b}")):
            sinklens.find_sinks(tiny_llama, order, options=QUIET)
    other_token = TokenBatch(T([[0, 5, 6, 7]]), T([[True] * 4]), True, ("<bos>",))
    with pytest.raises(InvalidArgumentError, match="special_tokens=\\('<bos>',\\)"):
        as_batches(tiny_llama, [with_bos, other_token])
    assert len(as_batches(tiny_llama, [with_bos, with_bos])) == 2  # made the same way: fine


# ---- prompts ------------------------------------------------------------------------------------------------

def test_any_iterable_of_strings_is_prompts(tiny_llama):
    prompts = ["t5 t6 t7", "t8"]
    (ref,) = as_batches(tiny_llama, prompts, batch_size=2)
    assert ref.tokens.tolist() == [[0, 5, 6, 7], [0, 8, 1, 1]]
    for given in ((p for p in prompts), np.array(prompts), tuple(prompts), iter(prompts)):
        (batch,) = as_batches(tiny_llama, given, batch_size=2)
        assert batch.tokens.tolist() == ref.tokens.tolist() and batch.valid.tolist() == ref.valid.tolist()
    (direct,) = tokenize_prompts(tiny_llama, (p for p in prompts), batch_size=2)
    assert direct.tokens.tolist() == ref.tokens.tolist()
    ran = sinklens.find_sinks(tiny_llama, (p for p in prompts), options=QUIET)
    assert ran.n_sequences == 2


def test_an_empty_prompt_is_named_by_its_index(tiny_llama):
    with pytest.raises(InvalidArgumentError, match=re.escape("prompts[40] ('') tokenises to no tokens")):
        as_batches(tiny_llama, ["t5 t6"] * 40 + [""] + ["t7"])


@pytest.mark.parametrize("prompts, index, bad", [(["t5", "\ud800"], 1, "\ud800"), (["a\udcff"], 0, "a\udcff")])
def test_prompts_with_lone_surrogates_are_refused_by_name(tiny_llama, prompts, index, bad):
    with pytest.raises(InvalidArgumentError, match=re.escape(f"prompts[{index}] ({bad!r}) is not valid Unicode text")):
        as_batches(tiny_llama, prompts)


def test_prompts_with_lone_surrogates_are_refused_on_smollm2(smollm2):
    with pytest.raises(InvalidArgumentError, match=re.escape("prompts[1] ('\\ud800') is not valid Unicode text")):
        tokenize_prompts(smollm2, ["fine", "\ud800"])


@pytest.mark.skipif(transformer_lens_major() < 4, reason="BERT is a TransformerLens 4 zoo family")
def test_an_encoder_max_length_must_leave_room_for_text():
    from support.zoo import zoo_model

    bert = zoo_model("bert")
    for n in (1, 2):
        with pytest.raises(InvalidArgumentError, match=rf"max_length={n} leaves no room for text on this encoder: the "
                                                       r"special tokens it adds \(\[CLS\] … \[SEP\]\) take 2 positions"):
            as_batches(bert, ["t5 t6 t7"], max_length=n)
    (batch,) = as_batches(bert, ["t5 t6 t7"], max_length=3)
    assert batch.tokens.tolist() == [[2, 5, 3]]  # [CLS] t5 [SEP]
    (bare,) = as_batches(bert, ["t5 t6 t7"], max_length=2, prepend_bos=False)  # no special tokens: text only
    assert bare.tokens.tolist() == [[5, 6]]


# ---- the sink position against every sequence, before any forward pass ---------------------------------------

def _counting(options):
    passes = []
    return passes, options.replace(extra_hooks=[("blocks.0.hook_resid_pre", lambda act, hook: passes.append(1))])


@pytest.mark.parametrize("analyzer", ["measure_value_drain", "query_key_locking", "find_massive_activations",
                                      "find_super_neurons", "normalized_disparity"])
def test_a_sink_with_no_later_query_is_refused_before_any_forward(tiny_llama, analyzer):
    """All sequences 2 tokens long (BOS + 1) with sink_position=1: value drain and query-key locking used to
    return all-NaN statistics (no query after the sink) without a word."""
    passes, options = _counting(QUIET.replace(batch_size=1))
    fn = getattr(sinklens, analyzer)
    with pytest.raises(InvalidArgumentError, match=re.escape(
            f"Every sequence is 2 tokens long: {analyzer} compares the sink position (sink_position=1) with later "
            "ones, so it needs at least one sequence of 3 tokens or more")):
        fn(tiny_llama, ["t5", "t6", "t7"], options=options, sink_position=1)
    assert passes == []
    fn(tiny_llama, ["t5", "t6 t7", "t7"], options=QUIET, sink_position=1)  # one later query is enough


def test_value_drain_and_locking_measure_the_one_later_query(tiny_llama):
    drain = sinklens.measure_value_drain(tiny_llama, ["t5", "t6 t7"], options=QUIET, sink_position=1)
    assert bool(torch.isfinite(drain.attn_sink).all())
    locking = sinklens.query_key_locking(tiny_llama, ["t5", "t6 t7"], options=QUIET, sink_position=1)
    assert locking.n_queries == 1 and bool(torch.isfinite(locking.mean_score_sink).all())  # the query after the sink


def test_a_sink_position_beyond_a_sequence_names_it_before_any_forward(tiny_llama):
    """It used to be found by the reducer on the 7th batch, after 6 forward passes, without naming the prompt."""
    passes, options = _counting(QUIET.replace(batch_size=1))
    prompts = ["t5 t6 t7 t8 t9"] * 6 + ["t5"] + ["t5 t6 t7 t8 t9"]
    for analyzer in ("measure_value_drain", "find_massive_activations", "query_key_locking"):
        with pytest.raises(InvalidArgumentError, match=re.escape(
                "sink_position=3 is beyond sequence 6 (counting from 0 across all batches), which has 2 tokens")):
            getattr(sinklens, analyzer)(tiny_llama, prompts, options=options, sink_position=3)
    assert passes == []
    with pytest.raises(InvalidArgumentError, match=re.escape("sink_position=2 is beyond sequence 6")):
        sinklens.find_super_neurons(tiny_llama, prompts, options=QUIET.replace(batch_size=4), sink_position=2)


# ---- extra hooks that never run -------------------------------------------------------------------------------

def test_an_extra_hook_that_never_runs_is_reported(fused_attention_model):
    model = fused_attention_model  # has hook_pattern, never runs it (like fused SDPA)
    batches = as_batches(model, torch.zeros(1, 3, dtype=torch.long))
    options = QUIET.replace(extra_hooks=[("blocks.0.attn.hook_pattern", lambda act, hook: act * 0)])
    with pytest.raises(UnsupportedArchitectureError, match=re.escape("extra_hooks on ['blocks.0.attn.hook_pattern'] never ran")):
        stream(model, batches, [], options=options)


def test_an_intervention_on_a_hook_the_model_skips_is_not_silently_ignored():
    from support.zoo import zoo_model

    if transformer_lens_major() < 4:
        model, hook = zoo_model("llama"), "blocks.0.attn.hook_result"  # needs cfg.use_attn_result
    else:
        model, hook = zoo_model("neox"), "blocks.0.attn.hook_rot_q"  # listed by the bridge, never run
    fired = []

    def kill(act, hook):
        fired.append(1)
        return act * 0

    with pytest.raises(UnsupportedArchitectureError, match=re.escape(f"extra_hooks on [{hook!r}] never ran")):
        sinklens.find_sinks(model, ["t5 t6 t7 t8 t9", "t10 t11 t12"], options=QUIET.replace(extra_hooks=[(hook, kill)]))
    assert fired == []
    sinklens.find_sinks(model, ["t5 t6 t7"], options=QUIET.replace(extra_hooks=[("blocks.0.hook_resid_pre", kill)]))


def test_analyze_checks_its_sink_position_before_any_forward(tiny_llama):
    """``analyze`` tokenizes once for all its reducers and used to check only that some sequence had 2 tokens: a
    sink position past a prompt failed inside a reducer after earlier batches had run, a sink with no later query
    gave NaN value-drain and locking statistics."""
    passes, options = _counting(QUIET.replace(batch_size=1))
    prompts = ["t5 t6 t7 t8 t9"] * 3 + ["t5"]
    with pytest.raises(InvalidArgumentError, match=re.escape("sink_position=3 is beyond sequence 3 (counting from 0")):
        sinklens.analyze(tiny_llama, prompts, sink_position=3, options=options)
    with pytest.raises(InvalidArgumentError, match=re.escape(
            "Every sequence is 2 tokens long: analyze compares the sink position (sink_position=1) with later ones")):
        sinklens.analyze(tiny_llama, ["t5", "t6", "t7"], sink_position=1, options=options)
    assert passes == []


# ---- RunOptions: checked when it is built, not inside the first forward pass ------------------------------------

def unchecked_options(**fields):
    """``RunOptions(**fields)`` as built where no runtime type checker runs (the suite's jaxtyping hook refuses
    wrong types in ``__init__``): the fields are set, then ``__post_init__`` must check them itself."""
    options = sinklens.RunOptions()
    for name, value in fields.items():
        object.__setattr__(options, name, value)
    options.__post_init__()
    return options


@pytest.mark.parametrize("extra_hooks,message", [
    ({"blocks.0.hook_resid_pre": print}, "RunOptions.extra_hooks must be a list of (hook_name, fn) pairs, got a dict"),
    ([("blocks.0.hook_resid_pre",)], "RunOptions.extra_hooks[0] must be a (hook_name, fn) pair, got ('blocks.0.hook_resid_pre',)"),
    ([("blocks.0.hook_resid_pre", "zero")], "RunOptions.extra_hooks[0] must be a (hook_name, fn) pair with a string name and a callable fn"),
    (print, "RunOptions.extra_hooks must be a list of (hook_name, fn) pairs, got builtin_function_or_method"),
])
def test_run_options_refuse_extra_hooks_that_are_not_pairs(extra_hooks, message):
    """A dict used to fail inside the first forward pass with "too many values to unpack", a non-callable fn
    only when the hook fired."""
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        unchecked_options(extra_hooks=extra_hooks)


@pytest.mark.parametrize("field", ["progress", "prepend_bos"])
def test_run_options_refuse_flags_that_are_not_booleans(field):
    """``progress="no"`` used to be taken as true (the bar showed)."""
    with pytest.raises(InvalidArgumentError, match=re.escape(f"RunOptions.{field} must be True or False, got 'no' (str)")):
        unchecked_options(**{field: "no"})
    assert getattr(unchecked_options(**{field: np.bool_(False)}), field) is False


def test_settings_from_replaces_the_given_fields_and_options_must_be_run_options():
    @dataclass(frozen=True)
    class Demo:
        threshold: float = 0.3
        top_k: int = 5

    assert settings_from(Demo, None, {"top_k": 2}, "demo") == Demo(0.3, 2)
    assert settings_from(Demo, None, {}, "demo", defaults={"top_k": 9}) == Demo(0.3, 9)
    assert settings_from(Demo, Demo(0.5), {}, "demo", defaults={"top_k": 9}) == Demo(0.5, 5)  # defaults: without settings
    with pytest.raises(InvalidArgumentError, match=re.escape(
            "find_sinks(options=...) takes a sinklens.RunOptions, got dict {'batch_size': 2}; "
            "pass options=RunOptions(**{'batch_size': 2}).")):
        checked_options({"batch_size": 2}, "find_sinks")


def test_prompts_from_a_pipe_or_a_device_are_refused_without_reading(tmp_path, capsys):
    """``--prompts`` on a FIFO would block forever, on ``/dev/urandom`` read until memory runs out."""
    import os
    import threading

    from sinklens.cli import main
    from sinklens.errors import InvalidArgumentError
    from sinklens.validate import text_lines

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    raised = []

    def read() -> None:
        try:
            text_lines(fifo, what="--prompts")
        except InvalidArgumentError as err:
            raised.append(str(err))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():  # blocked in open(): give it a writer and an end of file before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=10)
    assert raised and "is not a regular file (a pipe or a device)" in raised[0]
    for path in (fifo, "/dev/urandom"):
        assert main(["analyze", "--prompts", str(path), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert "is not a regular file" in err and str(path) in err
