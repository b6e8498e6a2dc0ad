import json
import re

import pytest
import torch

from sinklens import loading, model_files
from sinklens.errors import CorruptFileError, InvalidArgumentError, NotFoundError, OfflineError, UnsupportedArchitectureError
from sinklens.testing import word_tokenizer


def test_tl_model_is_passed_through(tiny_llama):
    assert loading.load_model(tiny_llama) is tiny_llama


@pytest.mark.parametrize(
    ("spec", "error", "words"),
    [
        ("gpt-5-nano", InvalidArgumentError, "smollm2-135m"),
        ("./no/such/model", NotFoundError, "no/such/model"),
        ("weights.gguf", NotFoundError, "weights.gguf"),
        (12, InvalidArgumentError, "int"),
    ],
)
def test_bad_specs_raise_named_errors(spec, error, words):
    with pytest.raises(error, match=words):
        loading.load_model(spec)


def test_hub_id_without_network_names_the_offline_default(monkeypatch):
    monkeypatch.setattr(model_files, "hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(OfflineError, match="smollm2-135m"):
        loading.load_model("HuggingFaceTB/SmolLM2-135M")


def test_hub_download_failure_becomes_offline_error(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(model_files, "hub_reachable", lambda timeout=3.0: True)
    monkeypatch.setattr(loading, "_boot_hf", refuse)
    with pytest.raises(OfflineError, match="couldn't connect"):
        loading.load_model("org/model")


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype"):
        loading.load_model("smollm2-135m", dtype="float13")


def test_directory_that_is_not_a_model(tmp_path):
    with pytest.raises(InvalidArgumentError, match="config.json"):
        loading.load_model(tmp_path)


def test_model_hiding_hook_pattern_is_refused(fused_attention_model):
    with pytest.raises(UnsupportedArchitectureError, match="eager"):
        loading.load_model(fused_attention_model)


def test_local_hf_directory_matches_hugging_face_logits(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=64, bos_token_id=0, eos_token_id=1)
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    word_tokenizer(64).save_pretrained(tmp_path)
    model = loading.load_model(tmp_path, device="cpu")
    tokens = torch.tensor([[0, 5, 9, 33, 2, 17]])
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-5, rtol=1e-5)


def test_a_hf_folder_without_tokenizer_loads_and_is_analysed_on_random_tokens(tmp_path, capsys):
    """A random-init ``save_pretrained`` has no tokenizer files; transformers then fails to build one from the
    config ("Couldn't instantiate the backend tokenizer"), which failed ``load_model``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sinklens.cli import main

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=64)
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "m")
    model = loading.load_model(tmp_path / "m", device="cpu")
    assert model.tokenizer is None
    tokens = torch.tensor([[0, 5, 9, 33, 2, 17]])
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-5, rtol=1e-5)
    assert main(["analyze", "--model", str(tmp_path / "m"), "--device", "cpu", "--no-figures",
                 "--out", str(tmp_path / "a")]) == 0
    assert "has no tokenizer" in capsys.readouterr().err
    assert json.loads((tmp_path / "a" / "report.json").read_text())["n_sequences"] == 16


@pytest.mark.slow
def test_embedded_smollm2_matches_its_dequantised_weights(smollm2):
    """The bridge's logits equal those of the cached dequantised HF model (eager attention)."""
    from transformers import AutoModelForCausalLM

    gguf = model_files.fetch_embedded_gguf("smollm2-135m")
    converted = model_files.convert_gguf(gguf)  # cached: returns at once
    assert (smollm2.cfg.n_layers, smollm2.cfg.n_heads, smollm2.cfg.d_model) == (30, 9, 576)
    hf = AutoModelForCausalLM.from_pretrained(converted, attn_implementation="eager").eval()
    tokens = smollm2.to_tokens("Attention sinks are tokens that soak up attention.")
    with torch.no_grad():
        torch.testing.assert_close(smollm2(tokens), hf(tokens).logits, atol=1e-3, rtol=1e-4)


@pytest.mark.models
def test_a_bias_free_model_loaded_from_a_folder_has_zero_output_biases():
    """TransformerLens 3.9's bridge stacks the blocks' missing MLP biases into a TypeError (``torch.stack`` of
    None), which ended ``sinklens analyze`` of a Llama folder in an internal error under 3.x."""
    from sinklens.residual_units import attn_out_bias, mlp_out_bias
    from support.zoo import zoo_dir

    model = loading.load_model(str(zoo_dir("llama")), device="cpu")
    for layer in range(model.cfg.n_layers):
        assert torch.equal(mlp_out_bias(model, layer), torch.zeros(model.cfg.d_model))
        assert torch.equal(attn_out_bias(model, layer), torch.zeros(model.cfg.d_model))


@pytest.mark.models
@pytest.mark.skipif(__import__("sinklens.testing", fromlist=["x"]).transformer_lens_major() < 4,
                    reason="gpt-oss is a TransformerLens 4 zoo family")
def test_a_float64_mixture_of_experts_runs_with_the_eager_expert_loop():
    """``load_model(gpt_oss, dtype="float64")`` failed in its first forward pass: torch's grouped matmul, which
    transformers uses for the experts, has no float64 kernel. The eager loop computes the same products."""
    import sinklens
    from sinklens.testing import QUIET
    from support.zoo import zoo_model

    prompts = ["t3 t4 t5 t6 t7", "t9 t8 t7"]
    ref = sinklens.find_sinks(zoo_model("gptoss"), prompts, options=QUIET).received
    model = loading.load_model(zoo_model("gptoss"), dtype="float64")
    assert next(model.parameters()).dtype == torch.float64
    got = sinklens.find_sinks(model, prompts, options=QUIET).received
    torch.testing.assert_close(got.float(), ref, rtol=1e-5, atol=1e-6)


def test_a_missing_path_under_an_existing_folder_is_named_as_a_missing_path_offline(tmp_path, monkeypatch):
    """``--model zoo/nope`` beside a folder ``zoo`` used to read "looks like a Hugging Face Hub id, but the Hub
    cannot be reached" (exit 1), with no word that the local path is missing."""
    monkeypatch.setattr(model_files, "hub_reachable", lambda timeout=3.0: False)
    (tmp_path / "zoo" / "llama").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(NotFoundError, match=r"No model file or directory at 'zoo/nope' .*the folder 'zoo' "
                                                     r"holds \['llama'\]"):
        loading.load_model("zoo/nope")
    with pytest.raises(OfflineError, match="looks like a Hugging Face Hub id"):  # no such folder: a Hub id
        loading.load_model("org/nope")


@pytest.mark.parametrize(("fields", "words"), [
    ({"num_hidden_layers": -1}, "sets num_hidden_layers=-1; it must be a whole number >= 1"),
    ({"hidden_size": 30, "num_attention_heads": 4}, "hidden_size=30, not divisible by num_attention_heads=4"),
    ({"num_key_value_heads": 3}, "num_attention_heads=4, not divisible by num_key_value_heads=3"),
    ({"rms_norm_eps": float("nan")}, "sets rms_norm_eps=nan; it must be a finite number > 0"),
    ({"rms_norm_eps": 0}, "sets rms_norm_eps=0; it must be a finite number > 0"),
])
def test_a_hugging_face_config_with_a_bad_size_names_the_field(tmp_path, fields, words):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 100, **fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CorruptFileError, match=re.escape(words)):
        loading.load_model(tmp_path, device="cpu")


def _edited_zoo_copy(tmp_path, edit):
    """A copy of the zoo's tiny llama folder whose safetensors ``edit`` (a dict -> None) has changed."""
    import shutil

    from safetensors.torch import load_file, save_file

    from support.zoo import zoo_dir

    folder = tmp_path / "model"
    shutil.copytree(zoo_dir("llama"), folder)
    weights = load_file(folder / "model.safetensors")
    edit(weights)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_a_folder_missing_a_tensor_or_holding_a_foreign_one_is_refused_naming_them(tmp_path):
    def edit(w):
        del w["model.layers.1.mlp.up_proj.weight"]
        w["transformer.h.0.attn.c_attn.weight"] = w["model.norm.weight"].clone()

    with pytest.raises(CorruptFileError, match=r"lacks 1 tensor\(s\) the architecture needs "
                       r"\(model\.layers\.1\.mlp\.up_proj\.weight\); it holds 1 tensor\(s\) the architecture does "
                       r"not have \(transformer\.h\.0\.attn\.c_attn\.weight\)"):
        loading.load_model(_edited_zoo_copy(tmp_path, edit), device="cpu")


def test_nan_weights_are_refused_naming_the_tensor_from_a_folder_and_at_an_analyzers_entry(tmp_path):
    import sinklens
    from sinklens.errors import InvalidArgumentError
    from sinklens.testing import tiny_model

    folder = _edited_zoo_copy(tmp_path, lambda w: w["model.layers.0.mlp.down_proj.weight"][1, 2].fill_(float("inf")))
    with pytest.raises(CorruptFileError, match=r"holds NaN or inf in 1 weight tensor\(s\): "
                                                    r"model\.layers\.0\.mlp\.down_proj\.weight\."):
        loading.load_model(folder, device="cpu")
    model = tiny_model("llama", n_layers=2, d_model=16, n_heads=4, n_kv_heads=2, d_mlp=32, n_ctx=64, d_vocab=64)
    tokens = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    assert sinklens.find_sinks(model, tokens).received.isfinite().all()  # measured, and remembered as checked
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "q_proj" in n)[0, 0] = float("nan")
    with pytest.raises(InvalidArgumentError, match=r"NaN or inf in 1 weight tensor\(s\): "
                                                   r"model\.layers\.0\.self_attn\.q_proj\.weight\."):
        sinklens.find_sinks(model, tokens)


def _tiny_gguf(path, *, eps=1e-5, nan_tensor=None):
    """A tiny llama GGUF (2 layers, width 16, 64 tokens) written with ``gguf.GGUFWriter``, float32 weights."""
    import gguf
    import numpy as np

    rng, d, ff, vocab = np.random.default_rng(0), 16, 32, 64
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64), w.add_embedding_length(d), w.add_block_count(2), w.add_feed_forward_length(ff)
    w.add_head_count(4), w.add_head_count_kv(4), w.add_layer_norm_rms_eps(eps), w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2"), w.add_token_list(["a", "b", "ab"] + [f"t{i}" for i in range(3, vocab)])
    w.add_token_types([1] * vocab), w.add_token_scores([0.0] * vocab), w.add_token_merges(["a b"])
    w.add_bos_token_id(0), w.add_eos_token_id(1)
    shapes = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,), "output.weight": (vocab, d)}
    for i in range(2):
        shapes.update({f"blk.{i}.attn_norm.weight": (d,), f"blk.{i}.ffn_norm.weight": (d,),
                       **{f"blk.{i}.attn_{x}.weight": (d, d) for x in ("q", "k", "v", "output")},
                       f"blk.{i}.ffn_gate.weight": (ff, d), f"blk.{i}.ffn_up.weight": (ff, d),
                       f"blk.{i}.ffn_down.weight": (d, ff)})
    for name, shape in shapes.items():
        tensor = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        tensor.flat[0] = np.nan if name == nan_tensor else tensor.flat[0]
        w.add_tensor(name, tensor)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


@pytest.mark.parametrize(("broken", "words"), [
    ({}, None),
    ({"eps": float("nan")}, "sets rms_norm_eps=nan; it must be a finite number > 0"),
    ({"nan_tensor": "blk.1.ffn_up.weight"}, "holds NaN or inf in 1 weight tensor(s): model.layers.1.mlp.up_proj.weight."),
])
def test_a_gguf_with_a_bad_norm_epsilon_or_nan_weights_is_refused_naming_it(tmp_path, monkeypatch, broken, words):
    monkeypatch.setenv("SINKLENS_CACHE", str(tmp_path / "cache"))
    gguf_file = _tiny_gguf(tmp_path / "m.gguf", **broken)
    if words is None:
        assert loading.load_model(gguf_file, device="cpu").cfg.n_layers == 2
        return
    with pytest.raises(CorruptFileError, match=re.escape(words)) as err:
        loading.load_model(gguf_file, device="cpu")
    assert "m.gguf" in str(err.value)
def test_device_map_places_a_hugging_face_model_with_accelerate_and_analyzers_run_unchanged(monkeypatch):
    """``device_map`` reaches ``boot_transformers`` (so accelerate places the layers) and the q/k and pattern
    sink statistics of the placed model equal those of the model loaded on one device."""
    from transformer_lens.model_bridge import TransformerBridge

    from sinklens.analysis.sinks import find_sinks
    from sinklens.options import RunOptions
    from support.zoo import zoo_dir

    folder = str(zoo_dir("llama"))
    mapping = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu", "model.norm": "cpu",
               "model.rotary_emb": "cpu", "lm_head": "cpu"}
    seen = []
    boot = TransformerBridge.boot_transformers
    monkeypatch.setattr(TransformerBridge, "boot_transformers", lambda *a, **k: seen.append(k) or boot(*a, **k))
    placed = loading.load_model(folder, device_map=mapping)
    assert seen[-1]["device_map"] == mapping and "device" not in seen[-1]
    plain = loading.load_model(folder, device="cpu")
    quiet = RunOptions(progress=False)
    for method in ("qk", "pattern"):
        a = find_sinks(placed, ["t5 t6 t7 t8", "t9 t10"], method=method, options=quiet)
        b = find_sinks(plain, ["t5 t6 t7 t8", "t9 t10"], method=method, options=quiet)
        torch.testing.assert_close(a.received, b.received, rtol=0, atol=0)
    with pytest.raises(InvalidArgumentError, match="not both"):
        loading.load_model(folder, device="cpu", device_map="auto")
    with pytest.raises(InvalidArgumentError, match="Hugging Face models"):
        loading.load_model(plain, device_map="auto")
