"""Training data: synthetic sink tasks, local text, nanoGPT memmaps and Hugging Face datasets. ``source.batch(split,
step, n)`` draws ``n`` sequences of ``seq_len + 1`` tokens from a generator seeded by ``(data.seed, split, step)``
only: the same data config gives the same batches, and a resume needs no data state."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from sinklens.errors import InvalidArgumentError, NotFoundError, OfflineError
from sinklens.sinklm.config import DataConfig
from sinklens.validate import refuse_binary

Split = Literal["train", "val"]


def _generator(seed: int, split: str, step: int) -> torch.Generator:
    mixed = hashlib.sha256(f"{seed}/{split}/{step}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(mixed[:8], "little") & ((1 << 63) - 1))


class TokenSource:
    """A deterministic sampler of ``[n, seq_len + 1]`` token sequences, ``bos_id`` at position 0 (None: raw
    windows), ``tokenizer`` for text sources."""

    seq_len: int
    seed: int
    vocab_size: int
    bos_id: int | None = None
    tokenizer: Any = None

    def batch(self, split: Split, step: int, n: int) -> Int[Tensor, "batch seq_plus_1"]:
        return self._sample(_generator(self.seed, split, step), split, n)

    def _sample(self, gen: torch.Generator, split: Split, n: int) -> Tensor:
        raise NotImplementedError


class MarkovSource(TokenSource):
    """A first-order Markov chain over tokens ``1..V-1``: ``x_0 = BOS = 0``, ``x_{t+1} ~ transition[x_t]``, rows
    drawn from ``Dirichlet(alpha)``."""

    def __init__(self, *, vocab_size: int, seq_len: int, seed: int, alpha: float = 0.1, task_seed: int = 0):
        if vocab_size < 3:
            raise ValueError(f"A Markov task needs vocab_size >= 3 (BOS + 2 tokens), got {vocab_size}.")
        self.vocab_size, self.seq_len, self.seed, self.bos_id = vocab_size, seq_len, seed, 0
        self._task_rng = np.random.default_rng(task_seed)
        draws = torch.from_numpy(self._task_rng.dirichlet(np.full(vocab_size - 1, float(alpha)), size=vocab_size))
        transition = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)
        transition[:, 1:] = draws / draws.sum(dim=1, keepdim=True)
        self.transition: Float[Tensor, "vocab vocab"] = transition
        self._cdf = transition.cumsum(dim=1)
        self._cdf[:, -1] = 1.0

    def _next(self, x: Tensor, t: int, gen: torch.Generator) -> Tensor:
        u = torch.rand(x.shape[0], generator=gen, dtype=torch.float64)
        return torch.searchsorted(self._cdf[x[:, t]], u[:, None]).squeeze(1).clamp(1, self.vocab_size - 1)

    def _sample(self, gen: torch.Generator, split: Split, n: int) -> Tensor:
        x = torch.zeros(n, self.seq_len + 1, dtype=torch.long)
        x[:, 0] = self.bos_id
        x[:, 1] = torch.randint(1, self.vocab_size, (n,), generator=gen)
        for t in range(1, self.seq_len):
            x[:, t + 1] = self._next(x, t, gen)
        return x


class BackcopySource(MarkovSource):
    """Bigram-backcopy (Guo et al. 2024): the Markov chain, but after a trigger ``x_{t+1} = x_{t-1}`` (``t >= 2``)."""

    def __init__(self, *, vocab_size: int, seq_len: int, seed: int, n_triggers: int = 3, alpha: float = 0.1, task_seed: int = 0):
        super().__init__(vocab_size=vocab_size, seq_len=seq_len, seed=seed, alpha=alpha, task_seed=task_seed)
        if not 0 <= n_triggers < vocab_size - 1:
            raise InvalidArgumentError(f"data.n_triggers={n_triggers} needs a vocabulary of at least {n_triggers + 2} "
                                       f"tokens (BOS, the triggers and one other), got {vocab_size} (data.vocab_size, or "
                                       "model.d_vocab when it is unset); lower data.n_triggers or raise the vocabulary.")
        self.triggers: Int[Tensor, " n_triggers"] = torch.from_numpy(self._task_rng.permutation(vocab_size - 1)[:n_triggers] + 1)
        self.is_trigger: Bool[Tensor, " vocab"] = torch.zeros(vocab_size, dtype=torch.bool)
        self.is_trigger[self.triggers] = True

    def _next(self, x: Tensor, t: int, gen: torch.Generator) -> Tensor:
        sampled = super()._next(x, t, gen)
        return sampled if t < 2 else torch.where(self.is_trigger[x[:, t]], x[:, t - 1], sampled)


class StreamSource(TokenSource):
    """Random windows of a train / val token stream: ``[BOS] + stream[i : i + seq_len]``, or
    ``stream[i : i + seq_len + 1]`` without ``bos_id``."""

    def __init__(self, train: np.ndarray, val: np.ndarray, *, seq_len: int, seed: int, vocab_size: int,
                 bos_id: int | None, tokenizer: Any = None):
        self.streams = {"train": train, "val": val}
        self.seq_len, self.seed, self.vocab_size, self.bos_id, self.tokenizer = seq_len, seed, vocab_size, bos_id, tokenizer
        self.width = seq_len if bos_id is not None else seq_len + 1  # the tokens of a window
        for split, stream in self.streams.items():
            if len(stream) < self.width:
                raise ValueError(f"The {split} split has {len(stream)} tokens, fewer than one sequence of "
                                 f"{self.width}; use more data, a larger data.val_fraction, or a smaller data.seq_len.")

    def _sample(self, gen: torch.Generator, split: Split, n: int) -> Tensor:
        stream = self.streams[split]
        starts = torch.randint(0, len(stream) - self.width + 1, (n,), generator=gen).tolist()
        rows = np.stack([np.asarray(stream[s : s + self.width], dtype=np.int64) for s in starts])
        x = torch.from_numpy(rows)
        if self.bos_id is not None:
            x = torch.cat([torch.full((n, 1), self.bos_id, dtype=torch.long), x], dim=1)
        return x


def _split_docs(docs: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """Cut the concatenated documents at ``(1 - val_fraction)`` of their characters."""
    cut = int(sum(len(d) for d in docs) * (1 - val_fraction))
    train, val, seen = [], [], 0
    for doc in docs:
        if seen + len(doc) <= cut:
            train.append(doc)
        elif seen >= cut:
            val.append(doc)
        else:
            train.append(doc[: cut - seen])
            val.append(doc[cut - seen :])
        seen += len(doc)
    return train, val


def _encode(tokenizer: Any, docs: list[str]) -> np.ndarray:
    """Token ids of the documents, each followed by ``<|endoftext|>``."""
    encoded = tokenizer.backend_tokenizer.encode_batch(docs, add_special_tokens=False)
    ids = [i for enc in encoded for i in [*enc.ids, tokenizer.eos_token_id]]
    return np.asarray(ids, dtype=np.uint16 if len(tokenizer) <= 65536 else np.uint32)


def _tokenize_cached(cfg: DataConfig, key_parts: dict[str, Any], load_docs) -> tuple[np.ndarray, np.ndarray, Any]:
    """Tokenise documents once and cache ``train.npy``, ``val.npy`` and the tokenizer (a BPE trained on the train
    split only) by a content key."""
    from sinklens.sinklm.tokenizer import byte_tokenizer, load_tokenizer, train_bpe
    key_parts = {**key_parts, "tokenizer": cfg.tokenizer, "vocab_size": cfg.vocab_size, "val": cfg.val_fraction, "v": 1}
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
    root = cfg.cache_dir or os.environ.get("SINKLENS_CACHE") or Path.home() / ".cache" / "sinklens"
    folder = Path(root) / "data" / key
    if (folder / "val.npy").is_file():
        return np.load(folder / "train.npy"), np.load(folder / "val.npy"), load_tokenizer(str(folder / "tokenizer"))
    train_docs, val_docs = _split_docs(load_docs(), cfg.val_fraction)
    tokenizer = byte_tokenizer() if cfg.tokenizer == "byte" else train_bpe(train_docs, cfg.vocab_size or 1024)
    train, val = _encode(tokenizer, train_docs), _encode(tokenizer, val_docs)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    np.save(tmp / "train.npy", train)
    np.save(tmp / "val.npy", val)
    tokenizer.save_pretrained(str(tmp / "tokenizer"))
    (tmp / "key.json").write_text(json.dumps(key_parts, indent=1, default=str, allow_nan=False))
    try:
        tmp.rename(folder)
    except OSError:  # another process cached it first
        shutil.rmtree(tmp, ignore_errors=True)
    return train, val, tokenizer


def text_source(cfg: DataConfig) -> StreamSource:
    """Local text: a file, or the files matching ``cfg.glob`` under a folder (sorted), at most about
    ``cfg.max_tokens`` characters, tokenised (byte or BPE) and cached; non-UTF-8 bytes are replaced, with a warning."""
    path = Path(str(cfg.path)).expanduser()
    if not path.is_file() and not path.is_dir():
        raise NotFoundError(f"data.path {str(path)!r} is neither a text file nor a folder.")
    files = [path] if path.is_file() else sorted(p for p in path.glob(cfg.glob) if p.is_file())
    if not files:
        raise NotFoundError(f"No files match data.glob={cfg.glob!r} under {str(path)!r}.")
    before = itertools.accumulate((f.stat().st_size for f in files), initial=0)  # bytes of the files before each
    chosen = [f for f, seen in zip(files, before) if seen < cfg.max_tokens]
    for f in chosen:
        try:
            with open(f, "rb") as fh:
                head = fh.read(8192)
        except OSError as err:
            raise InvalidArgumentError(f"data file {str(f)!r} cannot be read: {err.strerror or err}.") from None
        refuse_binary(f, head, what="data",
                      give="UTF-8 text files (or narrow data.glob), or pre-tokenised ids as a nanoGPT .bin file")
    stamp = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in chosen]

    def load_docs() -> list[str]:
        docs, total, not_utf8 = [], 0, []
        for f in chosen:
            raw = f.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:  # e.g. the standard library's deliberately Latin-1 test modules
                not_utf8.append(f"{str(f)!r} is not UTF-8 text (byte {raw[err.start]:#04x} at offset {err.start})")
                text = raw.decode("utf-8", errors="replace")
            text = text[: cfg.max_tokens - total]
            total += len(text)
            if text:
                docs.append(text)
        if not_utf8:
            warnings.warn(f"{len(not_utf8)} data file(s) are not UTF-8 text; their undecodable bytes were replaced by "
                          f"U+FFFD: {'; '.join(not_utf8[:5])}{'; ...' if len(not_utf8) > 5 else ''}", stacklevel=2)
        return docs

    train, val, tokenizer = _tokenize_cached(cfg, {"files": stamp, "max": cfg.max_tokens}, load_docs)
    return StreamSource(train, val, seq_len=cfg.seq_len, seed=cfg.seed, vocab_size=len(tokenizer),
                        bos_id=tokenizer.bos_token_id if cfg.bos else None, tokenizer=tokenizer)


_MAX_ID_CHUNK = 1 << 24  # tokens read at a time when a .bin file's largest id is checked


def _open_bin(file: Path, *, what: str) -> np.memmap:
    """``file`` as a read-only uint16 memmap (nanoGPT's layout); refuses an empty file or a partial token."""
    size = file.stat().st_size
    if size == 0:
        raise NotFoundError(f"{what} {str(file)!r} is empty; a .bin file holds uint16 token ids (nanoGPT layout).")
    if size % 2:
        raise NotFoundError(f"{what} {str(file)!r} has {size} bytes, not a whole number of 2-byte uint16 token ids; "
                            "it is not a nanoGPT .bin file (or it is truncated).")
    return np.memmap(file, dtype=np.uint16, mode="r")


def _max_id(tokens: np.ndarray) -> int:
    """The largest id in a token array, read in chunks (a memmap is never loaded whole)."""
    return max((int(tokens[i : i + _MAX_ID_CHUNK].max()) for i in range(0, len(tokens), _MAX_ID_CHUNK)), default=0)


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles plain data only: any class or function is refused, so a crafted ``meta.pkl`` cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names {module}.{name}, and only plain data is read")


def _meta_vocab_size(path: Path) -> int:
    """``vocab_size`` of nanoGPT's ``meta.pkl`` at ``path``, read without running code."""
    try:
        with open(path, "rb") as fh:
            meta = _PlainUnpickler(fh).load()
        return int(meta["vocab_size"])
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError, IndexError) as err:
        raise InvalidArgumentError(f"{str(path)!r} is not nanoGPT's meta.pkl, a plain dict with an integer vocab_size "
                                   f"({type(err).__name__}: {err}).") from None


def memmap_source(cfg: DataConfig) -> StreamSource:
    """nanoGPT layout: ``train.bin`` and ``val.bin`` (uint16), or one ``.bin`` whose tail is held out; vocabulary
    from ``meta.pkl``, else ``data.vocab_size``, else the largest id + 1 (an id at or above it is refused)."""
    path = Path(str(cfg.path)).expanduser()
    meta_path = (path if path.is_dir() else path.parent) / "meta.pkl"
    if path.is_dir() and not (path / "train.bin").is_file():
        raise NotFoundError(f"No train.bin in {str(path)!r} (nanoGPT layout: train.bin, val.bin).")
    if not path.is_dir() and not path.is_file():
        raise NotFoundError(f"data.path {str(path)!r} is neither a .bin file nor a folder with train.bin.")
    train = _open_bin(path / "train.bin", what="data file") if path.is_dir() else _open_bin(path, what="data.path")
    if (path / "val.bin").is_file():  # never for a file path
        val = _open_bin(path / "val.bin", what="data file")
    else:  # the tail is held out
        cut = int(len(train) * (1 - cfg.val_fraction))
        train, val = train[:cut], train[cut:]
    largest = max(_max_id(train), _max_id(val))
    if meta_path.is_file():
        vocab_size, origin = _meta_vocab_size(meta_path), f"vocab_size of {str(meta_path)!r}"
    elif cfg.vocab_size is not None:
        vocab_size, origin = cfg.vocab_size, f"data.vocab_size={cfg.vocab_size}"
    else:
        vocab_size, origin = largest + 1, "the largest id + 1"
    if largest >= vocab_size:
        fix = ("check that meta.pkl belongs to these .bin files" if meta_path.is_file() else
               f"set data.vocab_size to at least {largest + 1} (e.g. --data.vocab-size {largest + 1}), or check "
               "that the .bin file is the one meant")
        raise InvalidArgumentError(f"The token ids of {str(path)!r} go up to {largest}, but the vocabulary is "
                                   f"{vocab_size} tokens ({origin}, ids 0..{vocab_size - 1}); {fix}.")
    return StreamSource(train, val, seq_len=cfg.seq_len, seed=cfg.seed, vocab_size=vocab_size, bos_id=None)


def hf_source(cfg: DataConfig) -> StreamSource:
    """A Hugging Face dataset, streamed once (``max_tokens`` characters of ``text_field``), then cached."""
    try:
        import datasets
    except ImportError as err:
        raise ImportError("data.source='hf' needs the `datasets` package: pip install datasets") from err

    def load_docs() -> list[str]:
        try:
            stream = datasets.load_dataset(cfg.path, cfg.hf_config, split=cfg.hf_split, streaming=True)
            docs, total = [], 0
            for record in stream:
                if cfg.text_field not in record:
                    raise ValueError(f"Dataset {cfg.path!r} has no field {cfg.text_field!r}; fields: {sorted(record)}.")
                docs.append(str(record[cfg.text_field]))
                total += len(docs[-1])
                if total >= cfg.max_tokens:
                    break
            return docs
        except (ConnectionError, OSError) as err:
            raise OfflineError(f"Could not stream Hugging Face dataset {cfg.path!r} ({type(err).__name__}: {err}). "
                               "This needs network access; offline, use data.source='text' with a local folder or "
                               "'memmap' with pre-tokenised train.bin/val.bin.") from err

    key = {"hf": cfg.path, "config": cfg.hf_config, "split": cfg.hf_split, "field": cfg.text_field, "max": cfg.max_tokens}
    train, val, tokenizer = _tokenize_cached(cfg, key, load_docs)
    return StreamSource(train, val, seq_len=cfg.seq_len, seed=cfg.seed, vocab_size=len(tokenizer),
                        bos_id=tokenizer.bos_token_id if cfg.bos else None, tokenizer=tokenizer)


#: The largest vocabulary of a synthetic task: two dense ``vocab x vocab`` float64 tables (1 GiB at 8192 tokens).
MAX_SYNTHETIC_VOCAB = 8192


def check_synthetic_vocab(source: str, vocab: int, *, from_model: bool = False) -> None:
    if vocab <= MAX_SYNTHETIC_VOCAB:
        return
    gib = 2 * 8 * vocab * vocab / 2**30
    where = "model.d_vocab, as data.vocab_size is unset" if from_model else "data.vocab_size"
    raise InvalidArgumentError(f"data.source={source!r} with a vocabulary of {vocab} tokens ({where}) would need two "
                               f"dense {vocab}x{vocab} float64 tables ({gib:.1f} GiB); synthetic tasks allow at most "
                               f"{MAX_SYNTHETIC_VOCAB} tokens. Set data.vocab_size smaller (e.g. --data.vocab-size "
                               "256; model.d_vocab may stay larger) or model.d_vocab, or train on text data (--data PATH).")


_SAMPLE_BYTES = 1 << 20  # hashed at each of 8 evenly spaced places of a memmapped stream: a few MiB read
_SAMPLED_CHUNKS = 8


def _stream_digest(stream: np.ndarray) -> str:
    """SHA-256 of a token stream's length, dtype and bytes (sampled chunks only of a memmap)."""
    digest = hashlib.sha256(f"{len(stream)}/{np.dtype(stream.dtype).str}/".encode())
    if not isinstance(stream, np.memmap):
        digest.update(memoryview(np.ascontiguousarray(stream)))  # no copy of an in-memory stream
        return digest.hexdigest()
    width = max(1, _SAMPLE_BYTES // np.dtype(stream.dtype).itemsize)
    if len(stream) <= width * _SAMPLED_CHUNKS:
        starts = range(0, len(stream), width)
    else:
        last = len(stream) - width
        starts = sorted({round(i * last / (_SAMPLED_CHUNKS - 1)) for i in range(_SAMPLED_CHUNKS)})
    for start in starts:
        digest.update(memoryview(np.ascontiguousarray(stream[start : start + width])))
    return digest.hexdigest()


def data_fingerprint(source: TokenSource) -> dict[str, Any]:
    """What a run's data *is*, beyond its config: sha256 of the tokenizer and of each token stream, with the
    vocabulary and stream sizes; ``{}`` for a synthetic task (its config fixes it)."""
    if not isinstance(source, StreamSource):
        return {}
    tokenizer = source.tokenizer
    return {
        "tokenizer": None if tokenizer is None else hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest(),
        "vocab_size": int(source.vocab_size),
        **{split: _stream_digest(stream) for split, stream in source.streams.items()},
        **{f"{split}_tokens": int(len(stream)) for split, stream in source.streams.items()},
    }


def build_source(cfg: DataConfig, *, d_vocab: int | None = None) -> TokenSource:
    """The :class:`TokenSource` of ``cfg``; ``d_vocab`` sizes a synthetic task without ``cfg.vocab_size``."""
    if cfg.source in ("bigram-backcopy", "markov"):
        vocab = cfg.vocab_size or d_vocab
        if vocab is None:
            raise ValueError(f"data.source={cfg.source!r} needs data.vocab_size or the model's d_vocab.")
        check_synthetic_vocab(cfg.source, vocab, from_model=cfg.vocab_size is None)
        if cfg.source == "markov":
            return MarkovSource(vocab_size=vocab, seq_len=cfg.seq_len, seed=cfg.seed, alpha=cfg.alpha, task_seed=cfg.task_seed)
        return BackcopySource(vocab_size=vocab, seq_len=cfg.seq_len, seed=cfg.seed, n_triggers=cfg.n_triggers,
                              alpha=cfg.alpha, task_seed=cfg.task_seed)
    return {"text": text_source, "memmap": memmap_source, "hf": hf_source}[cfg.source](cfg)
