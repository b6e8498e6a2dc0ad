"""Training data: the backcopy rule, Markov statistics, determinism, disjoint validation splits."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from sinklens.errors import InvalidArgumentError, NotFoundError
from sinklens.sinklm.config import DataConfig
from sinklens.train.data import BackcopySource, MarkovSource, build_source


def test_backcopy_rule_holds_and_chain_elsewhere():
    src = build_source(DataConfig(source="bigram-backcopy", seq_len=64, vocab_size=20, n_triggers=3, alpha=0.2))
    assert isinstance(src, BackcopySource) and len(src.triggers) == 3
    x = src.batch("train", 0, 256)
    assert x.shape == (256, 65) and (x[:, 0] == 0).all() and (x[:, 1:] > 0).all()
    prev, trig, nxt = x[:, 1:-2], x[:, 2:-1], x[:, 3:]
    after_trigger = src.is_trigger[trig]
    assert after_trigger.sum() > 500  # the rule is exercised
    assert (nxt[after_trigger] == prev[after_trigger]).all()  # x_{t+1} = x_{t-1} after every trigger (t >= 2)
    # elsewhere the next token is sampled: it differs from x_{t-1} often
    assert (nxt[~after_trigger] != prev[~after_trigger]).float().mean() > 0.5


def test_markov_statistics_match_transition_matrix():
    src = MarkovSource(vocab_size=6, seq_len=200, seed=3, alpha=1.0)
    x = src.batch("train", 0, 200)[:, 1:]
    counts = torch.zeros(6, 6, dtype=torch.float64)
    counts.index_put_((x[:, :-1].flatten(), x[:, 1:].flatten()), torch.ones(x[:, 1:].numel(), dtype=torch.float64), accumulate=True)
    empirical = counts[1:] / counts[1:].sum(dim=1, keepdim=True)
    assert counts[:, 0].sum() == 0  # BOS never follows
    # ~8000 transitions per row: binomial standard error <= 0.0056; allow 5 sigma
    assert (empirical - src.transition[1:]).abs().max() < 0.03


def test_order_depends_only_on_data_seed():
    a = build_source(DataConfig(seq_len=16, vocab_size=24, seed=5))
    b = build_source(DataConfig(seq_len=16, vocab_size=24, seed=5))
    c = build_source(DataConfig(seq_len=16, vocab_size=24, seed=6))
    torch.manual_seed(123)  # the global RNG (model init, dropout) must not matter
    first = a.batch("train", 7, 8)
    torch.manual_seed(999)
    assert torch.equal(first, b.batch("train", 7, 8))
    assert not torch.equal(first, c.batch("train", 7, 8))
    assert not torch.equal(first, a.batch("train", 8, 8))
    assert not torch.equal(a.batch("val", 7, 8), first)


def _windows(x: torch.Tensor) -> set[tuple[int, ...]]:
    return {tuple(row.tolist()) for row in x}


def test_memmap_folder_and_single_file_splits(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "nano").mkdir()
    rng.integers(0, 100, 4000, dtype=np.uint16).tofile(tmp_path / "nano" / "train.bin")
    (rng.integers(0, 100, 1000, dtype=np.uint16) + 200).astype(np.uint16).tofile(tmp_path / "nano" / "val.bin")
    with open(tmp_path / "nano" / "meta.pkl", "wb") as fh:
        pickle.dump({"vocab_size": 300}, fh)
    src = build_source(DataConfig(source="memmap", path=str(tmp_path / "nano"), seq_len=32))
    assert src.vocab_size == 300 and src.bos_id is None
    train, val = src.batch("train", 0, 64), src.batch("val", 0, 64)
    assert train.shape == (64, 33) and (train < 100).all() and (val >= 200).all()  # val comes from val.bin

    np.arange(5000, dtype=np.uint16).tofile(tmp_path / "one.bin")  # positions are their own ids
    one = build_source(DataConfig(source="memmap", path=str(tmp_path / "one.bin"), seq_len=16, val_fraction=0.2))
    assert one.vocab_size == 5000
    tr, va = one.batch("train", 0, 200), one.batch("val", 0, 200)
    assert tr.max() < 4000 and va.min() >= 4000  # tail 20% held out, windows never cross the cut
    assert (tr[:, 1:] - tr[:, :-1] == 1).all()  # contiguous windows


class _Payload:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):  # unpickling this creates the file: what a crafted meta.pkl could do
        return (open, (self.path, "w"))


def test_a_crafted_meta_pkl_is_refused_never_run(tmp_path):
    (tmp_path / "nano").mkdir()
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "nano" / "train.bin")
    marker = tmp_path / "marker"
    (tmp_path / "nano" / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 300, "x": _Payload(marker)}))
    with pytest.raises(InvalidArgumentError, match=r"meta.pkl' is not nanoGPT's meta.pkl.*names io.open"):
        build_source(DataConfig(source="memmap", path=str(tmp_path / "nano"), seq_len=16))
    assert not marker.exists()
    (tmp_path / "nano" / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 1000, "itos": {0: "a"}}))
    assert build_source(DataConfig(source="memmap", path=str(tmp_path / "nano"), seq_len=16)).vocab_size == 1000


def test_text_folder_byte_and_bpe(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(6):
        (docs / f"d{i}.txt").write_text(f"document {i}: " + " ".join(f"word{j % 37}" for j in range(i * 50, i * 50 + 300)))
    (docs / "skip.md").write_text("not matched by the glob")
    cfg = DataConfig(source="text", path=str(docs), seq_len=24, cache_dir=str(tmp_path / "cache"), val_fraction=0.25)
    src = build_source(cfg)
    assert src.vocab_size == 257 and src.bos_id == 256
    text = "".join((docs / f"d{i}.txt").read_text() for i in range(6))
    train_ids = src.streams["train"].tolist()
    val_ids = src.streams["val"].tolist()
    decoded = bytes(t for t in train_ids + val_ids if t < 256).decode()
    assert decoded == text  # byte ids are the file bytes, in sorted-file order
    cut = int(len(text) * 0.75)
    assert bytes(t for t in train_ids if t < 256).decode() == text[:cut]  # disjoint: train is the head...
    assert bytes(t for t in val_ids if t < 256).decode() == text[cut:]  # ...val the tail
    x = src.batch("val", 0, 4)
    assert (x[:, 0] == 256).all() and x.shape == (4, 25)
    assert src.tokenizer.decode(src.tokenizer("word1 word2", add_special_tokens=False)["input_ids"]) == "word1 word2"
    again = build_source(cfg)  # from the cache
    assert np.array_equal(again.streams["train"], src.streams["train"])
    assert len(list((tmp_path / "cache" / "data").iterdir())) == 1

    bpe = build_source(DataConfig(source="text", path=str(docs), seq_len=8, tokenizer="bpe", vocab_size=300,
                                  cache_dir=str(tmp_path / "cache"), val_fraction=0.25))
    assert bpe.vocab_size == 300 and bpe.bos_id == 0
    assert len(bpe.streams["train"]) < len(train_ids)  # merges compress the text
    ids = bpe.tokenizer("word17 word18", add_special_tokens=False)["input_ids"]
    assert bpe.tokenizer.decode(ids) == "word17 word18"


def test_missing_data_is_a_clear_error(tmp_path):
    with pytest.raises(NotFoundError, match="neither a text file nor a folder"):
        build_source(DataConfig(source="text", path=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotFoundError, match="No files match"):
        build_source(DataConfig(source="text", path=str(tmp_path / "empty")))
    with pytest.raises(NotFoundError, match="No train.bin"):
        build_source(DataConfig(source="memmap", path=str(tmp_path / "empty")))
    (tmp_path / "small.txt").write_text("tiny")
    with pytest.raises(ValueError, match="fewer than one sequence"):
        build_source(DataConfig(source="text", path=str(tmp_path / "small.txt"), seq_len=64, cache_dir=str(tmp_path / "c")))
