"""Bad inputs at the boundary (issue 11): loading, model files, inputs, validators, test utilities.

Table-driven: one row per bad input, each asserting the exception class and that the message names
the bad value (and, where there is one, what would be accepted).
"""

from __future__ import annotations

import copy
import inspect
import json
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from sinklens import loading, model_files, validate
from sinklens.errors import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    CorruptFileError,
    InvalidArgumentError,
    NotFoundError,
    OfflineError,
    OutputExistsError,
    OutputNotWritableError,
    TrainingDivergedError,
    UnsupportedArchitectureError,
    exit_code_for,
)
from sinklens.inputs import (
    TokenBatch,
    as_batches,
    bos_token_id,
    random_token_batches,
    tokenize_prompts,
)
from sinklens.prompts import stdlib_text_prompts
from sinklens.model_files import MANIFEST, check_gguf, check_safetensors, verify_manifest, write_manifest


@pytest.fixture
def no_gpu(monkeypatch):
    """Make every run of these tests see a machine without CUDA (as this one is)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


# ---------------------------------------------------------------------------------------------------
# load_model: specs, dtypes, devices
# ---------------------------------------------------------------------------------------------------

LOAD_ROWS = [
    # (id, spec, kwargs, error, words in the message)
    ("unknown-name", "gpt-5-nano", {}, InvalidArgumentError, ["'gpt-5-nano'", "smollm2-135m"]),
    ("empty-spec", "", {}, InvalidArgumentError, ["empty", "''"]),
    ("blank-spec", "   ", {}, InvalidArgumentError, ["empty"]),
    ("dot-slash-missing", "./no/such/model", {}, NotFoundError, ["./no/such/model"]),
    ("home-missing", "~/no-such-sinklens-model", {}, NotFoundError, ["~/no-such-sinklens-model"]),
    ("absolute-missing", "/no/such/model", {}, NotFoundError, ["/no/such/model"]),
    ("gguf-missing", "weights.gguf", {}, NotFoundError, ["weights.gguf"]),
    ("safetensors-missing", "model.safetensors", {}, NotFoundError, ["model.safetensors"]),
    ("bin-missing", "pytorch_model.bin", {}, NotFoundError, ["pytorch_model.bin"]),
    ("nested-missing", "runs/a/b", {}, NotFoundError, ["runs/a/b"]),
    ("not-a-hub-id", "org/na me", {}, NotFoundError, ["org/na me"]),
    ("dotdot-in-id", "org/..x", {}, NotFoundError, ["org/..x"]),
    ("int-spec", 12, {}, InvalidArgumentError, ["int"]),
    ("none-spec", None, {}, InvalidArgumentError, ["NoneType"]),
    ("unknown-dtype", "smollm2-135m", {"dtype": "float13"}, InvalidArgumentError, ["'float13'", "bfloat16"]),
    ("int-dtype", "smollm2-135m", {"dtype": "int64"}, InvalidArgumentError, ["int64", "floating"]),
    ("torch-int-dtype", "smollm2-135m", {"dtype": torch.int8}, InvalidArgumentError, ["int8"]),
    ("cuda-without-gpu", "smollm2-135m", {"device": "cuda"}, InvalidArgumentError, ["'cuda'", "cpu"]),
    ("cuda-index-without-gpu", "smollm2-135m", {"device": "cuda:1"}, InvalidArgumentError, ["'cuda:1'"]),
    ("unknown-device", "smollm2-135m", {"device": "gpu"}, InvalidArgumentError, ["'gpu'", "'cpu'"]),
    ("device-typo", "smollm2-135m", {"device": "cdua"}, InvalidArgumentError, ["'cdua'"]),
]


def _raises_naming(error: type[BaseException], words: list[str], call, *args, **kwargs) -> None:
    """``call(*args, **kwargs)`` raises ``error`` with every one of ``words`` in its message."""
    with pytest.raises(error) as info:
        call(*args, **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize(("spec", "kwargs", "error", "words"), [r[1:] for r in LOAD_ROWS], ids=[r[0] for r in LOAD_ROWS])
def test_load_model_bad_specs(no_gpu, spec, kwargs, error, words):
    _raises_naming(error, words, loading.load_model, spec, **kwargs)


def test_mps_device_is_refused_where_there_is_no_mps(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(InvalidArgumentError, match="'mps'"):
        loading.load_model("smollm2-135m", device="mps")


def test_plausible_hub_id_goes_to_the_hub(monkeypatch):
    monkeypatch.setattr(model_files, "hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(OfflineError, match="org-1/model_2.5"):
        loading.load_model("org-1/model_2.5")


# ---------------------------------------------------------------------------------------------------
# Model files: truncated or corrupt GGUF, safetensors, local folders
# ---------------------------------------------------------------------------------------------------


def _safetensors(path: Path, n: int = 64) -> Path:
    from safetensors.torch import save_file

    save_file({"w": torch.arange(n, dtype=torch.float32)}, str(path))
    return path


def _gguf_header(path: Path, extra: bytes = b"") -> Path:
    path.write_bytes(b"GGUF" + struct.pack("<I", 3) + struct.pack("<Q", 0) + struct.pack("<Q", 0) + extra)
    return path


def _truncated(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])
    return path


def _write(path: Path, data: bytes | str) -> Path:
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    return path


def _hf_dir(tmp_path: Path, *, config: str | None = None, weights: str = "ok") -> Path:
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(config if config is not None else json.dumps({"model_type": "llama"}))
    if weights == "ok":
        _safetensors(folder / "model.safetensors")
    elif weights == "truncated":
        _truncated(_safetensors(folder / "model.safetensors"))
    elif weights == "garbage":
        (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    return folder


def _run_dir(tmp_path: Path, damage: str) -> Path:
    from sinklens.sinklm.checkpoint import save_checkpoint
    from sinklens.sinklm.config import TrainConfig
    from sinklens.sinklm.model import SinkLM
    from sinklens.sinklm.config import ModelConfig

    cfg = TrainConfig.from_dict({**TrainConfig().to_dict(), "model": ModelConfig.from_preset("tiny").to_dict()})
    run = save_checkpoint(tmp_path / "run", model=SinkLM(cfg.model), optimizer=None, cfg=cfg, step=0)
    if damage == "weights":
        _truncated(run / "model.safetensors")
    elif damage == "config":
        _write(run / "config.json", '{"model": {"n_layers": "two"}}')
    return run


FILE_ROWS = [
    # (id, make(tmp_path) -> spec, error, words)
    ("empty-gguf", lambda t: _write(t / "m.gguf", b""), CorruptFileError, ["m.gguf", "empty"]),
    ("not-gguf-magic", lambda t: _write(t / "m.gguf", b"PK\x03\x04" * 10), CorruptFileError,
     ["m.gguf", "magic"]),
    ("gguf-bad-version", lambda t: _write(t / "m.gguf", b"GGUF" + struct.pack("<I", 99) + bytes(16)),
     CorruptFileError, ["m.gguf", "99"]),
    ("truncated-gguf-header", lambda t: _write(t / "m.gguf", b"GGUF\x03\x00"), CorruptFileError,
     ["m.gguf"]),
    ("gguf-header-without-tensors", lambda t: _gguf_header(t / "m.gguf", b"\x00" * 7), CorruptFileError, ["m.gguf"]),
    ("truncated-safetensors-dir", lambda t: _hf_dir(t, weights="truncated"), CorruptFileError,
     ["model.safetensors", "truncated"]),
    ("garbage-safetensors-dir", lambda t: _hf_dir(t, weights="garbage"), CorruptFileError, ["model.safetensors"]),
    ("bad-config-json", lambda t: _hf_dir(t, config="{not json"), CorruptFileError, ["config.json"]),
    ("unsupported-architecture", lambda t: _hf_dir(t, config=json.dumps({"model_type": "no-such-arch"})),
     UnsupportedArchitectureError, ["hf"]),
    ("safetensors-file-as-spec", lambda t: _safetensors(t / "w.safetensors"), InvalidArgumentError, ["w.safetensors", "folder"]),
    ("truncated-safetensors-file", lambda t: _truncated(_safetensors(t / "w.safetensors")), CorruptFileError,
     ["w.safetensors", "truncated"]),
    ("text-file-as-spec", lambda t: _write(t / "notes.txt", "hi"), InvalidArgumentError, ["notes.txt"]),
    ("folder-without-config", lambda t: t, InvalidArgumentError, ["config.json"]),
    ("run-truncated-weights", lambda t: _run_dir(t, "weights"), CorruptFileError, ["model.safetensors", "truncated"]),
    ("run-damaged-config", lambda t: _run_dir(t, "config"), UnsupportedArchitectureError, ["run"]),
]


@pytest.mark.parametrize(("make", "error", "words"), [r[1:] for r in FILE_ROWS], ids=[r[0] for r in FILE_ROWS])
def test_corrupt_model_files(tmp_path, monkeypatch, make, error, words):
    monkeypatch.setenv("SINKLENS_CACHE", str(tmp_path / "cache"))
    spec = make(tmp_path)
    _raises_naming(error, words, loading.load_model, str(spec), device="cpu")


def test_safetensors_checks_accept_a_whole_file(tmp_path):
    check_safetensors(_safetensors(tmp_path / "ok.safetensors"))  # no error
    check_gguf(_gguf_header(tmp_path / "ok.gguf"))


class _FakeConversion:
    """Stands in for the 40 s dequantisation: writes a small model folder and counts the calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, gguf_path: Path, out: Path) -> Path:
        self.calls += 1
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
        _safetensors(out / "model.safetensors")
        write_manifest(out)
        return out


@pytest.fixture
def fake_conversion(tmp_path, monkeypatch):
    monkeypatch.setenv("SINKLENS_CACHE", str(tmp_path / "cache"))
    fake = _FakeConversion()
    monkeypatch.setattr(model_files, "_convert", fake)
    return fake


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda out: _flip_a_byte(out / "model.safetensors"), "sha256"),
        (lambda out: _truncated(out / "model.safetensors"), "bytes"),
        (lambda out: (out / "model.safetensors").unlink(), "missing"),
        (lambda out: (out / MANIFEST).write_text("{"), "manifest"),
        (lambda out: (out / MANIFEST).unlink(), "no manifest"),
    ],
    ids=["flipped-byte", "truncated", "deleted", "bad-manifest", "no-manifest"],
)
def test_broken_converted_cache_is_detected_and_rebuilt(tmp_path, fake_conversion, capsys, damage, words):
    gguf = _gguf_header(tmp_path / "m.gguf")
    out = model_files.convert_gguf(gguf)
    assert fake_conversion.calls == 1 and verify_manifest(out) is None
    assert model_files.convert_gguf(gguf) == out and fake_conversion.calls == 1  # a whole cache is reused
    damage(out)
    assert verify_manifest(out) is not None
    assert model_files.convert_gguf(gguf) == out
    assert fake_conversion.calls == 2 and verify_manifest(out) is None
    err = capsys.readouterr().err
    assert "rebuilding" in err and words in err


# ---------------------------------------------------------------------------------------------------
# Inputs: prompts, token ids, lengths, batch sizes
# ---------------------------------------------------------------------------------------------------


def _bad_batch():
    return TokenBatch(torch.tensor([[0, 5, 99]]), torch.ones(1, 3, dtype=torch.bool), True)


def _unchecked(fn):
    """``fn`` without the pytest-only jaxtyping/beartype wrapper: what a user's call runs into."""
    return inspect.unwrap(fn)


as_batches_, tokenize_prompts_ = _unchecked(as_batches), _unchecked(tokenize_prompts)
random_token_batches_, stdlib_text_prompts_ = _unchecked(random_token_batches), _unchecked(stdlib_text_prompts)


INPUT_ROWS = [
    # (id, call(model), error, words)
    ("max-length-zero", lambda m: as_batches_(m, ["t2 t3"], max_length=0), InvalidArgumentError, ["max_length", "0"]),
    ("max-length-negative", lambda m: as_batches_(m, ["t2 t3 t4"], max_length=-1), InvalidArgumentError,
     ["max_length", "-1"]),
    ("max-length-float", lambda m: as_batches_(m, ["t2"], max_length=2.5), InvalidArgumentError, ["max_length", "2.5"]),
    ("max-length-string", lambda m: as_batches_(m, ["t2"], max_length="8"), InvalidArgumentError, ["max_length", "'8'"]),
    ("batch-size-zero", lambda m: as_batches_(m, ["t2"], batch_size=0), InvalidArgumentError, ["batch_size", "0"]),
    ("batch-size-negative", lambda m: tokenize_prompts_(m, ["t2"], batch_size=-3), InvalidArgumentError,
     ["batch_size", "-3"]),
    ("batch-size-bool", lambda m: as_batches_(m, ["t2"], batch_size=True), InvalidArgumentError, ["batch_size", "True"]),
    ("batch-size-float-tensor", lambda m: as_batches_(m, ["t2"], batch_size=torch.tensor(2.0)), InvalidArgumentError,
     ["batch_size", "float32"]),
    ("prepend-bos-string", lambda m: as_batches_(m, ["t2"], prepend_bos="yes"), InvalidArgumentError,
     ["prepend_bos", "'yes'"]),
    ("mixed-prompts-str-first", lambda m: as_batches_(m, ["t2 t3", 3]), InvalidArgumentError, ["prompts[1]", "3"]),
    ("mixed-prompts-int-first", lambda m: as_batches_(m, [3, "t2"]), InvalidArgumentError, ["inputs[0]", "int"]),
    ("prompts-with-none", lambda m: tokenize_prompts_(m, ["t2", None]), InvalidArgumentError, ["prompts[1]", "None"]),
    ("empty-list", lambda m: as_batches_(m, []), InvalidArgumentError, ["No prompts"]),
    ("prompt-tokenising-to-nothing", lambda m: tokenize_prompts_(m, ["   "], prepend_bos=False), InvalidArgumentError,
     ["'   '"]),
    ("prompt-tokenising-to-nothing-after-bos", lambda m: tokenize_prompts_(m, ["t2", "   "]), InvalidArgumentError,
     ["'   '", "no tokens"]),
    ("dict-input", lambda m: as_batches_(m, {"text": "t2"}), InvalidArgumentError, ["dict"]),
    ("int-input", lambda m: as_batches_(m, 5), InvalidArgumentError, ["int"]),
    ("token-id-equal-to-vocab", lambda m: as_batches_(m, torch.tensor([[0, 5, 64]])), InvalidArgumentError,
     ["64", "0..63"]),
    ("token-id-negative", lambda m: as_batches_(m, torch.tensor([[0, -1, 3]])), InvalidArgumentError, ["-1", "0..63"]),
    ("token-id-huge", lambda m: as_batches_(m, torch.tensor([0, 3, 10**9])), InvalidArgumentError, ["1000000000"]),
    ("token-batch-oov", lambda m: as_batches_(m, _bad_batch()), InvalidArgumentError, ["99", "0..63"]),
    ("token-batch-list-oov", lambda m: as_batches_(m, [_bad_batch()]), InvalidArgumentError, ["99"]),
    ("float-token-tensor", lambda m: as_batches_(m, torch.tensor([[0.0, 1.0]])), InvalidArgumentError, ["float32"]),
    ("bool-token-tensor", lambda m: as_batches_(m, torch.tensor([[True, False]])), InvalidArgumentError, ["bool"]),
    ("3d-token-tensor", lambda m: as_batches_(m, torch.zeros(1, 2, 3, dtype=torch.long)), InvalidArgumentError,
     ["(1, 2, 3)"]),
    ("empty-token-tensor", lambda m: as_batches_(m, torch.zeros(1, 0, dtype=torch.long)), InvalidArgumentError,
     ["empty", "(1, 0)"]),
    ("token-tensor-too-long", lambda m: as_batches_(m, torch.zeros(1, 65, dtype=torch.long)), InvalidArgumentError,
     ["65", "64"]),
    ("prompt-too-long", lambda m: as_batches_(m, [" ".join(["t2"] * 80)]), InvalidArgumentError, ["81", "max_length"]),
    ("random-n-zero", lambda m: random_token_batches_(m, n_sequences=0), InvalidArgumentError, ["n_sequences", "0"]),
    ("random-seq-len-zero", lambda m: random_token_batches_(m, seq_len=0), InvalidArgumentError, ["seq_len", "0"]),
    ("random-seq-len-too-long", lambda m: random_token_batches_(m, seq_len=65), InvalidArgumentError, ["65"]),
    ("random-batch-size-zero", lambda m: random_token_batches_(m, batch_size=0), InvalidArgumentError, ["batch_size"]),
    ("random-seed-float", lambda m: random_token_batches_(m, seed=0.5), InvalidArgumentError, ["seed", "0.5"]),
    ("stdlib-zero", lambda m: stdlib_text_prompts_(0), InvalidArgumentError, ["n_prompts", "0"]),
    ("stdlib-negative", lambda m: stdlib_text_prompts_(-2), InvalidArgumentError, ["n_prompts", "-2"]),
]


@pytest.mark.parametrize(("call", "error", "words"), [r[1:] for r in INPUT_ROWS], ids=[r[0] for r in INPUT_ROWS])
def test_bad_inputs(tiny_llama, call, error, words):
    _raises_naming(error, words, call, tiny_llama)


def test_run_options_device_is_one_this_machine_has_and_the_model_runs_on(no_gpu, tiny_llama):
    from sinklens import find_sinks
    from sinklens.options import RunOptions

    with pytest.raises(InvalidArgumentError, match=r"device 'cuda' needs a CUDA GPU, and this machine has none"):
        RunOptions(device="cuda")
    with pytest.raises(InvalidArgumentError, match=r"Unknown device 'tpu'"):
        RunOptions(device="tpu")
    elsewhere = copy.deepcopy(tiny_llama).to("meta")
    with pytest.raises(InvalidArgumentError, match=r"RunOptions\(device='cpu'\), but the model runs on meta: move it first"):
        find_sinks(elsewhere, "t2 t3", options=RunOptions(device="cpu", progress=False))
    checked = find_sinks(tiny_llama, "t2 t3 t4", options=RunOptions(device="cpu", progress=False))
    assert torch.equal(checked.received, find_sinks(tiny_llama, "t2 t3 t4", options=RunOptions(progress=False)).received)


@pytest.mark.parametrize("where", ["find_sinks", "run", "final_hidden_states"])
def test_options_that_are_not_run_options_are_refused_by_name(tiny_llama, where):
    import sinklens
    from sinklens.origins.fingerprint import final_hidden_states

    call = {
        "find_sinks": lambda o: _unchecked(sinklens.find_sinks)(tiny_llama, "t2 t3", options=o),
        "run": lambda o: _unchecked(sinklens.run)(tiny_llama, "t2 t3", options=o),
        "final_hidden_states": lambda o: _unchecked(final_hidden_states)(tiny_llama, n_samples=4, seq_len=4, options=o),
    }[where]
    with pytest.raises(InvalidArgumentError, match=rf"{where}\(options=\.\.\.\) takes a sinklens\.RunOptions, got dict "
                                                   r"\{'batch_size': 2\}; pass options=RunOptions\(\*\*\{'batch_size': 2\}\)"):
        call({"batch_size": 2})


@pytest.mark.parametrize("hooks", [3, "blocks.0.hook_resid_pre", [("blocks.0.hook_resid_pre",)]])
def test_patch_sink_refuses_hooks_that_are_not_hook_pairs_by_name(tiny_llama, hooks):
    """``patch_sink(model, tokens, 3)`` ended in ``TypeError: 'int' object is not iterable``."""
    from sinklens.interventions import patch_sink

    with pytest.raises(InvalidArgumentError, match=r"hooks(\[0\])? must be a (list of )?\(hook_name, fn\) pair"):
        _unchecked(patch_sink)(tiny_llama, torch.tensor([[1, 2, 3, 4]]), hooks)


@pytest.mark.parametrize("where", ["contraction", "token_preference", "positional_discrepancy", "find_sinks"])
def test_settings_of_the_wrong_type_are_refused_by_name(tiny_llama, where):
    """``contraction(model, 64)`` meant ``n_sequences=64``: the error names the parameter and its type."""
    import sinklens

    if where == "find_sinks":
        call = lambda: _unchecked(sinklens.find_sinks)(tiny_llama, "t2 t3", settings={"sink_threshold": 0.5})  # noqa: E731
        words = r"find_sinks: settings= must be a SinkSettings, got dict \{'sink_threshold': 0\.5\}; pass its fields as keywords"
    else:
        call = lambda: _unchecked(getattr(sinklens.origins, where))(tiny_llama, 64)  # noqa: E731
        words = rf"{where}: random= must be a RandomInputs, got int 64; pass its fields as keywords instead \(e\.g\. n_sequences=\.\.\.\)"
    with pytest.raises(InvalidArgumentError, match=words):
        call()


def test_numpy_and_tensor_scalars_are_numbers(tiny_llama):
    """numpy integers and 0-d integer tensors are accepted wherever an int is."""
    batches = as_batches(tiny_llama, ["t2 t3 t4 t5", "t6 t7", "t8"], batch_size=np.int64(2), max_length=torch.tensor(3))
    assert [b.tokens.shape for b in batches] == [(2, 3), (1, 2)]
    rand = random_token_batches(tiny_llama, n_sequences=np.int32(3), seq_len=torch.tensor(5), batch_size=np.uint8(2))
    assert [b.tokens.shape for b in rand] == [(2, 5), (1, 5)]


def test_max_length_truncates_from_the_end_only_when_positive(tiny_llama):
    (batch,) = as_batches(tiny_llama, ["t2 t3 t4 t5 t6"], max_length=3)
    assert batch.tokens.tolist() == [[0, 2, 3]]  # BOS + the first two words


def test_int_token_dtypes_other_than_long_are_accepted(tiny_llama):
    (batch,) = as_batches(tiny_llama, torch.tensor([[0, 5, 63]], dtype=torch.int16))
    assert batch.tokens.dtype == torch.long and batch.tokens.tolist() == [[0, 5, 63]]


def test_text_needs_a_tokenizer():
    from sinklens.testing import tiny_model

    model = tiny_model(d_vocab=32)
    model.tokenizer = None
    with pytest.raises(InvalidArgumentError, match="no tokenizer"):
        as_batches(model, ["t2 t3"])
    with pytest.raises(InvalidArgumentError, match="no tokenizer"):
        bos_token_id(model)
    # random tokens still work, and position 0 is token 0 when no tokenizer names a BOS
    (batch,) = random_token_batches(model, n_sequences=2, seq_len=4, prepend_bos=True)
    assert batch.tokens[:, 0].tolist() == [0, 0]


class _Tok:
    """A stand-in tokenizer with BERT-like special tokens."""

    def __init__(self, bos, cls, unk, specials):
        self.bos_token_id, self.cls_token_id, self.unk_token_id, self.all_special_ids = bos, cls, unk, specials
        self.bos_token = "[UNK]" if bos == unk else None


class _M:
    def __init__(self, tok):
        self.tokenizer = tok


@pytest.mark.parametrize(
    ("tok", "expected"),
    [
        (_Tok(bos=100, cls=101, unk=100, specials=[0, 100, 101, 102]), 101),  # BERT bridge: BOS is [UNK] -> [CLS]
        (_Tok(bos=None, cls=101, unk=100, specials=[100, 101]), 101),  # no BOS -> [CLS]
        (_Tok(bos=1, cls=None, unk=0, specials=[0, 1, 2]), 1),  # a real BOS
    ],
    ids=["bos-is-unk-uses-cls", "no-bos-uses-cls", "real-bos"],
)
def test_bos_is_a_real_special_token(tok, expected):
    assert bos_token_id(_M(tok)) == expected


def test_bos_that_is_the_unknown_token_is_refused():
    with pytest.raises(InvalidArgumentError, match=r"\[UNK\].*unknown token.*prepend_bos=False"):
        bos_token_id(_M(_Tok(bos=100, cls=None, unk=100, specials=[100])))


# ---------------------------------------------------------------------------------------------------
# Prompt files and output folders
# ---------------------------------------------------------------------------------------------------

TEXT_FILE_ROWS = [
    ("missing", lambda t: t / "missing.txt", ["missing.txt", "does not exist"]),
    ("folder", lambda t: t, ["is a folder"]),
    ("binary", lambda t: _write(t / "b.bin", b"\x00\x01\x02ab"), ["b.bin", "binary"]),
    ("not-utf8", lambda t: _write(t / "l.txt", "caf\xe9\n".encode("latin-1")),
     ["l.txt", "not UTF-8", "0xe9"]),
    ("empty", lambda t: _write(t / "e.txt", ""), ["e.txt", "no non-empty lines"]),
    ("blank-lines", lambda t: _write(t / "w.txt", "\n  \n\t\n"), ["w.txt", "no non-empty lines"]),
    ("empty-path", lambda t: "", ["empty"]),
]


@pytest.mark.parametrize(("make", "words"), [r[1:] for r in TEXT_FILE_ROWS], ids=[r[0] for r in TEXT_FILE_ROWS])
def test_bad_prompt_files(tmp_path, make, words):
    _raises_naming(InvalidArgumentError, words, validate.text_lines, make(tmp_path), what="--prompts")


def test_prompt_file_lines_are_stripped(tmp_path):
    (tmp_path / "p.txt").write_text("  first  \n\nsecond\n")
    assert validate.text_lines(tmp_path / "p.txt", what="--prompts") == ["first", "second"]


WRITABLE_ROWS = [
    ("empty", lambda t: "", ["empty"]),
    ("is-a-file", lambda t: _write(t / "f", "x"), ["is not a folder"]),
    ("under-a-file", lambda t: _write(t / "f", "x") / "sub", ["cannot be created"]),
]


@pytest.mark.parametrize(("make", "words"), [r[1:] for r in WRITABLE_ROWS], ids=[r[0] for r in WRITABLE_ROWS])
def test_unwritable_output_folders(tmp_path, make, words):
    _raises_naming(OutputNotWritableError, words, validate.writable_dir, make(tmp_path), what="--out")


# ---------------------------------------------------------------------------------------------------
# Validators and the exit-code mapping
# ---------------------------------------------------------------------------------------------------

VALIDATOR_ROWS = [
    ("as-int-bool", lambda: validate.as_int(True, what="n"), ["n", "True"]),
    ("as-int-float", lambda: validate.as_int(1.5, what="n"), ["n", "1.5"]),
    ("as-int-vector", lambda: validate.as_int(torch.tensor([1, 2]), what="n"), ["n", "(2,)"]),
    ("positive-int-zero", lambda: validate.positive_int(np.int64(0), what="n"), ["n", ">= 1", "0"]),
    ("as-float-string", lambda: validate.as_float("1.0", what="alpha"), ["alpha", "'1.0'"]),
    ("finite-inf", lambda: validate.finite_number(np.float32("inf"), what="alpha"), ["alpha", "inf"]),
    ("as-bool-int", lambda: validate.as_bool(1, what="flag"), ["flag", "1"]),
    ("prompt-list-number", lambda: validate.prompt_list(3.5), ["float"]),
    ("prompt-list-mixed", lambda: validate.prompt_list(["a", 3]), ["prompts[1] must be a string like the others", "3 (int)"]),
    ("token-ids-list", lambda: validate.token_ids([1, 2], 10), ["list"]),
    ("token-ids-oov", lambda: validate.token_ids(torch.tensor([[1, 2], [3, 10]]), 10), ["10", "0..9", "[1, 1]"]),
    ("dtype-none-string", lambda: validate.dtype("", what="dtype"), ["''"]),
    ("device-empty", lambda: validate.device("", what="--device"), ["--device", "''"]),
    ("device-int", lambda: validate.device(3, what="device"), ["device", "3"]),
    ("choice-typo", lambda: validate.choice("mena", ["mean", "max"], what="reduce"), ["'mena'", "Did you mean 'mean'"]),
]


@pytest.mark.parametrize("call, words", [r[1:] for r in VALIDATOR_ROWS], ids=[r[0] for r in VALIDATOR_ROWS])
def test_validators(call, words):
    _raises_naming(InvalidArgumentError, words, call)


def test_validators_accept_numpy_and_tensor_scalars():
    assert validate.as_int(np.int16(4), what="n") == 4 and validate.as_int(torch.tensor(4), what="n") == 4
    assert validate.as_float(np.float32(0.5), what="x") == 0.5 and validate.as_float(torch.tensor(0.5), what="x") == 0.5
    assert validate.positive_int(torch.tensor(3, dtype=torch.int32), what="n") == 3
    assert validate.dtype("bf16") is torch.bfloat16 and validate.dtype(torch.float16) is torch.float16
    assert validate.device("CPU") == torch.device("cpu")
    assert validate.index_list([0, -1, 3], 4, what="layer") == [0, 3]  # negatives from the end, repeats dropped
    assert validate.token_ids(torch.tensor([0, 5, 9]), 10).shape == (1, 3)  # a 1-D tensor gains a batch axis


def _caught(call, kind: type[BaseException]):
    """``lambda: the exception of type kind that call() raises`` (a real, raised-and-caught instance)."""

    def make() -> BaseException:
        try:
            call()
        except kind as err:
            return err
        raise AssertionError(f"{call} raised no {kind.__name__}")

    return make


def _bad_optim_config():
    from sinklens.sinklm.config import OptimConfig

    OptimConfig(lr=-1.0)


_raised_in_sinklens = _caught(_bad_optim_config, ValueError)
_raised_in_torch = _caught(lambda: torch.zeros(2).view(3), RuntimeError)
_raised_in_numpy = _caught(lambda: np.zeros(2).reshape(3), ValueError)
_json_error = _caught(lambda: json.loads("{"), ValueError)


EXIT_ROWS = [
    ("invalid-argument", lambda: InvalidArgumentError("x"), EXIT_USAGE),
    ("not-found", lambda: NotFoundError("x"), EXIT_USAGE),  # a FileNotFoundError, i.e. an OSError
    ("unsupported-architecture", lambda: UnsupportedArchitectureError("x"), EXIT_USAGE),
    ("output-exists", lambda: OutputExistsError("x"), EXIT_USAGE),  # a FileExistsError, i.e. an OSError
    ("output-not-writable", lambda: OutputNotWritableError("x"), EXIT_USAGE),
    ("config-value-error", _raised_in_sinklens, EXIT_USAGE),
    ("config-json-syntax", _json_error, EXIT_USAGE),
    ("offline", lambda: OfflineError("x"), EXIT_FAILURE),
    ("corrupt-file", lambda: CorruptFileError("x"), EXIT_FAILURE),
    ("training-diverged", lambda: TrainingDivergedError("x"), EXIT_FAILURE),
    ("os-error", lambda: PermissionError(13, "Permission denied", "/x"), EXIT_FAILURE),
    ("torch-runtime-error", _raised_in_torch, EXIT_FAILURE),
    ("numpy-value-error", _raised_in_numpy, EXIT_FAILURE),
    ("key-error", lambda: KeyError("k"), EXIT_FAILURE),
    ("keyboard-interrupt", lambda: KeyboardInterrupt(), EXIT_INTERRUPTED),
]


@pytest.mark.parametrize(("make", "code"), [r[1:] for r in EXIT_ROWS], ids=[r[0] for r in EXIT_ROWS])
def test_exit_code_mapping(make, code):
    assert exit_code_for(make()) == code


# ---------------------------------------------------------------------------------------------------
# Test utilities: no global seeding, no leaked folders
# ---------------------------------------------------------------------------------------------------


def test_tiny_model_leaves_the_global_rng_state_unchanged():
    from sinklens.testing import tiny_model

    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    before = (torch.get_rng_state().clone(), random.getstate(), np.random.get_state()[1].copy())
    a = tiny_model(d_vocab=32, seed=3)
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1]
    assert np.array_equal(np.random.get_state()[1], before[2])
    b = tiny_model(d_vocab=32, seed=3)  # still deterministic in its seed
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name


def test_tiny_model_leaks_no_temporary_folders(tmp_path):
    """Every tokenizer file lives in one folder per process, and that folder is gone after exit."""
    import subprocess
    import sys

    code = (
        "from sinklens.testing import tiny_model, word_tokenizer\n"
        "from sinklens.testing.models import tokenizer_root\n"
        "tiny_model(d_vocab=24); tiny_model(d_vocab=24); word_tokenizer(40)\n"
        "print(tokenizer_root())\n"
    )
    env = {**__import__("os").environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    root = Path(done.stdout.strip().splitlines()[-1])
    assert root.parent == tmp_path
    assert list(tmp_path.iterdir()) == []  # removed at exit, nothing else written
