"""Inputs for the analyzers: natural text and random-token sequences (prompt sets: :mod:`sinklens.prompts`).

Every source ends up as a list of :class:`TokenBatch`: right-padded token ids plus a ``valid`` mask.
Right padding keeps every sequence's first token at position 0 (where the sink lives); pads change no
real token's activations (:func:`sinklens.streaming.forward`), so results do not depend on the batch
size or the padding side.

What position 0 is (``prepend_bos``):

* **decoders**: ``prepend_bos=True`` puts the tokenizer's BOS token (a real special token of the model,
  never ``[UNK]``) in front of each text; ``False`` starts with the text's first token.
* **encoders** (e.g. BERT): ``prepend_bos=True`` adds ``[CLS] … [SEP]`` as
  ``tokenizer(text, add_special_tokens=True)`` does; ``False`` adds none.

``prepend_bos=None`` (the default) does what the model's own tokenizer does (:func:`tokenizer_adds_bos`). Each
batch records the special tokens it got in :attr:`TokenBatch.special_tokens`, and the results say what position 0 is
(:meth:`sinklens.analysis.sinks.SinkResult.describe_start`, :func:`describe_bos`).
"""

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
    """A right-padded batch of token ids.

    Attributes:
        tokens: token ids, padded on the right.
        valid: True at real tokens, False at padding.
        prepend_bos: whether special tokens were added in front of each text (a BOS for decoders, the
            tokenizer's ``[CLS] … [SEP]`` for encoders); it moves the sink, so every result records it.
        special_tokens: the special tokens that were added, as the tokenizer spells them, in order (e.g.
            ``("<|im_start|>",)`` or ``("[CLS]", "[SEP]")``); empty when none were or when unknown
            (token tensors given directly).
    """

    tokens: Int[Tensor, "batch pos"]
    valid: Bool[Tensor, "batch pos"]
    prepend_bos: bool
    special_tokens: tuple[str, ...] = ()

    _host_facts = None  # (lengths, right_aligned) read from valid once (host_lengths); no annotation: not a field

    @property
    def lengths(self) -> Int[Tensor, " batch"]:
        return self.valid.sum(dim=1)

    def host_lengths(self) -> tuple[int, ...]:
        """Each row's number of real tokens as Python ints. Read from ``valid`` with one transfer the first
        time (none for a batch moved from the CPU by :meth:`to`), then kept: every per-batch question about
        lengths and padding is answered on the host, without waiting for a GPU."""
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
        """True if any position is padding."""
        return any(n < self.valid.shape[1] for n in self.host_lengths())

    def to(self, device: torch.device | str) -> TokenBatch:
        moved = TokenBatch(self.tokens.to(device), self.valid.to(device), self.prepend_bos, self.special_tokens)
        moved._host_facts = self._facts() if self.valid.device.type == "cpu" else self._host_facts
        return moved


def right_align(batch: TokenBatch) -> TokenBatch:
    """The batch with every sequence moved to start at position 0 (left or mixed padding → right padding).

    Each row's real tokens must be one contiguous run (a ``valid`` mask with a hole is refused with
    :class:`~sinklens.errors.InvalidArgumentError`). A right-padded batch is returned unchanged (the same object).

    Examples:
        >>> b = TokenBatch(torch.tensor([[0, 0, 7, 8], [5, 6, 7, 8]]),
        ...                torch.tensor([[False, False, True, True], [True, True, True, True]]), False)
        >>> right_align(b).tokens.tolist(), right_align(b).valid.sum(dim=1).tolist()
        ([[7, 8, 0, 0], [5, 6, 7, 8]], [2, 4])
    """
    host_lengths, aligned = batch._facts()
    if aligned:
        return batch
    valid = batch.valid
    n = valid.shape[1]
    lengths = valid.sum(dim=1)
    pos = torch.arange(n, device=valid.device)
    prefix = pos[None, :] < lengths[:, None]
    start = valid.float().argmax(dim=1)  # first real position of each row
    if not bool((valid == ((pos[None] >= start[:, None]) & (pos[None] < (start + lengths)[:, None]))).all()):
        raise InvalidArgumentError(
            "A TokenBatch row has padding between real tokens (valid mask with a hole); only left or right "
            "padding is supported."
        )
    index = (pos[None, :] + start[:, None]).clamp(max=n - 1)
    tokens = torch.where(prefix, batch.tokens.gather(1, index), batch.tokens.gather(1, index.new_zeros(index.shape)))
    aligned_batch = TokenBatch(tokens, prefix, batch.prepend_bos, batch.special_tokens)
    aligned_batch._host_facts = (host_lengths, True)
    return aligned_batch


#: What the analyzers take: a string, any iterable of strings (a list, a generator, a numpy array of strings),
#: a token tensor ``[batch, pos]``, one :class:`TokenBatch` or an iterable of them.
Inputs = Union[str, Iterable[str], Tensor, TokenBatch, Iterable[TokenBatch]]

def _pad_right(rows: list[Tensor], pad_id: int, prepend_bos: bool, special_tokens: tuple[str, ...] = ()) -> TokenBatch:
    width = max(int(r.numel()) for r in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    valid = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, row in enumerate(rows):
        tokens[i, : row.numel()] = row
        valid[i, : row.numel()] = True
    return TokenBatch(tokens, valid, prepend_bos, special_tokens)


def bos_token_id(model: Any) -> int:
    """The id put at position 0 when ``prepend_bos``: the tokenizer's BOS when it is a real special
    token of the model, else its CLS token (BERT-style tokenizers start every sequence with it).

    Refused (:class:`~sinklens.errors.InvalidArgumentError`) when the tokenizer has neither, or when its
    ``bos_token_id`` is the unknown token (a bridge fills it with ``[UNK]`` on BERT).
    """
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
        "use prepend_bos=False (CLI: --no-bos)."
    )


def tokenizer_adds_bos(model: Any) -> bool | None:
    """Whether the model's own tokenizer, as saved with it, puts a special token before a text: it is read again
    from ``tokenizer.name_or_path`` (TransformerLens rebuilds the one it attaches with ``add_bos_token=True``)
    and run on ``"a"`` (a config's ``add_bos_token`` does not always say what it does); a ``sinklens train`` run
    answers from its data config. None when unreadable."""
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
    if prepend_bos is None:
        return tokenizer_adds_bos(model) is not False
    return as_bool(prepend_bos, what="prepend_bos")


def describe_bos(model: Any, batch: TokenBatch) -> str:
    """What position 0 got and what the model's own tokenizer does, for reports, e.g.
    ``"<|im_start|> added (the model's own tokenizer adds none)"``."""
    own = {True: "adds one", False: "adds none", None: "could not be read"}[tokenizer_adds_bos(model)]
    done = "none" if not batch.prepend_bos else f"{' … '.join(batch.special_tokens)} added" if batch.special_tokens \
        else "the first token counts as BOS"
    return f"{done} (the model's own tokenizer {own})"


def _check_length(length: int, n_ctx: int, *, random_tokens: bool = False) -> None:
    """Refuse a sequence longer than the context, naming the Python argument and the CLI flag that shorten it
    (``seq_len`` / ``--seq-len`` for random tokens, ``max_length`` / ``--max-length`` for prompts)."""
    if length > n_ctx:
        fix = (f"pass seq_len={n_ctx} or shorter (CLI: --seq-len {n_ctx})" if random_tokens else
               f"pass max_length={n_ctx} or shorter to truncate (CLI: --max-length {n_ctx}), or shorter prompts")
        raise InvalidArgumentError(
            f"A sequence of {length} tokens is longer than the model's context of {n_ctx} tokens (cfg.n_ctx); {fix}."
        )


def tokenize_prompts(
    model: Any,
    prompts: str | Iterable[str],
    *,
    batch_size: IntLike = 8,
    prepend_bos: bool | None = PREPEND_BOS,
    max_length: IntLike | None = None,
) -> list[TokenBatch]:
    """Tokenise prompts with the model's tokenizer into right-padded batches.

    ``prepend_bos`` adds the model's special tokens (module docstring). ``max_length`` truncates each prompt
    (special tokens included; an encoder keeps its final ``[SEP]``, so it must be >= 3 there); without it a
    prompt longer than ``cfg.n_ctx`` raises :class:`InvalidArgumentError`. An empty prompt or one that is
    not valid Unicode raises :class:`~sinklens.errors.InvalidArgumentError` naming its index.
    """
    prompts = prompt_list(_materialised(prompts))
    batch_size = positive_int(batch_size, what="batch_size")
    prepend_bos = resolved_bos(model, prepend_bos)
    max_length = optional_positive_int(max_length, what="max_length")
    if getattr(model, "tokenizer", None) is None:
        raise InvalidArgumentError(
            "This model has no tokenizer; pass token ids (an int tensor [batch, pos]) instead of strings."
        )
    tok = model.tokenizer
    encoder = is_encoder(model)
    bos = bos_token_id(model) if prepend_bos and not encoder else None
    n_ctx = model_dims(model).n_ctx
    pad_id = tok.pad_token_id
    if pad_id is None:
        pad_id = tok.eos_token_id or 0
    special: tuple[str, ...] = (tok.convert_ids_to_tokens(bos),) if bos is not None else ()
    for i, prompt in enumerate(prompts):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as err:
            raise InvalidArgumentError(
                f"prompts[{i}] ({prompt!r:.80}) is not valid Unicode text: it holds a lone surrogate "
                f"{prompt[err.start]!r} at character {err.start}, which no tokenizer can encode."
            ) from None
    rows = []
    for i, prompt in enumerate(prompts):
        body = tok(prompt, add_special_tokens=False)["input_ids"]
        if not body:
            raise InvalidArgumentError(
                f"prompts[{i}] ({prompt!r:.80}) tokenises to no tokens (the model's tokenizer gives no ids for its text)."
            )
        if encoder and prepend_bos:  # the tokenizer's own special tokens, added its own way
            ids = encoder_ids(tok, prompt, max_length)
            if not rows:
                special = tuple(tok.convert_ids_to_tokens(i) for i in added_ids(encoder_ids(tok, prompt), body))
                if max_length is not None and max_length <= len(special):
                    raise InvalidArgumentError(
                        f"max_length={max_length} leaves no room for text on this encoder: the special tokens it "
                        f"adds ({' … '.join(special)}) take {len(special)} positions of every sequence, so "
                        f"max_length must be at least {len(special) + 1} (or pass prepend_bos=False, CLI: --no-bos)."
                    )
        else:
            ids = [bos, *body] if bos is not None else list(body)
        if max_length is not None:
            ids = ids[:max_length]
        _check_length(len(ids), n_ctx)
        rows.append(torch.tensor(ids, dtype=torch.long))
    return [_pad_right(rows[i : i + batch_size], pad_id, prepend_bos and bool(special), special)
            for i in range(0, len(rows), batch_size)]


def added_ids(ids: Sequence[int], body: Sequence[int]) -> list[int]:
    """The ids of ``ids`` that are not in ``body`` (the same text encoded without special tokens), in order:
    the special tokens a tokenizer added, not those that stand for text (an ``[UNK]`` for an unknown word).

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
    """An encoder's token ids for ``text`` with its own special tokens: ``tok(text, add_special_tokens=True)``
    when that starts with the tokenizer's ``[CLS]``; otherwise (a TransformerLens bridge rebuilds the
    tokenizer and drops BERT's ``[CLS] $A [SEP]`` template) that same template from ``cls_token_id`` and
    ``sep_token_id``. ``max_length`` truncates the text, keeping the final ``[SEP]``.

    Refused (:class:`~sinklens.errors.InvalidArgumentError`) when the tokenizer has no real ``[CLS]``/``[SEP]``
    (never an ``[UNK]`` stand-in).
    """
    unk = getattr(tok, "unk_token_id", None)
    cls, sep = getattr(tok, "cls_token_id", None), getattr(tok, "sep_token_id", None)
    kw = dict(truncation=True, max_length=max_length) if max_length is not None else {}
    ids = list(tok(text, add_special_tokens=True, **kw)["input_ids"])
    if cls is not None and cls != unk and ids[:1] == [cls]:
        return ids
    if cls is None or sep is None or unk in (cls, sep):
        raise InvalidArgumentError(
            f"prepend_bos=True on an encoder whose tokenizer has no [CLS]/[SEP] tokens of its own (cls_token_id={cls}, "
            f"sep_token_id={sep}); use prepend_bos=False (CLI: --no-bos)."
        )
    body = list(tok(text, add_special_tokens=False)["input_ids"])
    if max_length is not None:
        body = body[: max(max_length - 2, 0)]
    return [cls, *body, sep]


def is_encoder(model: Any) -> bool:
    """True for bidirectional models (e.g. BERT): :func:`sinklens.visibility.attention_direction`, which checks
    ``cfg.attention_dir`` against the model's own attention."""
    return getattr(model, "cfg", None) is not None and attention_direction(model) == "bidirectional"


def random_token_batches(
    model: Any,
    *,
    n_sequences: IntLike = 16,
    seq_len: IntLike = 64,
    batch_size: IntLike = 8,
    prepend_bos: bool = False,
    seed: IntLike = 0,
) -> list[TokenBatch]:
    """Uniformly random token sequences: the theory's setting, with no semantic first token.

    With ``prepend_bos=True`` position 0 is the tokenizer's BOS (or token 0 for models without a
    tokenizer) and the remaining ``seq_len - 1`` tokens are random.
    """
    n_sequences = positive_int(n_sequences, what="n_sequences")
    seq_len = positive_int(seq_len, what="seq_len")
    batch_size = positive_int(batch_size, what="batch_size")
    prepend_bos = as_bool(prepend_bos, what="prepend_bos")
    seed = as_seed(seed, what="seed")
    dims = model_dims(model)
    _check_length(seq_len, dims.n_ctx, random_tokens=True)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, dims.d_vocab, (n_sequences, seq_len), generator=gen)
    special: tuple[str, ...] = ()
    if prepend_bos:
        tok = getattr(model, "tokenizer", None)
        tokens[:, 0] = bos_token_id(model) if tok is not None else 0
        special = (tok.convert_ids_to_tokens(int(tokens[0, 0])),) if tok is not None else ()
    valid = torch.ones_like(tokens, dtype=torch.bool)
    return [
        TokenBatch(tokens[i : i + batch_size], valid[i : i + batch_size], prepend_bos, special)
        for i in range(0, n_sequences, batch_size)
    ]


def as_batches(
    model: Any,
    inputs: Inputs | None = None,
    *,
    batch_size: IntLike = 8,
    prepend_bos: bool | None = PREPEND_BOS,
    max_length: IntLike | None = None,
) -> list[TokenBatch]:
    """Normalise any accepted input into right-padded :class:`TokenBatch` es on the model's device.

    Accepts a string or any iterable of strings, an int tensor ``[batch, pos]`` (all tokens valid; its
    first column counts as BOS when ``prepend_bos``), one :class:`TokenBatch` or a list of them
    (right-aligned, :func:`right_align`); ``None`` means the built-in prompt set. ``max_length`` keeps the
    first ``max_length`` tokens of every sequence (BOS included), whatever form it came in.

    Every argument is checked here, once: token ids must lie in ``0..d_vocab-1`` (checked on the CPU),
    batches are normalised by :func:`checked_batch` and must share ``prepend_bos`` and ``special_tokens``.
    Refusals are :class:`~sinklens.errors.InvalidArgumentError`.
    """
    batch_size = positive_int(batch_size, what="batch_size")
    prepend_bos = resolved_bos(model, prepend_bos)
    max_length = optional_positive_int(max_length, what="max_length")
    if inputs is None:
        inputs = builtin_prompts()
    if isinstance(inputs, Sequence) and not isinstance(inputs, str) and len(inputs) == 0:
        raise InvalidArgumentError("No prompts given: pass at least one string, token sequence or TokenBatch.")
    dims = model_dims(model)
    device = model_device(model)
    is_encoder(model)  # probed here, once per model, before any caller attaches its hooks for the pass
    if isinstance(inputs, TokenBatch):
        batches = [inputs]
    elif isinstance(inputs, Tensor):
        inputs = token_ids(inputs, dims.d_vocab, what="token ids")
        warn_if_padded(model, inputs)
        valid = torch.ones(inputs.shape, dtype=torch.bool)
        batches = [
            TokenBatch(inputs[i : i + batch_size], valid[i : i + batch_size], prepend_bos)
            for i in range(0, inputs.shape[0], batch_size)
        ]
    elif isinstance(inputs, Mapping) or type(inputs).__name__ == "ActivationCache":  # its keys are not prompts
        raise InvalidArgumentError(
            f"Cannot use a {type(inputs).__name__} as input: sinklens runs its own forward passes and reduces each "
            "activation inside its hook, so it reads no cached activations. Pass the tokens or text the cache was "
            "made from instead (e.g. find_sinks(model, tokens) with the tokens given to run_with_cache)."
        )
    elif isinstance(inputs, str):
        batches = tokenize_prompts(model, [inputs], batch_size=batch_size, prepend_bos=prepend_bos, max_length=max_length)
    elif isinstance(inputs, Iterable) and not isinstance(inputs, bytes):
        items = _materialised(inputs)
        if not items:
            raise InvalidArgumentError("No inputs given: the iterable of prompts or TokenBatch objects is empty.")
        if isinstance(items[0], str):  # prompts: a list, tuple, generator or numpy array of strings
            items = tokenize_prompts(model, prompt_list(items), batch_size=batch_size, prepend_bos=prepend_bos, max_length=max_length)
        for i, b in enumerate(items):
            if not isinstance(b, TokenBatch):
                raise InvalidArgumentError(
                    f"inputs[{i}] is a {type(b).__name__} ({b!r:.60}); expected strings, a token tensor "
                    "[batch, pos], or TokenBatch objects."
                )
        batches = items
    else:
        raise InvalidArgumentError(
            f"Cannot use {type(inputs).__name__} as input; expected strings, a token tensor or TokenBatch."
        )
    batches = [checked_batch(b, i, dims.d_vocab) for i, b in enumerate(batches)]
    _same_start(batches)
    batches = [_first_tokens(right_align(b), max_length) for b in batches]
    for b in batches:
        _check_length(b.tokens.shape[1], dims.n_ctx)
    return [b.to(device) for b in batches]


def _end_runs(tokens: Tensor, token: int) -> tuple[Tensor, Tensor]:
    """Per row of ``tokens [batch, pos]``: how many copies of ``token`` it starts with and ends with."""
    same = (tokens == token).long()
    leading = same.cumprod(dim=1).sum(dim=1)
    trailing = same.flip(1).cumprod(dim=1).sum(dim=1)
    return leading, trailing


def _caller_outside_sinklens(warning_frame: Any) -> int:
    """The ``stacklevel``, counted from ``warning_frame`` (the frame that calls ``warnings.warn``), of the first
    frame outside the sinklens package, so a warning names the user's line, however deep the call that raised it."""
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
    """Warn when a token tensor looks padded: its rows begin or end with runs of the tokenizer's pad token of
    different lengths, as ``model.to_tokens(list_of_prompts)`` pads prompts of different lengths.

    Only runs of at least two pad tokens count (one pad id at a row's end is how text ends where pad is EOS,
    as in GPT-2). Every position of a token tensor counts as real, so padding would be measured as text.
    """
    pad = getattr(getattr(model, "tokenizer", None), "pad_token_id", None)
    if not isinstance(pad, int) or tokens.ndim != 2 or tokens.shape[0] < 2:
        return
    leading, trailing = _end_runs(tokens, pad)
    for side, runs in (("end", trailing), ("start", leading)):
        # A run of at least two: one pad id at a row's end is also how text ends where pad is EOS (GPT-2).
        if int(runs.max()) >= 2 and int(runs.min()) != int(runs.max()) and int(runs.max()) < tokens.shape[1]:
            rows = [int(i) for i in torch.nonzero(runs > runs.min()).flatten()]
            warnings.warn(
                f"token ids: rows {rows[:6]}{'...' if len(rows) > 6 else ''} {side} with up to {int(runs.max())} copies of "
                f"the tokenizer's pad token (id {pad}), as model.to_tokens pads a list of prompts of different lengths. "
                "Every position of a token tensor counts as a real token, so the padding would be analysed as text. "
                "Pass the prompts themselves, or TokenBatch(tokens, valid) with valid marking the real tokens.",
                RuntimeWarning, stacklevel=_caller_outside_sinklens(sys._getframe()))
            return


def require_a_later_position(
    batches: Sequence[TokenBatch], *, what: str, sink_position: int | None = None, bidirectional: bool = False,
    min_query: int | None = None,
) -> None:
    """Refuse ``batches`` in which no sequence has a position after the sink, before any forward pass.

    Without ``sink_position`` some sequence must have 2 tokens. With it, every sequence must reach
    ``sink_position`` (the first that does not is named by its index across batches) and some query must
    see the sink: a later position on a causal model, any other on a ``bidirectional`` one. ``what`` names
    the caller in the error. A ``min_query`` at or beyond the longest sequence (no query counted) is refused.
    """
    lengths = torch.tensor([n for b in batches for n in b.host_lengths()], dtype=torch.long)
    if sink_position is not None:
        short = (lengths <= sink_position).nonzero().flatten()
        if short.numel():
            i = int(short[0])
            raise InvalidArgumentError(
                f"sink_position={sink_position} is beyond sequence {i} (counting from 0 across all batches), which has "
                f"{int(lengths[i])} token{'' if int(lengths[i]) == 1 else 's'}: every sequence needs a token at "
                f"sink_position (it must be at most {int(lengths.min()) - 1} for these inputs)."
            )
    sink = sink_position or 0
    needed = max(sink + 1, 2) if bidirectional else sink + 2
    longest = int(lengths.max())
    if longest < needed:
        size = f"{'at most ' if int(lengths.min()) != longest else ''}{longest} token{'' if longest == 1 else 's'}"
        at = f" (sink_position={sink})" if sink_position is not None and sink else ""
        raise InvalidArgumentError(
            f"Every sequence is {size} long: {what} compares the sink position{at} with later ones, so it needs "
            f"at least one sequence of {needed} tokens or more (longer prompts, a larger max_length, "
            f"{'a smaller sink_position' if sink else 'or prepend_bos=True'})."
        )
    if min_query is not None and min_query >= longest:
        raise InvalidArgumentError(
            f"min_query={min_query} leaves no query to count: the longest sequence has {longest} tokens "
            f"(positions 0..{longest - 1}); pass a smaller min_query or longer prompts.")


def checked_batch(batch: Any, index: int, d_vocab: int) -> TokenBatch:
    """``batch`` (the ``index``-th given) checked and normalised: integer ``tokens [batch, pos]`` (made ``long``)
    with ids in ``0..d_vocab-1``; a ``valid`` mask of the same shape, bool or 0/1 integers (made bool); at least
    one row and one position, and a valid token in every row. Refusals are :class:`~sinklens.errors.InvalidArgumentError` naming the batch.

    Examples:
        >>> b = TokenBatch(torch.tensor([[3, 4]]), torch.tensor([[True, False]]), False)
        >>> b.tokens, b.valid = b.tokens.int(), b.valid.long()  # as built without runtime type checks
        >>> b = checked_batch(b, 0, 10)
        >>> b.tokens.dtype, b.valid.tolist()
        (torch.int64, [[True, False]])
    """
    where = f"TokenBatch {index}"
    tokens, valid = batch.tokens, batch.valid
    for name, t in (("tokens", tokens), ("valid", valid)):
        if not isinstance(t, Tensor):
            raise InvalidArgumentError(f"{where}: {name} must be a tensor [batch, pos], got {type(t).__name__}.")
    if tokens.shape != valid.shape or tokens.ndim != 2:
        raise InvalidArgumentError(
            f"{where}: tokens {tuple(tokens.shape)} and valid {tuple(valid.shape)} must be equal 2-D shapes."
        )
    if tokens.shape[0] == 0 or tokens.shape[1] == 0:
        raise InvalidArgumentError(
            f"{where} is empty (tokens of shape {tuple(tokens.shape)}): it needs at least one sequence and one position."
        )
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise InvalidArgumentError(
            f"{where}: tokens must be integer token ids, got dtype {tokens.dtype} (a model would read a float "
            "tensor as embeddings); pass tokens.long()."
        )
    if valid.dtype != torch.bool:
        if valid.dtype.is_floating_point or valid.dtype.is_complex:
            raise InvalidArgumentError(
                f"{where}: valid must be a bool mask (True at real tokens), got dtype {valid.dtype}; pass valid.bool()."
            )
        odd = (valid != 0) & (valid != 1)
        if bool(odd.any()):
            at = [int(i) for i in odd.nonzero()[0].tolist()]
            raise InvalidArgumentError(
                f"{where}: valid must be a bool mask or 0/1 integers, got {int(valid[tuple(at)])} at {at} "
                f"(dtype {valid.dtype})."
            )
        valid = valid.bool()
    check_vocab(tokens, d_vocab, what=f"token ids (batch {index})")
    if not (tokens.dtype == torch.long and valid is batch.valid):
        batch = TokenBatch(tokens.long(), valid, batch.prepend_bos, batch.special_tokens)
    empty = [i for i, n in enumerate(batch.host_lengths()) if n == 0]
    if empty:
        raise InvalidArgumentError(f"{where}: row {empty[0]} has no valid token (valid is False everywhere), so it is "
                                   "no sequence; leave it out of the batch.")
    return batch


def _same_start(batches: Sequence[TokenBatch]) -> None:
    """Refuse batches made differently (``prepend_bos`` or ``special_tokens`` differ): a result pools every
    sequence and records one start (what position 0 is), so mixing them would mislabel some of them."""
    first = batches[0]
    for i, b in enumerate(batches[1:], start=1):
        if (b.prepend_bos, tuple(b.special_tokens)) != (first.prepend_bos, tuple(first.special_tokens)):
            raise InvalidArgumentError(
                f"TokenBatch 0 has prepend_bos={first.prepend_bos!r}, special_tokens={tuple(first.special_tokens)!r} "
                f"but TokenBatch {i} has prepend_bos={b.prepend_bos!r}, special_tokens={tuple(b.special_tokens)!r}: "
                "a result pools all sequences and records one start, so every batch must be made the same way "
                "(analyse them separately)."
            )


def _materialised(prompts: Any) -> Any:
    """``prompts`` with an iterable that is not a sequence (a generator, a numpy array) read into a list, its
    numpy strings as ``str``; a string, a sequence or a non-iterable is returned as it is (for :func:`prompt_list`)."""
    if isinstance(prompts, (str, bytes, dict, Tensor)) or not isinstance(prompts, Iterable):
        return prompts
    if isinstance(prompts, Sequence) and type(prompts).__module__ != "numpy":
        return list(prompts)
    return [str(p) if isinstance(p, str) else p for p in prompts]


def padded_to(batch: TokenBatch, width: int) -> TokenBatch:
    """A right-padded ``batch`` at least ``width`` positions wide: padding columns (token 0, ``valid`` False)
    appended when it is narrower, so a hook at a fixed position finds it in every batch; no real token's
    activations change (padding is masked, see :func:`sinklens.streaming.forward`)."""
    missing = width - batch.tokens.shape[1]
    if missing <= 0:
        return batch
    rows = batch.tokens.shape[0]
    tokens = torch.cat([batch.tokens, batch.tokens.new_zeros(rows, missing)], dim=1)
    valid = torch.cat([batch.valid, batch.valid.new_zeros(rows, missing)], dim=1)
    return TokenBatch(tokens, valid, batch.prepend_bos, batch.special_tokens)


def _first_tokens(batch: TokenBatch, max_length: int | None) -> TokenBatch:
    """A right-padded ``batch`` cut to its first ``max_length`` positions (None or a shorter batch: unchanged)."""
    if max_length is None or batch.tokens.shape[1] <= max_length:
        return batch
    return TokenBatch(batch.tokens[:, :max_length], batch.valid[:, :max_length], batch.prepend_bos, batch.special_tokens)
