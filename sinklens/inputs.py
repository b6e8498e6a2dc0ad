"""Inputs for the analyzers (text, prompt sets, random tokens) as right-padded :class:`TokenBatch` es:
every sequence's first token (where the sink lives) stays at position 0. ``prepend_bos`` puts the
tokenizer's BOS (an encoder's ``[CLS] … [SEP]``) there; None does what the model's own tokenizer does."""

from __future__ import annotations

import functools
import sys
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Int
from torch import Tensor

from sinklens.display import CompactRepr
from sinklens.errors import InvalidArgumentError
from sinklens.hooks import model_device, model_dims
from sinklens.options import PREPEND_BOS
from sinklens.prompts import builtin_prompts
from sinklens.validate import IntLike, as_bool, as_seed, check_vocab, optional_positive_int, positive_int, prompt_list, token_ids
from sinklens.visibility import attention_direction


@dataclass(repr=False, eq=False)
class TokenBatch(CompactRepr):
    """A right-padded batch of token ids; ``valid``: True at real tokens; ``prepend_bos``: whether special
    tokens went before each text; ``special_tokens``: which, e.g. ``("[CLS]", "[SEP]")`` (empty: none or unknown)."""

    tokens: Int[Tensor, "batch pos"]
    valid: Bool[Tensor, "batch pos"]
    prepend_bos: bool
    special_tokens: tuple[str, ...] = ()

    _host_facts = None  # (lengths, right_aligned), read from valid once; no annotation: not a field

    @property
    def lengths(self) -> Int[Tensor, " batch"]:
        return self.valid.sum(dim=1)

    def host_lengths(self) -> tuple[int, ...]:
        """Each row's number of real tokens as Python ints."""
        return self._facts()[0]

    def _facts(self) -> tuple[tuple[int, ...], bool]:
        if self._host_facts is None:
            lengths = self.valid.sum(dim=1)
            aligned = (self.valid == (torch.arange(self.valid.shape[1], device=self.valid.device) < lengths[:, None])).all()
            *rows, flag = torch.cat([lengths, aligned.long()[None]]).tolist()  # one transfer
            self._host_facts = (tuple(rows), bool(flag))
        return self._host_facts

    @property
    def padded(self) -> bool:
        return any(n < self.valid.shape[1] for n in self.host_lengths())

    def to(self, device: torch.device | str) -> TokenBatch:
        moved = TokenBatch(self.tokens.to(device), self.valid.to(device), self.prepend_bos, self.special_tokens)
        moved._host_facts = self._facts() if self.valid.device.type == "cpu" else self._host_facts
        return moved


def right_align(batch: TokenBatch) -> TokenBatch:
    """The batch with every sequence moved to start at position 0 (the same object if already so);
    each row's real tokens must be one contiguous run."""
    host_lengths, aligned = batch._facts()
    if aligned:
        return batch
    valid = batch.valid
    pos = torch.arange(valid.shape[1], device=valid.device)[None]
    lengths = valid.sum(dim=1, keepdim=True)
    start = valid.float().argmax(dim=1, keepdim=True)  # first real position of each row
    if not bool((valid == ((pos >= start) & (pos < start + lengths))).all()):
        raise InvalidArgumentError("A TokenBatch row has padding between real tokens (valid mask with a hole); "
                                   "only left or right padding is supported.")
    prefix = pos < lengths
    tokens = batch.tokens.gather(1, torch.where(prefix, pos + start, 0))  # pads repeat column 0
    aligned_batch = TokenBatch(tokens, prefix, batch.prepend_bos, batch.special_tokens)
    aligned_batch._host_facts = (host_lengths, True)
    return aligned_batch


#: What the analyzers take: strings, a token tensor ``[batch, pos]``, or TokenBatches.
Inputs = Union[str, Iterable[str], Tensor, TokenBatch, Iterable[TokenBatch]]


def _pad_right(rows: list[Tensor], pad_id: int, prepend_bos: bool, special_tokens: tuple[str, ...]) -> TokenBatch:
    tokens = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad_id)
    valid = torch.arange(tokens.shape[1]) < torch.tensor([len(r) for r in rows])[:, None]
    return TokenBatch(tokens, valid, prepend_bos, special_tokens)


def bos_token_id(model: Any) -> int:
    """The id put at position 0 when ``prepend_bos``: the tokenizer's BOS if it is a real special
    token, else its CLS; refused when it has neither (an ``[UNK]`` stand-in does not count)."""
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise InvalidArgumentError("prepend_bos=True but the model has no tokenizer to name a BOS token; "
                                   "use prepend_bos=False (CLI: --no-bos) or put the BOS id in the tokens yourself.")
    unk = getattr(tok, "unk_token_id", None)
    special = set(getattr(tok, "all_special_ids", []) or [])
    for attr in ("bos_token_id", "cls_token_id"):
        idx = getattr(tok, attr, None)
        if isinstance(idx, int) and idx != unk and (not special or idx in special):
            return idx
    bos = getattr(tok, "bos_token", None)
    raise InvalidArgumentError(
        f"prepend_bos=True but the tokenizer has no BOS (or CLS) token of its own (bos_token={bos!r}"
        f"{', the unknown token' if getattr(tok, 'bos_token_id', None) == unk and unk is not None else ''}); "
        "use prepend_bos=False (CLI: --no-bos).")


def tokenizer_adds_bos(model: Any) -> bool | None:
    """Whether the model's own tokenizer (reloaded from ``name_or_path``, run on ``"a"``; a ``sinklens train``
    run: its data config) puts a special token before a text; None when unreadable."""
    data = getattr(getattr(model, "train_config", None), "data", None)
    if data is not None:  # a sinklens run: its rows began as its data config says
        return data.source != "memmap" and bool(data.bos)
    path = getattr(getattr(model, "tokenizer", None), "name_or_path", None)
    return _own_tokenizer_adds_bos(path) if isinstance(path, str) and path else None


@functools.lru_cache(maxsize=16)
def _own_tokenizer_adds_bos(path: str) -> bool | None:
    try:
        from transformers import AutoTokenizer
        own = AutoTokenizer.from_pretrained(path, local_files_only=True)
        ids, body = own("a")["input_ids"], own("a", add_special_tokens=False)["input_ids"]
    except Exception:  # no local tokenizer files (a Hub name offline, a hand-built tokenizer): unknown
        return None
    return ids[:1] != body[:1]


def resolved_bos(model: Any, prepend_bos: Any) -> bool:
    """``prepend_bos`` checked, with None resolved to what the model's own tokenizer does (True when unknown)."""
    return tokenizer_adds_bos(model) is not False if prepend_bos is None else as_bool(prepend_bos, what="prepend_bos")


def describe_bos(model: Any, batch: TokenBatch) -> str:
    """What position 0 got and what the model's own tokenizer does, for reports."""
    own = {True: "adds one", False: "adds none", None: "could not be read"}[tokenizer_adds_bos(model)]
    done = "none" if not batch.prepend_bos else f"{' … '.join(batch.special_tokens)} added" if batch.special_tokens \
        else "the first token counts as BOS"
    return f"{done} (the model's own tokenizer {own})"


def _check_length(length: int, n_ctx: int, *, random_tokens: bool = False) -> None:
    """Refuse a sequence longer than the context, naming the argument that shortens it."""
    if length > n_ctx:
        fix = (f"pass seq_len={n_ctx} or shorter (CLI: --seq-len {n_ctx})" if random_tokens else
               f"pass max_length={n_ctx} or shorter to truncate (CLI: --max-length {n_ctx}), or shorter prompts")
        raise InvalidArgumentError(
            f"A sequence of {length} tokens is longer than the model's context of {n_ctx} tokens (cfg.n_ctx); {fix}.")


def tokenize_prompts(model: Any, prompts: str | Iterable[str], *, batch_size: IntLike = 8,
                     prepend_bos: bool | None = PREPEND_BOS, max_length: IntLike | None = None) -> list[TokenBatch]:
    """Tokenise prompts into right-padded batches. ``max_length`` truncates each prompt, special tokens
    included (an encoder keeps its final ``[SEP]``); without it a prompt longer than ``cfg.n_ctx`` is refused."""
    prompts = prompt_list(_materialised(prompts))
    batch_size = positive_int(batch_size, what="batch_size")
    prepend_bos = resolved_bos(model, prepend_bos)
    max_length = optional_positive_int(max_length, what="max_length")
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise InvalidArgumentError("This model has no tokenizer; pass token ids (an int tensor "
                                   "[batch, pos]) instead of strings.")
    encoder = is_encoder(model)
    bos = bos_token_id(model) if prepend_bos and not encoder else None
    n_ctx = model_dims(model).n_ctx
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id or 0
    special: tuple[str, ...] = (tok.convert_ids_to_tokens(bos),) if bos is not None else ()
    rows = []
    for i, prompt in enumerate(prompts):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as err:
            raise InvalidArgumentError(
                f"prompts[{i}] ({prompt!r:.80}) is not valid Unicode text: it holds a lone surrogate "
                f"{prompt[err.start]!r} at character {err.start}, which no tokenizer can encode.") from None
        body = tok(prompt, add_special_tokens=False)["input_ids"]
        if not body:
            raise InvalidArgumentError(f"prompts[{i}] ({prompt!r:.80}) tokenises to no tokens (the model's "
                                       "tokenizer gives no ids for its text).")
        if encoder and prepend_bos:  # the tokenizer's own special tokens, added its own way
            ids = encoder_ids(tok, prompt, max_length)
            if not rows:
                special = tuple(tok.convert_ids_to_tokens(i) for i in added_ids(encoder_ids(tok, prompt), body))
                if max_length is not None and max_length <= len(special):
                    raise InvalidArgumentError(
                        f"max_length={max_length} leaves no room for text on this encoder: the special tokens it adds "
                        f"({' … '.join(special)}) take {len(special)} positions of every sequence; pass max_length >= "
                        f"{len(special) + 1} or prepend_bos=False (CLI: --no-bos).")
        else:
            ids = [bos, *body] if bos is not None else list(body)
        ids = ids[:max_length]  # None: all
        _check_length(len(ids), n_ctx)
        rows.append(torch.tensor(ids, dtype=torch.long))
    return [_pad_right(rows[i : i + batch_size], pad_id, prepend_bos and bool(special), special)
            for i in range(0, len(rows), batch_size)]


def added_ids(ids: Sequence[int], body: Sequence[int]) -> list[int]:
    """The ids in ``ids`` but not ``body`` (the text encoded alone): those the tokenizer added.

    Examples:
        >>> added_ids([2, 7, 1, 1, 3], [7, 1, 1])
        [2, 3]
    """
    left = Counter(body)
    added = []
    for i in ids:
        if left[i] > 0:
            left[i] -= 1
        else:
            added.append(i)
    return added


def encoder_ids(tok: Any, text: str, max_length: int | None = None) -> list[int]:
    """An encoder's ids for ``text``: the tokenizer's own when they start with ``[CLS]``, else ``[CLS] text [SEP]``
    (a bridge's rebuilt tokenizer drops BERT's template); ``max_length`` truncates, keeping the final ``[SEP]``."""
    unk = getattr(tok, "unk_token_id", None)
    cls, sep = getattr(tok, "cls_token_id", None), getattr(tok, "sep_token_id", None)
    kw = dict(truncation=True, max_length=max_length) if max_length is not None else {}
    ids = list(tok(text, add_special_tokens=True, **kw)["input_ids"])
    if cls is not None and cls != unk and ids[:1] == [cls]:
        return ids
    if cls is None or sep is None or unk in (cls, sep):
        raise InvalidArgumentError(
            f"prepend_bos=True on an encoder whose tokenizer has no [CLS]/[SEP] tokens of its own (cls_token_id={cls}, "
            f"sep_token_id={sep}); use prepend_bos=False (CLI: --no-bos).")
    body = list(tok(text, add_special_tokens=False)["input_ids"])
    if max_length is not None:
        body = body[: max(max_length - 2, 0)]
    return [cls, *body, sep]


def is_encoder(model: Any) -> bool:
    """True for bidirectional models (e.g. BERT), by :func:`attention_direction`."""
    return getattr(model, "cfg", None) is not None and attention_direction(model) == "bidirectional"


def random_token_batches(model: Any, *, n_sequences: IntLike = 16, seq_len: IntLike = 64, batch_size: IntLike = 8,
                         prepend_bos: bool = False, seed: IntLike = 0) -> list[TokenBatch]:
    """Uniformly random token sequences: the theory's setting, with no semantic first token. With
    ``prepend_bos`` position 0 is the tokenizer's BOS (token 0 without a tokenizer)."""
    n_sequences = positive_int(n_sequences, what="n_sequences")
    seq_len = positive_int(seq_len, what="seq_len")
    batch_size = positive_int(batch_size, what="batch_size")
    prepend_bos = as_bool(prepend_bos, what="prepend_bos")
    seed = as_seed(seed, what="seed")
    dims = model_dims(model)
    _check_length(seq_len, dims.n_ctx, random_tokens=True)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, dims.d_vocab, (n_sequences, seq_len), generator=gen)
    tok = getattr(model, "tokenizer", None)
    if prepend_bos:
        tokens[:, 0] = bos_token_id(model) if tok is not None else 0
    special = (tok.convert_ids_to_tokens(int(tokens[0, 0])),) if prepend_bos and tok is not None else ()
    return _unpadded_batches(tokens, batch_size, prepend_bos, special)


def _unpadded_batches(tokens: Tensor, batch_size: int, prepend_bos: bool,
                      special: tuple[str, ...] = ()) -> list[TokenBatch]:
    valid = torch.ones_like(tokens, dtype=torch.bool)
    return [TokenBatch(tokens[i : i + batch_size], valid[i : i + batch_size], prepend_bos, special)
            for i in range(0, tokens.shape[0], batch_size)]


def as_batches(model: Any, inputs: Inputs | None = None, *, batch_size: IntLike = 8,
               prepend_bos: bool | None = PREPEND_BOS, max_length: IntLike | None = None) -> list[TokenBatch]:
    """Any accepted input as right-padded :class:`TokenBatch` es on the model's device, checked once.
    ``None`` means the built-in prompts; a token tensor is all valid (its first column counts as BOS
    when ``prepend_bos``); batches must share ``prepend_bos`` and ``special_tokens``. ``max_length``
    keeps the first ``max_length`` tokens of every sequence, whatever form it came in."""
    batch_size = positive_int(batch_size, what="batch_size")
    prepend_bos = resolved_bos(model, prepend_bos)
    max_length = optional_positive_int(max_length, what="max_length")
    inputs = builtin_prompts() if inputs is None else inputs
    dims = model_dims(model)
    is_encoder(model)  # probed here, once per model, before any caller attaches its hooks for the pass
    if isinstance(inputs, TokenBatch):
        batches = [inputs]
    elif isinstance(inputs, Tensor):
        inputs = token_ids(inputs, dims.d_vocab, what="token ids")
        warn_if_padded(model, inputs)
        batches = _unpadded_batches(inputs, batch_size, prepend_bos)
    elif isinstance(inputs, Mapping) or type(inputs).__name__ == "ActivationCache":  # its keys are not prompts
        raise InvalidArgumentError(
            f"Cannot use a {type(inputs).__name__} as input: sinklens runs its own forward passes and reads no cached "
            "activations. Pass the tokens or text the cache was made from instead (e.g. find_sinks(model, tokens)).")
    elif isinstance(inputs, Iterable) and not isinstance(inputs, bytes):
        items = [inputs] if isinstance(inputs, str) else _materialised(inputs)
        if not items:
            raise InvalidArgumentError("No prompts given: pass at least one string, token sequence or TokenBatch.")
        if isinstance(items[0], str):
            items = tokenize_prompts(model, prompt_list(items), batch_size=batch_size, prepend_bos=prepend_bos, max_length=max_length)
        for i, b in enumerate(items):
            if not isinstance(b, TokenBatch):
                raise InvalidArgumentError(
                    f"inputs[{i}] is a {type(b).__name__} ({b!r:.60}); expected strings, a token tensor "
                    "[batch, pos], or TokenBatch objects.")
        batches = items
    else:
        raise InvalidArgumentError(
            f"Cannot use {type(inputs).__name__} as input; expected strings, a token tensor or TokenBatch.")
    batches = [checked_batch(b, i, dims.d_vocab) for i, b in enumerate(batches)]
    _same_start(batches)
    batches = [right_align(b) for b in batches]
    if max_length is not None:
        batches = [TokenBatch(b.tokens[:, :max_length], b.valid[:, :max_length], b.prepend_bos, b.special_tokens)
                   if b.tokens.shape[1] > max_length else b for b in batches]
    for b in batches:
        _check_length(b.tokens.shape[1], dims.n_ctx)
    return [b.to(model_device(model)) for b in batches]


def _caller_outside_sinklens(warning_frame: Any) -> int:
    """The ``stacklevel`` from ``warning_frame`` of the first frame outside sinklens."""
    root = str(Path(__file__).resolve().parent)
    def inside(frame: Any) -> bool:  # sinklens, or a runtime type checker's wrapper around one of its functions
        name, module = frame.f_code.co_filename, str(frame.f_globals.get("__name__", ""))
        return (name.startswith("<") or module.split(".")[0] in ("jaxtyping", "beartype", "typeguard")
                or str(Path(name).resolve()).startswith(root))
    level, frame = 1, warning_frame
    while frame is not None and inside(frame):
        frame, level = frame.f_back, level + 1
    return level


def warn_if_padded(model: Any, tokens: Int[Tensor, "batch pos"]) -> None:
    """Warn when a token tensor looks padded (as by ``model.to_tokens(prompts)``): its rows begin or
    end with runs of the pad token of different lengths, which would count as real tokens."""
    pad = getattr(getattr(model, "tokenizer", None), "pad_token_id", None)
    if not isinstance(pad, int) or tokens.ndim != 2 or tokens.shape[0] < 2:
        return
    same = (tokens == pad).long()
    leading, trailing = (s.cumprod(dim=1).sum(dim=1) for s in (same, same.flip(1)))  # run lengths
    for side, runs in (("end", trailing), ("start", leading)):
        # Runs of two or more: one pad id at a row's end is how text ends where pad is EOS (GPT-2).
        lo, hi = int(runs.min()), int(runs.max())
        if 2 <= hi < tokens.shape[1] and lo != hi:
            rows = (runs > lo).nonzero().flatten().tolist()
            warnings.warn(
                f"token ids: rows {rows[:6]}{'...' if len(rows) > 6 else ''} {side} with up to {hi} copies of the "
                f"tokenizer's pad token (id {pad}), as model.to_tokens pads prompts of different lengths; they would be "
                "analysed as text. Pass the prompts themselves, or TokenBatch(tokens, valid) marking the real tokens.",
                RuntimeWarning, stacklevel=_caller_outside_sinklens(sys._getframe()))
            return


def require_a_later_position(batches: Sequence[TokenBatch], *, what: str, sink_position: int | None = None,
                             bidirectional: bool = False, min_query: int | None = None) -> None:
    """Refuse ``batches`` where no query can see the sink (a later position; any other if ``bidirectional``), a
    sequence does not reach ``sink_position``, or ``min_query`` leaves no query; ``what`` names the caller."""
    lengths = [n for b in batches for n in b.host_lengths()]
    i = next((i for i, n in enumerate(lengths) if sink_position is not None and n <= sink_position), None)
    if i is not None:
        raise InvalidArgumentError(
            f"sink_position={sink_position} is beyond sequence {i} (counting from 0 across all batches), which has "
            f"{lengths[i]} token{'' if lengths[i] == 1 else 's'}; it must be at most {min(lengths) - 1} here.")
    sink = sink_position or 0
    needed = max(sink + 1, 2) if bidirectional else sink + 2
    longest = max(lengths)
    if longest < needed:
        size = f"{'at most ' if min(lengths) != longest else ''}{longest} token{'' if longest == 1 else 's'}"
        at = f" (sink_position={sink})" if sink else ""
        raise InvalidArgumentError(
            f"Every sequence is {size} long: {what} compares the sink position{at} with later ones, so it needs "
            f"at least one sequence of {needed} tokens or more (longer prompts, a larger max_length, "
            f"{'a smaller sink_position' if sink else 'or prepend_bos=True'}).")
    if min_query is not None and min_query >= longest:
        raise InvalidArgumentError(
            f"min_query={min_query} leaves no query to count: the longest sequence has {longest} tokens "
            f"(positions 0..{longest - 1}); pass a smaller min_query or longer prompts.")


def checked_batch(batch: Any, index: int, d_vocab: int) -> TokenBatch:
    """``batch`` (the ``index``-th) checked: ``long`` ids in ``0..d_vocab-1``, a bool (or 0/1)
    ``valid`` of the same 2-D, non-empty shape, and a real token in every row."""
    where = f"TokenBatch {index}"
    tokens, valid = batch.tokens, batch.valid
    for name, t in (("tokens", tokens), ("valid", valid)):
        if not isinstance(t, Tensor):
            raise InvalidArgumentError(f"{where}: {name} must be a tensor [batch, pos], got {type(t).__name__}.")
    if tokens.shape != valid.shape or tokens.ndim != 2:
        raise InvalidArgumentError(
            f"{where}: tokens {tuple(tokens.shape)} and valid {tuple(valid.shape)} must be equal 2-D shapes.")
    if 0 in tokens.shape:
        raise InvalidArgumentError(f"{where} is empty (tokens of shape {tuple(tokens.shape)}): it needs at least one "
                                   "sequence and one position.")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise InvalidArgumentError(f"{where}: tokens must be integer token ids, got dtype {tokens.dtype} (a model "
                                   "would read a float tensor as embeddings); pass tokens.long().")
    if valid.dtype != torch.bool:
        if valid.dtype.is_floating_point or valid.dtype.is_complex:
            raise InvalidArgumentError(f"{where}: valid must be a bool mask (True at real tokens), got dtype "
                                       f"{valid.dtype}; pass valid.bool().")
        odd = (valid != 0) & (valid != 1)
        if bool(odd.any()):
            at = odd.nonzero()[0].tolist()
            raise InvalidArgumentError(f"{where}: valid must be a bool mask or 0/1 integers, got "
                                       f"{int(valid[tuple(at)])} at {at} (dtype {valid.dtype}).")
        valid = valid.bool()
    check_vocab(tokens, d_vocab, what=f"token ids (batch {index})")
    if not (tokens.dtype == torch.long and valid is batch.valid):
        batch = TokenBatch(tokens.long(), valid, batch.prepend_bos, batch.special_tokens)
    if 0 in (lengths := batch.host_lengths()):
        raise InvalidArgumentError(f"{where}: row {lengths.index(0)} has no valid token (valid is False everywhere), so it is "
                                   "no sequence; leave it out of the batch.")
    return batch


def _same_start(batches: Sequence[TokenBatch]) -> None:
    """Refuse batches whose ``prepend_bos`` or ``special_tokens`` differ: a result has one start."""
    starts = [(b.prepend_bos, tuple(b.special_tokens)) for b in batches]
    if (i := next((i for i, start in enumerate(starts) if start != starts[0]), None)) is not None:
        said = [f"prepend_bos={bos!r}, special_tokens={special!r}" for bos, special in (starts[0], starts[i])]
        raise InvalidArgumentError(
            f"TokenBatch 0 has {said[0]} but TokenBatch {i} has {said[1]}: a result pools all sequences and "
            "records one start, so every batch must be made the same way (analyse them separately).")


def _materialised(prompts: Any) -> Any:
    """A generator or numpy array of ``prompts`` as a list (numpy strings as ``str``)."""
    if isinstance(prompts, (str, bytes, dict, Tensor)) or not isinstance(prompts, Iterable):
        return prompts
    return [str(p) if isinstance(p, str) else p for p in prompts]


def padded_to(batch: TokenBatch, width: int) -> TokenBatch:
    """``batch`` with padding columns appended up to ``width`` (for hooks at a fixed position)."""
    if width <= batch.tokens.shape[1]:
        return batch
    pad = (0, width - batch.tokens.shape[1])  # token 0, valid False
    return TokenBatch(F.pad(batch.tokens, pad), F.pad(batch.valid, pad), batch.prepend_bos, batch.special_tokens)
