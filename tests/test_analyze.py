"""End-to-end: ``sinklens.analyze``, the report, the CLI, and the embedded SmolLM2."""

import json

import pytest
import torch

from sinklens.analysis.report import analyze
from sinklens.plotting.report import FIGURE_FILES, save_report
from sinklens.analysis.sinks import find_sinks
from sinklens.analysis.variance import measure_variance
from sinklens.cli import main
from sinklens.testing import QUIET
from support.checks import TINY_PROMPTS, no_hooks_left


PROMPTS = TINY_PROMPTS


@pytest.mark.models
def test_one_shared_pass_equals_each_analyzer_alone(tiny):
    report = analyze(tiny, PROMPTS, abs_threshold=None, rel_threshold=3.0, options=QUIET.replace(batch_size=2))
    alone_sinks = find_sinks(tiny, PROMPTS, options=QUIET.replace(batch_size=2))
    alone_var = measure_variance(tiny, PROMPTS, options=QUIET.replace(batch_size=2))
    torch.testing.assert_close(report.sinks.received, alone_sinks.received, equal_nan=True)
    torch.testing.assert_close(report.variance.z_var, alone_var.z_var, equal_nan=True)
    assert report.n_sequences == 3
    assert report.n_tokens == sum(len(p.split()) + 1 for p in PROMPTS)
    assert no_hooks_left(tiny)


@pytest.mark.models
def test_report_saves_json_summary_and_figures(tiny, tmp_path):
    report = analyze(tiny, PROMPTS, abs_threshold=None, rel_threshold=3.0, options=QUIET)
    written = save_report(report, tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["n_sequences"] == 3 and data["prepend_bos"] is True
    assert data["headline"]["sink_rate"] == pytest.approx(report.sinks.sink_rate(position=0), rel=1e-5)
    assert "sink rate" in (tmp_path / "summary.txt").read_text()
    pngs = [p for p in written if p.suffix == ".png"]
    assert len(pngs) >= 6 and all(p.stat().st_size > 5000 for p in pngs)
    assert {p.name for p in pngs} <= set(FIGURE_FILES)  # the names a later save clears when it does not redraw them


def test_cli_analyze_on_a_local_model_directory(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    from sinklens.testing import word_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=64, bos_token_id=0, eos_token_id=1)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    word_tokenizer(64).save_pretrained(tmp_path / "model")
    code = main(["analyze", "--model", str(tmp_path / "model"), "--text", "t4 t5 t6 t7", "t8 t9 t10",
                 "--out", str(tmp_path / "out"), "--device", "cpu"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "Sink positions" in printed and "layer" in printed
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["n_sequences"] == 2 and len(data["sinks"]["received"]) == 2

    # a second analysis is refused before the model loads, leaving the first one as it was
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    assert main(["analyze", "--model", "no-such-model", "--out", str(tmp_path / "out")]) == 2
    assert "--out would replace" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    # --overwrite replaces it whole: no figure of the first analysis is left beside the second
    assert main(["analyze", "--model", str(tmp_path / "model"), "--text", "t4 t5 t6", "--out", str(tmp_path / "out"),
                 "--device", "cpu", "--overwrite", "--no-figures"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["report.json", "summary.txt"]
    assert json.loads((tmp_path / "out" / "report.json").read_text())["n_sequences"] == 1


def test_cli_analyze_cuts_text_to_the_default_max_length_and_keeps_random_tokens_whole(tmp_path, monkeypatch):
    """The default ``--max-length`` cuts text prompts; ``--random-tokens`` sequences keep their ``--seq-len``
    (``max_length`` now cuts token batches too, so the command must not pass its text default for them)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import sinklens.commands.analyze as analyze_command
    from sinklens.testing import word_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    word_tokenizer(64).save_pretrained(tmp_path / "model")
    monkeypatch.setattr(analyze_command, "_DEFAULT_MAX_LENGTH", 4)
    width = {}
    for name, source in (("text", ["--text", "t4 t5 t6 t7 t8 t9 t10"]), ("random", ["--random-tokens", "2", "--seq-len", "10"])):
        assert main(["analyze", "--model", str(tmp_path / "model"), *source, "--out", str(tmp_path / name),
                     "--device", "cpu", "--no-figures"]) == 0
        width[name] = len(json.loads((tmp_path / name / "report.json").read_text())["sinks"]["received"][0][0])
    assert width == {"text": 4, "random": 10}


def test_cli_analyze_adds_a_bos_only_where_the_models_tokenizer_does(tmp_path):
    """Without --bos/--no-bos, position 0 is what the model's own tokenizer puts there (here: none)."""
    from tokenizers import processors
    from transformers import LlamaConfig, LlamaForCausalLM

    from sinklens.testing import word_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    tok = word_tokenizer(64)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A")  # adds nothing, like Qwen's
    tok.save_pretrained(tmp_path / "model")
    start = {}
    for flags in ([], ["--bos"], ["--no-bos"]):
        out = tmp_path / ("out" + "".join(flags))
        assert main(["analyze", "--model", str(tmp_path / "model"), "--text", "t4 t5 t6", *flags, "--out", str(out),
                     "--device", "cpu", "--no-figures"]) == 0
        data = json.loads((out / "report.json").read_text())
        start[" ".join(flags)] = (data["prepend_bos"], data["bos"], len(data["sinks"]["received"][0][0]))
    none = "none (the model's own tokenizer adds none)"
    assert start == {"": (False, none, 3), "--bos": (True, "<s> added (the model's own tokenizer adds none)", 4),
                     "--no-bos": (False, none, 3)}


def test_cli_reports_bad_input_without_a_traceback(tmp_path, capsys):
    assert main(["analyze", "--model", "no-such-model", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "Unknown model 'no-such-model'" in err and "Traceback" not in err
    assert main(["analyze", "--prompts", str(tmp_path / "missing.txt"), "--model", "x"]) == 2


def _w_out(model, layer):
    """``W_out[layer]`` ``[d_mlp, d_model]`` as the model multiplies it: the Hugging Face ``down_proj`` behind a
    TransformerLens 4.x bridge, the HookedTransformer's own weight (as TransformerLens 3.x processed it) otherwise."""
    hf = getattr(model, "original_model", None)
    if hf is not None:
        return hf.model.layers[layer].mlp.down_proj.weight.T
    return model.blocks[layer].mlp.W_out


def _sink_dim_reference(model, batches, dim):
    """Plain ``run_with_cache`` code, no sinklens: the mean over sequences at position 0 of residual dimension ``dim``
    at every stream index (``s < n_layers``: ``blocks.{s}.hook_resid_pre``; ``n_layers``: the last ``hook_resid_post``),
    and each neuron's mean write into it at position 0, ``mlp.hook_post[b, 0, n] × W_out[l, n, dim]`` (a pre-norm
    model: what the neuron adds to the residual stream)."""
    n_layers = model.cfg.n_layers
    streams = [f"blocks.{s}.hook_resid_pre" for s in range(n_layers)] + [f"blocks.{n_layers - 1}.hook_resid_post"]
    posts = [f"blocks.{layer}.mlp.hook_post" for layer in range(n_layers)]
    resid = torch.zeros(n_layers + 1, dtype=torch.float64)
    contrib = torch.zeros(n_layers, model.cfg.d_mlp, dtype=torch.float64)
    n_seq = 0
    for batch in batches:
        assert bool(batch.valid[:, 0].all())  # right padding: a causal decoder's position 0 never sees it
        with torch.inference_mode():
            _, cache = model.run_with_cache(batch.tokens, names_filter=lambda n: n in streams or n in posts)
        n_seq += batch.tokens.shape[0]
        resid += torch.stack([cache[name][:, 0, dim].double().sum() for name in streams])
        for layer, name in enumerate(posts):
            w = _w_out(model, layer)[:, dim].detach().double()
            contrib[layer] += (cache[name][:, 0].double() * w).sum(dim=0)
    return resid / n_seq, contrib / n_seq


@pytest.mark.slow
def test_smollm2_has_a_first_token_sink_fed_by_a_massive_dimension(smollm2, tmp_path):
    """Measured on SmolLM2-135M-Instruct (8 stdlib docstrings, 48 tokens, BOS prepended): position 0
    is the only sink; residual dimension 507 at position 0 reaches ~25,000 from block 12 on (median
    |x| ~2), written by block 11's MLP, mostly by neurons 1229 and 1487, whose W_out rows put >95%
    of their mass on one channel."""
    from sinklens.inputs import as_batches
    from sinklens.prompts import stdlib_text_prompts
    from sinklens.testing import transformer_lens_major

    prompts = stdlib_text_prompts(8)
    report = analyze(smollm2, prompts, verify=True, options=QUIET.replace(max_length=48, prepend_bos=True))
    assert report.sinks.sink_positions == [0]
    assert report.sinks.sink_rate(position=0) > 0.5
    late = report.sinks.received[12:, :, 0]
    assert float(late.mean()) > 0.4  # uniform attention over 48 keys would give ~0.05
    assert 507 in report.massive_dims()
    path = report.neurons.path(507)
    assert path.write_layer == 11 and path.peak_value > 10_000
    writers = {(layer, neuron) for layer, neuron, _ in path.top_neurons[:2]}
    assert writers == {(11, 1229), (11, 1487)}
    assert report.neurons.neuron_row(11, 1229)["row_top_share"] > 0.9
    # The peak and the top writers against plain run_with_cache code on the same tokens (SmolLM2 is pre-norm:
    # a neuron's residual-unit contribution is its activation at the sink times its W_out entry).
    resid, contrib = _sink_dim_reference(smollm2, as_batches(smollm2, prompts, max_length=48, prepend_bos=True), 507)
    peak = int(resid.abs().argmax())
    assert (path.peak_layer, path.peak_value) == (peak, pytest.approx(float(resid[peak]), rel=1e-5))
    top = contrib.flatten().topk(2)  # the peak is positive: the largest contributions write towards it
    expected = [(int(i) // contrib.shape[1], int(i) % contrib.shape[1], float(v)) for v, i in zip(*top)]
    assert [(layer, n) for layer, n, _ in path.top_neurons[:2]] == [(layer, n) for layer, n, _ in expected]
    for (_, _, got), (_, _, ref) in zip(path.top_neurons[:2], expected):
        assert got == pytest.approx(ref, rel=1e-5)
    # Position 0 is the same BOS in every sequence, so these are `sinklens analyze --bos`'s numbers on any prompts
    # (TransformerLens 4.x bridge, float32).
    if transformer_lens_major() >= 4:
        assert (peak, float(resid[peak])) == (12, pytest.approx(24926.2, abs=0.5))
        assert [round(v, 1) for _, _, v in expected] == [pytest.approx(18008.2, abs=0.5), pytest.approx(6786.7, abs=0.5)]
    assert [w.block for w in path.writers] == [11] and [e.block for e in path.erasers] == [28, 29]
    # Block 11's output is the peak stream: no later block stands between its neurons and the dim, so their total
    # effect is their direct contribution; an earlier neuron's (L1N83) adds what later blocks build on it.
    assert path.total_effect[:2] == [(11, 1229, pytest.approx(path.top_neurons[0][2], rel=1e-3)),
                                     (11, 1487, pytest.approx(path.top_neurons[1][2], rel=1e-3))]
    assert path.total_effect[2][:2] == (1, 83) and path.first_massive_stream == 3
    assert report.neurons.post_norm_blocks == [] and report.neurons.super_neurons()[0] == (11, 1229)
    # The causal check: zeroing L11N1229 and L11N1487 at position 0 removes 99% of dim 507 (24926 -> 131) and
    # 56% of the attention position 0 receives (0.436 -> 0.193).
    check = next(c for c in report.causal.checks if c.dim == 507)
    direct = check.ablation("direct")
    assert [(l, n) for l, n, _ in direct.zeroed] == [(11, 1229), (11, 1487)]
    assert direct.dim_removed > 0.95 and direct.attention_removed > 0.4
    assert check.writers_cause_dim and check.writers_cause_sink
    assert float(report.massive.norm_ratio[12, 0]) > 50
    save_report(report, tmp_path, figures=False)


@pytest.mark.models
def test_an_interrupted_save_leaves_the_previous_report_whole(tiny_llama, tmp_path, monkeypatch):
    import os

    first = analyze(tiny_llama, PROMPTS[:2], abs_threshold=None, rel_threshold=3.0, options=QUIET)
    save_report(first, tmp_path, figures=False)
    before = (tmp_path / "report.json").read_text()
    second = analyze(tiny_llama, PROMPTS, abs_threshold=None, rel_threshold=3.0, options=QUIET)

    def interrupted(fd):  # the process dies after part of the new file was written, before it is renamed
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_report(second, tmp_path, figures=False)
    monkeypatch.undo()
    assert (tmp_path / "report.json").read_text() == before  # the earlier complete report, untouched
    assert json.loads(before)["n_sequences"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "summary.txt"]  # no temporary left
    save_report(second, tmp_path, figures=False)
    assert json.loads((tmp_path / "report.json").read_text())["n_sequences"] == 3


@pytest.mark.models
def test_sink_threshold_and_unknown_keywords(tiny_llama):
    assert analyze(tiny_llama, PROMPTS, sink_threshold=0.2, options=QUIET, abs_threshold=None,
                   rel_threshold=3.0).sinks.sink_threshold == 0.2
    with pytest.raises(TypeError, match="unexpected keyword"):
        analyze(tiny_llama, PROMPTS, batchsize=2, options=QUIET)


@pytest.mark.models
def test_report_json_paths_are_in_residual_units_on_a_post_norm_model(tmp_path):
    """report.json's super_neurons.paths[]: ``dim`` and ``top_neurons`` as [layer, neuron, contribution] rows, best
    first, in residual units: the planted neuron behind a x250 post-norm gain first, its 10x bigger-raw decoy after."""
    from support.models import planted_post_norm_model
    from support.zoo import FamilyUnavailableError

    try:
        model, spec = planted_post_norm_model("gemma2")
    except FamilyUnavailableError as err:
        pytest.skip(str(err))
    from support.checks import PLANTED_PROMPTS

    report = analyze(model, PLANTED_PROMPTS, abs_threshold=None, rel_threshold=50.0, options=QUIET)
    save_report(report, tmp_path, figures=False)
    data = json.loads((tmp_path / "report.json").read_text())
    (path,) = data["super_neurons"]["paths"]
    assert path["dim"] == spec.dim
    rows = path["top_neurons"]
    assert [r[:2] for r in rows[:2]] == [[spec.layer, spec.neuron], [spec.decoy_layer, spec.decoy_neuron]]
    assert [r[2] for r in rows] == sorted((r[2] for r in rows), reverse=True)
    assert rows[0][2] == pytest.approx(path["peak_value"], rel=1e-3)  # the whole massive value, in residual units
    assert [w["block"] for w in path["writers"]] == [spec.layer] and path["erasers"] == []
    assert data["super_neurons"]["super_neurons"] == [[spec.layer, spec.neuron]]
    assert data["super_neurons"]["post_norm_blocks"] == [0, 1]


def test_the_report_records_the_dtype_and_device_it_ran_in(tiny):
    """A float64 and a bfloat16 run of one model wrote identical settings, so their report.json files could not be
    told apart."""
    import copy

    for dtype in (torch.float64, torch.bfloat16):
        model = copy.deepcopy(tiny).to(dtype)
        settings = analyze(model, TINY_PROMPTS, options=QUIET).to_dict()["settings"]
        assert (settings["dtype"], settings["device"]) == (str(dtype).removeprefix("torch."), "cpu")


def test_the_report_defines_its_columns_and_its_folder_indexes_every_figure(tiny_llama, tmp_path):
    """Every column of the printed table is defined under it, later tokens are not called sinks, the figures say
    which side of 1 means what and how many sequences they average, and ``index.md`` names every file."""
    report = analyze(tiny_llama, PROMPTS, abs_threshold=None, rel_threshold=3.0, options=QUIET)
    text = report.summary()
    header = next(line for line in text.splitlines() if line.startswith("layer "))
    below = text[text.index(header) + len(header):]
    for column in ("Gu sink rate", "attn to sink", "var ratio z", "zW_O", "norm ratio", "max |x| sink"):
        assert column in header and column in below
    assert "Most attended later tokens" in text and "Top sink tokens" not in text
    written = save_report(report, tmp_path)
    index = (tmp_path / "index.md").read_text()
    assert {p.name for p in written} == {"index.md", *(line.split("`")[1] for line in index.splitlines() if line.startswith("- `"))}
    assert "variance_discrepancy.png`: per layer x head, variance over sequences at position 0 / the other positions' " \
           "(red > 1: position 0 varies more" in index
    from sinklens.plotting.sinks import plot_received_by_position
    from sinklens.plotting.variance import plot_discrepancy

    fig = plot_discrepancy(report.variance)
    assert fig.axes[-1].get_ylabel() == "> 1: position 0 varies more than the rest; < 1: less"
    assert "3 sequences" in fig._suptitle.get_text()
    assert plot_received_by_position(report.sinks).axes[0].get_xlabel().startswith(
        "key position (averaged over the sequences reaching it: 3 at 0, ")


def test_the_report_says_where_it_read_attention_and_keeps_the_pattern_under_an_edit(tiny_llama, monkeypatch):
    """Above QK_ABOVE tokens the report reads sinks and value drain from queries and keys (same numbers) and says
    so in its summary and JSON; an extra hook on hook_pattern keeps the pattern, and the report says why."""
    from sinklens.analysis import qk_attention
    from sinklens.analysis.value_drain import measure_value_drain

    kw = dict(abs_threshold=None, rel_threshold=3.0)
    below = analyze(tiny_llama, PROMPTS, **kw, options=QUIET)
    assert below.to_dict()["attention"] == "attention read from hook_pattern (no sequence longer than 1024 tokens)"
    monkeypatch.setattr(qk_attention, "QK_ABOVE", 2)
    attached, hooks = [], tiny_llama.hooks
    monkeypatch.setattr(tiny_llama, "hooks", lambda fwd_hooks=(), **kw: attached.extend(n for n, _ in fwd_hooks)
                        or hooks(fwd_hooks=fwd_hooks, **kw))
    above = analyze(tiny_llama, PROMPTS, **kw, options=QUIET)
    monkeypatch.setattr(tiny_llama, "hooks", hooks)
    assert attached and not [n for n in attached if n.endswith(("hook_pattern", "hook_attn_scores"))]
    said = "attention read from queries and keys (sequences longer than 2 tokens)"
    assert above.sinks.attention_path == "qk" and above.to_dict()["attention"] == said and said in above.summary()
    torch.testing.assert_close(above.sinks.received, below.sinks.received, rtol=0, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(above.locking.mean_score_other, below.locking.mean_score_other, rtol=1e-5, atol=1e-7)
    assert torch.equal(above.locking.pos_share_other, below.locking.pos_share_other)
    torch.testing.assert_close(above.value_drain.write_share, below.value_drain.write_share, rtol=1e-5, atol=1e-6)
    edit = [("blocks.0.attn.hook_pattern", lambda p, hook: p * 0.5)]
    edited = analyze(tiny_llama, PROMPTS, **kw, options=QUIET.replace(extra_hooks=edit))
    assert edited.sinks.attention_path == "pattern" and "extra hooks edit" in edited.summary()
    halved = measure_value_drain(tiny_llama, PROMPTS, method="pattern", options=QUIET.replace(extra_hooks=edit))
    torch.testing.assert_close(edited.value_drain.attn_sink, halved.attn_sink)
    torch.testing.assert_close(edited.value_drain.attn_sink[0], below.value_drain.attn_sink[0] / 2)
