"""Inputs (padding, BOS, lengths) and the streaming loop's guarantees (errors, hook hygiene)."""

import pytest
import torch

import sinklens
from sinklens.errors import InvalidArgumentError, UnsupportedArchitectureError
from sinklens.inputs import as_batches, random_token_batches, tokenize_prompts
from sinklens.prompts import stdlib_text_prompts
from sinklens.streaming import BatchFold, Reducer, merge_max, merge_sum, stream
from sinklens.testing import QUIET
from support.checks import TINY_PROMPTS, attached_hook_count


pytestmark = pytest.mark.models


def test_prompts_are_right_padded_with_bos_first(tiny_llama):
    (batch,) = as_batches(tiny_llama, ["t5 t6 t7", "t8"], batch_size=2)
    assert batch.tokens.tolist() == [[0, 5, 6, 7], [0, 8, 1, 1]]
    assert batch.valid.tolist() == [[True] * 4, [True, True, False, False]]
    assert batch.lengths.tolist() == [4, 2] and batch.prepend_bos
    (no_bos,) = as_batches(tiny_llama, ["t5 t6 t7"], prepend_bos=False)
    assert no_bos.tokens.tolist() == [[5, 6, 7]] and not no_bos.prepend_bos


def test_sequences_longer_than_the_context_are_refused_or_truncated(tiny_llama):
    long_prompt = " ".join(f"t{2 + i % 60}" for i in range(80))  # 81 tokens with BOS, n_ctx is 64
    with pytest.raises(InvalidArgumentError, match="81 tokens.*64"):
        as_batches(tiny_llama, [long_prompt])
    with pytest.raises(InvalidArgumentError):
        sinklens.find_sinks(tiny_llama, [long_prompt], options=QUIET)
    with pytest.raises(InvalidArgumentError):
        as_batches(tiny_llama, torch.zeros(2, 65, dtype=torch.long))
    with pytest.raises(InvalidArgumentError):
        random_token_batches(tiny_llama, seq_len=65)
    (batch,) = tokenize_prompts(tiny_llama, [long_prompt], max_length=64)
    assert batch.tokens.shape == (1, 64)


def test_max_length_cuts_every_form_of_input_alike(tiny_llama):
    """``max_length`` keeps the first tokens of text, token tensors and TokenBatches (left-padded ones too),
    so a tensor longer than the context runs once it is cut, and the analysis equals one of the cut tokens."""
    tokens = torch.arange(2, 2 + 2 * 70).remainder(60).add(2).reshape(2, 70)  # 70 > n_ctx = 64
    (cut,) = as_batches(tiny_llama, tokens, max_length=8)
    assert cut.tokens.tolist() == tokens[:, :8].tolist() and bool(cut.valid.all())
    left = sinklens.TokenBatch(torch.tensor([[1, 1, 7, 8, 9, 10], [3, 4, 5, 6, 7, 8]]),
                               torch.tensor([[False, False, True, True, True, True], [True] * 6]), False)
    (cut_left,) = as_batches(tiny_llama, left, max_length=3)
    assert cut_left.tokens.tolist() == [[7, 8, 9], [3, 4, 5]] and bool(cut_left.valid.all())
    (text,) = as_batches(tiny_llama, ["t5 t6 t7 t8 t9"], max_length=3)
    assert text.tokens.tolist() == [[0, 5, 6]]
    options = QUIET.replace(max_length=8)
    assert torch.equal(sinklens.find_sinks(tiny_llama, tokens, options=options).received,
                       sinklens.find_sinks(tiny_llama, tokens[:, :8].clone(), options=QUIET).received)


@pytest.mark.parametrize("analyzer", ["find_sinks", "measure_variance", "find_massive_activations", "find_super_neurons",
                                      "measure_value_drain", "normalized_disparity", "query_key_locking"])
def test_an_analysis_of_sequences_without_a_later_position_is_refused_by_name(tiny_llama, analyzer):
    """Every analyzer compares the sink with later positions: 1-token sequences would give empty statistics
    whose exports fail later (``SinkResult.to_dict`` named "0..-1"), so the call itself refuses them."""
    with pytest.raises(ValueError, match=f"Every sequence is 1 token long: {analyzer} compares"):
        getattr(sinklens, analyzer)(tiny_llama, ["t5", "t6"], options=QUIET.replace(prepend_bos=False))
    getattr(sinklens, analyzer)(tiny_llama, ["t5", "t6 t7"], options=QUIET.replace(prepend_bos=False))  # one is enough


def test_bad_inputs_are_named(tiny_llama):
    with pytest.raises(ValueError, match="No prompts"):
        as_batches(tiny_llama, [])
    with pytest.raises(ValueError, match="integer tensor"):
        as_batches(tiny_llama, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="batch_size"):
        as_batches(tiny_llama, ["t3"], batch_size=0)


def test_random_tokens_are_seeded_and_bos_optional(tiny_llama):
    a = random_token_batches(tiny_llama, n_sequences=4, seq_len=8, batch_size=2, seed=3)
    b = random_token_batches(tiny_llama, n_sequences=4, seq_len=8, batch_size=2, seed=3)
    assert len(a) == 2 and all(torch.equal(x.tokens, y.tokens) for x, y in zip(a, b))
    with_bos = random_token_batches(tiny_llama, n_sequences=4, seq_len=8, prepend_bos=True)
    assert (with_bos[0].tokens[:, 0] == 0).all()


def test_stdlib_text_is_real_prose():
    prompts = stdlib_text_prompts(4)
    assert len(prompts) == 4 and all(len(p.split()) > 20 for p in prompts)
    assert prompts == stdlib_text_prompts(4)


def test_stdlib_text_refuses_more_prompts_than_the_library_holds():
    """``--stdlib-text 5000`` ran on the 941 there are (on CPython 3.11), and nothing said so."""
    import re

    every = stdlib_text_prompts(None)
    assert len(every) > 100 and every[:4] == stdlib_text_prompts(4)
    assert stdlib_text_prompts(len(every)) == every
    with pytest.raises(InvalidArgumentError, match=re.escape(f"n_prompts {len(every) + 1} asks for more docstrings "
                                                             f"than this Python's standard library holds: {len(every)} ")):
        stdlib_text_prompts(len(every) + 1)


class _Raises(Reducer):
    def reset(self):
        pass

    def fwd_hooks(self, batch):
        def boom(act, hook):
            raise RuntimeError("boom inside a hook")

        return BatchFold([("blocks.1.attn.hook_pattern", boom)])

    def result(self):
        return None


def test_a_hook_that_raises_leaves_no_hook_behind(tiny_llama):
    with pytest.raises(RuntimeError, match="boom"):
        stream(tiny_llama, as_batches(tiny_llama, ["t3 t4"]), [_Raises()], options=QUIET)
    assert attached_hook_count(tiny_llama) == 0


class _Counts(Reducer):
    """Counts the sequences it sees: a user's reducer, with or without its ``statistics`` declared."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.n = 0

    def fwd_hooks(self, batch):
        return BatchFold([])

    def end_batch(self, batch, fold):
        self.n += int(batch.tokens.shape[0])

    def result(self):
        return self.n


class _DeclaredCounts(_Counts):
    statistics = ("n",)


def test_merging_a_reducer_that_declares_no_statistics_is_refused(tiny_llama):
    """The default merge() merged nothing for such a reducer: a.merge(b) kept a's 2 sequences and lost b's 3."""
    a, b = _Counts(), _Counts()
    stream(tiny_llama, as_batches(tiny_llama, ["t3 t4", "t5 t6"]), [a], options=QUIET)
    stream(tiny_llama, as_batches(tiny_llama, ["t3", "t4 t5", "t6"]), [b], options=QUIET)
    with pytest.raises(NotImplementedError, match=r"_Counts does not declare its statistics \(the class attribute"):
        a.merge(b)
    assert a.result() == 2
    declared, other = _DeclaredCounts(), _DeclaredCounts()
    stream(tiny_llama, as_batches(tiny_llama, ["t3 t4", "t5 t6"]), [declared], options=QUIET)
    stream(tiny_llama, as_batches(tiny_llama, ["t3", "t4 t5", "t6"]), [other], options=QUIET)
    declared.merge(other)
    assert declared.result() == 5


def test_unknown_hook_names_are_caught_before_the_forward(tiny_llama):
    with pytest.raises(InvalidArgumentError, match="did you mean 'blocks.0.hook_resid_pre'"):
        stream(tiny_llama, as_batches(tiny_llama, ["t3"]), [],
               options=QUIET.replace(extra_hooks=[("blocks.0.hook_resid_pr", lambda a, hook: None)]))


class _NeverFires(_Raises):
    def fwd_hooks(self, batch):
        return BatchFold([("blocks.0.attn.hook_pattern", lambda act, hook: None)])


def test_a_hook_that_never_runs_is_reported(fused_attention_model):
    model = fused_attention_model  # has hook_pattern, never runs it (like fused SDPA)
    batches = as_batches(model, torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(UnsupportedArchitectureError, match="never ran"):
        stream(model, batches, [_NeverFires()], options=QUIET)
    assert attached_hook_count(model) == 0


def test_reset_makes_a_reducer_reusable(tiny_llama):
    from sinklens.analysis.disparity import MassiveActivationsReducer
    from sinklens.analysis.neurons import SuperNeuronReducer
    from sinklens.analysis.normalized_disparity import NormalizedDisparityReducer
    from sinklens.analysis.qk_locking import QKLockingReducer
    from sinklens.analysis.sinks import SinkReducer
    from sinklens.analysis.variance import VarianceReducer

    reducers = [SinkReducer(tiny_llama), VarianceReducer(tiny_llama), NormalizedDisparityReducer(tiny_llama),
                MassiveActivationsReducer(tiny_llama, abs_threshold=None, rel_threshold=3.0),
                SuperNeuronReducer(tiny_llama), QKLockingReducer(tiny_llama)]
    first = sinklens.run(tiny_llama, TINY_PROMPTS, *reducers, options=QUIET)
    for reducer in reducers:
        reducer.reset()
    again = sinklens.run(tiny_llama, TINY_PROMPTS, *reducers, options=QUIET)
    assert (first[0].n_sequences, again[0].n_sequences) == (3, 3)  # not 6: the statistics were zeroed
    torch.testing.assert_close(again[0].received, first[0].received, equal_nan=True)
    torch.testing.assert_close(again[1].z_var, first[1].z_var, equal_nan=True)
    torch.testing.assert_close(again[2].ratio_sink, first[2].ratio_sink)
    torch.testing.assert_close(again[3].count_sink, first[3].count_sink)
    torch.testing.assert_close(again[4].sink_act, first[4].sink_act)
    torch.testing.assert_close(again[5].key_query_energy, first[5].key_query_energy)


def _modes(model):
    """Every submodule's train/eval flag, a 4.x bridge's wrapped Hugging Face model's included."""
    inner = getattr(model, "original_model", None)
    return {**{name: m.training for name, m in model.named_modules()},
            **({f"hf.{name}": m.training for name, m in inner.named_modules()} if inner is not None else {})}


def test_analyzers_measure_a_model_left_in_train_mode_without_dropout_and_give_its_modes_back():
    """A model in train mode (dropout 0.1 in the Hugging Face GPT-2 config) is measured as at inference: the same
    numbers as in eval mode, for any batch size; afterwards every submodule has the mode it had (a mixed state
    included), also when the pass raises."""
    from sinklens.testing import tiny_model

    model = tiny_model("gpt2", n_layers=2, n_ctx=32)
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    model.eval()
    reference = sinklens.find_sinks(model, TINY_PROMPTS, options=QUIET).received
    model.train()
    mixed = next(iter(dropouts or list(model.modules())[1:]))
    mixed.eval()  # a mixed state, as a user may leave it
    inner = getattr(model, "original_model", None)  # a 4.x bridge's Hugging Face model: not among its modules()
    inner_drop = next((m for m in inner.modules() if isinstance(m, torch.nn.Dropout)), None) if inner is not None else None
    if inner_drop is not None:
        inner_drop.eval()
    modes = _modes(model)
    for batch_size in (8, 1):
        got = sinklens.find_sinks(model, TINY_PROMPTS, options=QUIET.replace(batch_size=batch_size)).received
        torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-6)
    # TransformerLens 4.x runs Hugging Face's GPT-2 with dropout 0.1; a 3.x HookedTransformer has no dropout
    assert dropouts or not hasattr(model, "original_model")
    # The experiments' own forward passes (patching, the intervention loss) run in eval mode too
    tokens = torch.randint(0, model.cfg.d_vocab, (4, 12), generator=torch.Generator().manual_seed(0))
    model.eval()
    patched = sinklens.patch_sink(model, tokens, [], target=0, site="z").clean
    loss = sinklens.create_sink(model, tokens, 3, loss=True).loss_before
    model.train()
    mixed.eval()
    if inner_drop is not None:
        inner_drop.eval()
    assert sinklens.patch_sink(model, tokens, [], target=0, site="z").clean == patched
    assert sinklens.create_sink(model, tokens, 3, loss=True).loss_before == loss
    assert _modes(model) == modes
    assert _modes(model) == modes

    def fails(act, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        sinklens.find_sinks(model, TINY_PROMPTS, options=QUIET.replace(extra_hooks=(("blocks.0.hook_resid_pre", fails),)))
    assert _modes(model) == modes


def test_a_token_tensor_padded_by_to_tokens_is_named_in_a_warning():
    """``model.to_tokens(prompts)`` right-pads prompts of different lengths with the pad token; a plain tensor counts
    every position as real, so sinklens warns (naming the padded rows and the two fixes) instead of measuring the
    padding as text without a word. The same prompts as strings, the tensor with its mask, or rows of one length
    raise no warning, and the mask gives the strings' numbers."""
    import warnings

    from sinklens.inputs import TokenBatch
    from sinklens.testing import tiny_model
    from support.checks import VARIED_PROMPTS

    model = tiny_model("llama", n_layers=2, n_ctx=32)
    tokens = model.to_tokens(VARIED_PROMPTS)
    lengths = [len(model.to_tokens(p)[0]) for p in VARIED_PROMPTS]
    assert len(set(lengths)) > 1
    with pytest.warns(RuntimeWarning, match=r"pad token .*TokenBatch\(tokens, valid\)") as caught:
        sinklens.find_sinks(model, tokens, options=QUIET)
    assert caught[0].filename == __file__  # the warning names the user's line, not sinklens' internals
    shorter = [i for i, n in enumerate(lengths) if n < max(lengths)]
    assert str(shorter[:6])[1:-1] in str(caught[0].message)
    valid = torch.arange(tokens.shape[1])[None, :] < torch.tensor(lengths)[:, None]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        from_strings = sinklens.find_sinks(model, VARIED_PROMPTS, options=QUIET)
        masked = sinklens.find_sinks(model, [TokenBatch(tokens, valid, True)], options=QUIET)
        sinklens.find_sinks(model, tokens[:, : min(lengths)], options=QUIET)  # one length: nothing padded
        one_pad = tokens[:, : min(lengths)].clone()
        one_pad[0, -1] = model.tokenizer.pad_token_id  # one text ending in the pad id (EOS where pad is EOS)
        sinklens.find_sinks(model, one_pad, options=QUIET)
    torch.testing.assert_close(masked.received, from_strings.received)


def test_passes_on_one_model_from_two_threads_run_one_at_a_time(tiny_llama):
    """Thread A pauses inside its forward; thread B's analysis then runs. Both used to see each other's hooks
    (results 1.5-2x off, no error); now B waits for A's pass, and each equals its single-thread result."""
    import threading

    prompts = ["t5 t6 t7 t8 t9", "t3 t4 t5", "t9 t8 t7 t6"]
    ref_sinks = sinklens.find_sinks(tiny_llama, prompts, options=QUIET)
    ref_var = sinklens.measure_variance(tiny_llama, prompts, options=QUIET)
    a_inside, results = threading.Event(), {}

    def pause(act, hook):
        if not a_inside.is_set():
            a_inside.set()
            threading.Event().wait(0.5)  # B would run its whole pass now if nothing held the model

    def a():
        results["a"] = sinklens.find_sinks(tiny_llama, prompts, options=QUIET.replace(
            extra_hooks=[("blocks.0.hook_resid_pre", pause)]))

    def b():
        a_inside.wait(5)
        results["b"] = sinklens.measure_variance(tiny_llama, prompts, options=QUIET)

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert torch.equal(results["a"].received, ref_sinks.received)
    assert torch.equal(results["b"].z_var, ref_var.z_var) and results["b"].n_sequences == 3
    assert attached_hook_count(tiny_llama) == 0


def test_an_analysis_from_inside_a_hook_of_the_same_model_is_refused(tiny_llama):
    prompts = ["t5 t6 t7 t8 t9", "t3 t4 t5"]
    ref = sinklens.find_sinks(tiny_llama, prompts, options=QUIET)

    def nested(act, hook):
        sinklens.find_sinks(tiny_llama, prompts, options=QUIET)

    with pytest.raises(InvalidArgumentError, match="started from inside a hook of another pass on it"):
        sinklens.find_sinks(tiny_llama, prompts, options=QUIET.replace(extra_hooks=[("blocks.1.hook_resid_pre", nested)]))
    assert attached_hook_count(tiny_llama) == 0
    assert torch.equal(sinklens.find_sinks(tiny_llama, prompts, options=QUIET).received, ref.received)


def test_by_default_position_0_is_what_the_models_own_tokenizer_puts_there(tiny_llama, tmp_path, monkeypatch):
    """With no ``prepend_bos`` given, text gets the BOS only where the model's own tokenizer adds one (a Qwen GGUF's
    adds none; a forced BOS moves the massive dimensions); the report says what was done and what it does."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from sinklens.inputs import tokenizer_adds_bos

    def bos_line(**options):
        report = sinklens.analyze(tiny_llama, ["t5 t6 t7 t8"], abs_threshold=None, rel_threshold=3.0,
                                  options=QUIET.replace(**options))
        assert report.summary().splitlines()[2] == f"bos: {report.bos}"
        return report.to_dict()["bos"]

    def own_tokens(text):  # the model's own tokenizer, as saved, run directly
        return AutoTokenizer.from_pretrained(tiny_llama.tokenizer.name_or_path)(text)["input_ids"]

    assert tokenizer_adds_bos(tiny_llama) is True and own_tokens("t5 t6 t7") == [0, 5, 6, 7]
    (own,) = as_batches(tiny_llama, ["t5 t6 t7"])
    assert own.tokens.tolist() == [own_tokens("t5 t6 t7")] and own.prepend_bos
    assert bos_line() == "<s> added (the model's own tokenizer adds one)"
    assert bos_line(prepend_bos=False) == "none (the model's own tokenizer adds one)"
    tok = AutoTokenizer.from_pretrained(tiny_llama.tokenizer.name_or_path)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A")  # adds nothing, like Qwen's
    tok.save_pretrained(tmp_path)
    monkeypatch.setattr(tiny_llama, "tokenizer", AutoTokenizer.from_pretrained(tmp_path))
    assert tokenizer_adds_bos(tiny_llama) is False and own_tokens("t5 t6 t7") == [5, 6, 7]
    (own,) = as_batches(tiny_llama, ["t5 t6 t7"])
    assert own.tokens.tolist() == [own_tokens("t5 t6 t7")] and not own.prepend_bos
    assert sinklens.RunOptions().prepend_bos is None
    assert bos_line() == "none (the model's own tokenizer adds none)"
    assert bos_line(prepend_bos=True) == "<s> added (the model's own tokenizer adds none)"


def test_merged_statistics_pad_to_the_larger_shape():
    """``merge_sum`` zero-pads tensors and combines containers by kind; ``merge_max`` pads with the lowest value."""
    assert merge_sum(torch.ones(2, 1), torch.ones(1, 3)).tolist() == [[2, 1, 1], [1, 0, 0]]
    assert merge_sum([1], [2]) == [1, 2] and merge_sum({0: 1.0}, {0: 2.0, 1: 3.0}) == {0: 3.0, 1: 3.0}
    assert merge_sum(True, False) is False and merge_sum({"qk"}, {"qk"}) == {"qk"}
    assert merge_max(torch.tensor([1.0, -5.0]), torch.tensor([3.0, -6.0, -4.0])).tolist() == [3, -5, -4]
    assert merge_max(torch.tensor([-1, -2]), torch.tensor([-5])).tolist() == [-1, -2]
    assert merge_max(torch.tensor([True, False]), torch.tensor([False, False])).tolist() == [True, False]
