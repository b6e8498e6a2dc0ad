"""Integrity checks for model files on disk: GGUF headers, safetensors headers, and the sha256
manifest of a converted-model cache.

Every check reads headers and sizes only (cheap), except :func:`verify_manifest`, which hashes
every file of a cached directory (about 0.5 s per GB) so that a cache broken by a crash, a full
disk or a stray edit is found and rebuilt instead of crashing deep inside ``safetensors``.
Problems raise :class:`~sinklens.errors.CorruptModelFileError` naming the file and what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from sinklens.errors import CorruptModelFileError

#: File name of the manifest written into a converted-model folder after the conversion.
MANIFEST = "sinklens-manifest.json"
GGUF_MAGIC = b"GGUF"


def check_gguf(path: str | Path) -> None:
    """Raise unless ``path`` starts like a GGUF file (magic ``GGUF``, version 1..3, a 24-byte header)."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != GGUF_MAGIC:
        what = "is empty" if not head else f"does not start with the GGUF magic bytes (found {head[:4]!r})"
        raise CorruptModelFileError(f"{str(path)!r} is not a valid GGUF file: it {what} ({path.stat().st_size} bytes).")
    version = struct.unpack("<I", head[4:8])[0]
    if not 1 <= version <= 3:
        raise CorruptModelFileError(f"{str(path)!r} has an unknown GGUF version {version} (expected 1..3).")


def check_safetensors(path: str | Path) -> None:
    """Raise unless ``path`` is a whole safetensors file: an 8-byte header length, a JSON header,
    and at least as many bytes as the header's largest tensor offset (so truncation is found)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CorruptModelFileError(f"{str(path)!r} is truncated: {size} bytes, shorter than a safetensors header.")
        n = struct.unpack("<Q", raw)[0]
        if n > min(size - 8, 100_000_000):
            raise CorruptModelFileError(f"{str(path)!r} is not a valid safetensors file: header length {n} "
                                        f"does not fit in its {size} bytes.")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise CorruptModelFileError(f"{str(path)!r} is not a valid safetensors file: its header is not JSON.") from None
    if not isinstance(header, dict):
        raise CorruptModelFileError(f"{str(path)!r} is not a valid safetensors file: its header is not a JSON object.")
    end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)
               and "data_offsets" in t), default=0)
    if size < 8 + n + end:
        raise CorruptModelFileError(f"{str(path)!r} is truncated: {size} bytes, but its header needs {8 + n + end}.")


def check_model_dir(folder: str | Path) -> None:
    """Check a Hugging Face model folder: ``config.json`` parses and every ``*.safetensors`` is whole."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise CorruptModelFileError(f"{str(folder / 'config.json')!r} is not valid JSON.") from None
    check_config_fields(config, str(folder / "config.json"))
    for file in sorted(folder.glob("*.safetensors")):
        check_safetensors(file)


#: Size fields of a Hugging Face ``config.json`` (each family's spelling) that must be whole numbers >= 1.
SIZE_FIELDS = ("num_hidden_layers", "n_layer", "hidden_size", "n_embd", "num_attention_heads", "n_head",
               "num_key_value_heads", "intermediate_size", "vocab_size", "head_dim")


def check_config_fields(config: object, where: str) -> None:
    """Raise :class:`CorruptModelFileError` naming the field when a Hugging Face ``config`` (the parsed ``where``)
    is not a JSON object, sets a size (:data:`SIZE_FIELDS`) that is not a whole number >= 1, or splits
    ``hidden_size`` or the attention heads unevenly (without an explicit ``head_dim``)."""
    if not isinstance(config, dict):
        raise CorruptModelFileError(f"{where!r} is not a JSON object.")
    for name in SIZE_FIELDS:
        value = config.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise CorruptModelFileError(f"{where!r} sets {name}={value!r}; it must be a whole number >= 1.")
    width = config.get("hidden_size", config.get("n_embd"))
    heads = config.get("num_attention_heads", config.get("n_head"))
    kv_heads = config.get("num_key_value_heads")
    if width and heads and config.get("head_dim") is None and width % heads:
        raise CorruptModelFileError(f"{where!r} sets hidden_size={width}, not divisible by num_attention_heads={heads}.")
    if heads and kv_heads and heads % kv_heads:
        raise CorruptModelFileError(f"{where!r} sets num_attention_heads={heads}, not divisible by "
                                    f"num_key_value_heads={kv_heads}.")


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of the file at ``path``, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_mismatch(path: Path, size: int, sha256: str) -> str | None:
    """What is wrong with ``path`` against the size and SHA-256 a manifest recorded for it: missing,
    another size (truncated?) or another checksum; None when it matches."""
    if not path.is_file():
        return f"{path} is missing"
    if path.stat().st_size != size:
        return f"{path} has {path.stat().st_size} bytes, the manifest says {size} (truncated?)"
    actual = sha256_file(path)
    if actual != sha256:
        return f"{path} fails its SHA-256 checksum: sha256 {actual[:12]}..., the manifest says {str(sha256)[:12]}..."
    return None


def write_manifest(folder: str | Path) -> Path:
    """Record size and sha256 of every file in ``folder`` (not recursing) in ``folder/MANIFEST``."""
    from sinklens.export import write_json

    folder = Path(folder)
    files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    return write_json(folder / MANIFEST, {"format": 1, "files": files})


def verify_manifest(folder: str | Path) -> str | None:
    """``None`` when every file listed in the manifest is present with its size and sha256, else the
    first problem found (a missing manifest included)."""
    folder = Path(folder)
    try:
        files = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))["files"]
    except FileNotFoundError:
        return "no manifest"
    except (ValueError, KeyError, TypeError, OSError):
        return "the manifest is unreadable"
    for name, entry in files.items():
        problem = file_mismatch(folder / name, entry["size"], entry["sha256"])
        if problem is not None:
            return problem
    return None
