"""Two offline tasks (:func:`text_task`, :func:`keyword_task`) and an AdamW loop that trains an adapter."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from sinklens.display import CompactRepr
from sinklens.errors import InvalidArgumentError
from sinklens.hooks import eval_mode, model_device, model_dims
from sinklens.inputs import bos_token_id
from sinklens.options import BATCH_SIZE, SEQ_LEN
from sinklens.prompts import stdlib_text_prompts
from sinklens.peft.adapters import Adapter, adapted
from sinklens.validate import as_seed, finite_number, positive_int


@dataclass(repr=False, eq=False)
class Task(CompactRepr):
    """Disjoint ``train`` and ``eval`` token rows of one width; ``loss_mask[t]`` marks the counted targets
    ``tokens[:, t+1]``."""

    name: str
    train: Tensor
    eval: Tensor
    loss_mask: Tensor

    @property
    def seq_len(self) -> int:
        return int(self.train.shape[1])


def _split(name: str, rows: Tensor, mask: Tensor, n_eval: int) -> Task:
    if rows.shape[0] <= n_eval:
        raise InvalidArgumentError(f"task {name!r}: {rows.shape[0]} rows leave none for training after {n_eval} for eval.")
    return Task(name, rows[n_eval:], rows[:n_eval], mask)


def text_task(model: Any, *, n_rows: int = 64, seq_len: int = SEQ_LEN, n_eval: int = 8, seed: int = 0) -> Task:
    """Next-token loss on the standard library's docstrings, joined and cut into rows of ``seq_len`` tokens
    that each start with BOS; every target counts; the first ``n_eval`` rows are held out."""
    n_rows, seq_len = positive_int(n_rows, what="n_rows", minimum=2), positive_int(seq_len, what="seq_len", minimum=3)
    if seq_len > model_dims(model).n_ctx:
        raise InvalidArgumentError(f"seq_len {seq_len} exceeds the model's context of {model_dims(model).n_ctx} tokens.")
    width, stream = seq_len - 1, []
    for text in stdlib_text_prompts(None, n_chars=2000, seed=seed):
        stream += model.to_tokens(text, prepend_bos=False)[0].tolist()
        if len(stream) >= n_rows * width:
            break
    if len(stream) < n_rows * width:
        raise InvalidArgumentError(f"the standard library's docstrings give {len(stream) // width} rows of {seq_len} tokens; "
                                   f"asked for {n_rows}.")
    body = torch.tensor(stream[: n_rows * width]).view(n_rows, width)
    rows = torch.cat([torch.full((n_rows, 1), bos_token_id(model)), body], dim=1)
    return _split("text", rows, torch.ones(width, dtype=torch.bool), n_eval)


def keyword_task(model: Any, *, n_rows: int = 96, seq_len: int = 16, n_eval: int = 16, seed: int = 0) -> Task:
    """Rows ``BOS, random tokens holding one of two keywords, label``: label 0 goes with keyword 0; only the
    label counts. Token ids are drawn with ``seed`` from the vocabulary above 8 (often special tokens)."""
    n_rows, seq_len = positive_int(n_rows, what="n_rows", minimum=2), positive_int(seq_len, what="seq_len", minimum=4)
    d_vocab = model_dims(model).d_vocab
    if d_vocab < 24:
        raise InvalidArgumentError(f"keyword_task needs a vocabulary of at least 24 tokens, got {d_vocab}.")
    gen = torch.Generator().manual_seed(as_seed(seed))
    ids = torch.randperm(d_vocab - 8, generator=gen)[:4] + 8
    keywords, labels = ids[:2], ids[2:]
    allowed = torch.tensor([i for i in range(8, d_vocab) if i not in set(ids.tolist())])
    filler = allowed[torch.randint(0, allowed.numel(), (n_rows, seq_len - 2), generator=gen)]
    cls = torch.randint(0, 2, (n_rows,), generator=gen)
    where = torch.randint(0, seq_len - 2, (n_rows,), generator=gen)
    filler[torch.arange(n_rows), where] = keywords[cls]
    rows = torch.cat([torch.full((n_rows, 1), bos_token_id(model)), filler, labels[cls][:, None]], dim=1)
    return _split("keyword", rows, torch.arange(seq_len - 1) == seq_len - 2, n_eval)


def task_loss(logits: Tensor, tokens: Tensor, mask: Tensor) -> Tensor:
    """Mean float32 cross-entropy of the counted next-token targets."""
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)  # (B, T-1)
    m = mask.to(nll.device)[None].expand_as(nll)
    return nll[m].mean()


@torch.no_grad()
def evaluate(model: Any, task: Task, adapter: Adapter | None = None, *, batch_size: int = 16) -> dict[str, float]:
    """Eval loss (mean over counted targets) and argmax accuracy on them, with ``adapter`` if given."""
    device, n_rows = model_device(model), task.eval.shape[0]
    mask = task.loss_mask.to(device)
    total, correct = torch.zeros((), device=device), torch.zeros((), device=device)
    with eval_mode(model), (adapted(model, adapter) if adapter is not None else nullcontext()):
        for start in range(0, n_rows, batch_size):
            tokens = task.eval[start:start + batch_size].to(device)
            logits = model(tokens)
            total += task_loss(logits, tokens, mask) * tokens.shape[0]  # every row counts the same targets
            correct += (logits[:, :-1].argmax(-1) == tokens[:, 1:])[:, mask].sum()
    return {"loss": float(total) / n_rows, "accuracy": float(correct) / (n_rows * int(task.loss_mask.sum()))}


@contextmanager
def frozen(model: Any) -> Iterator[None]:
    """The model's parameters need no gradient inside the block."""
    params = [p.requires_grad_(False) for p in model.parameters() if p.requires_grad]
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


@dataclass
class TrainResult:
    """One run: batch loss per step, eval loss and accuracy before and after, parameters and seconds."""

    method: str
    task: str
    n_params: int
    steps: int
    lr: float
    losses: list[float] = field(default_factory=list)
    eval_before: dict[str, float] = field(default_factory=dict)
    eval_after: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def summary(self) -> str:
        b, a = self.eval_before, self.eval_after
        return (f"{self.method:<12} {self.n_params:>9,d} params  eval loss {b['loss']:.4f} -> {a['loss']:.4f}  "
                f"accuracy {b['accuracy']:.3f} -> {a['accuracy']:.3f}  ({self.steps} steps, {self.seconds:.1f} s)")


def train_adapter(model: Any, adapter: Adapter, task: Task, *, steps: int = 200, lr: float = 1e-3,
                  batch_size: int = BATCH_SIZE, seed: int = 0) -> TrainResult:
    """AdamW on ``adapter`` alone (model frozen, eval mode): ``steps`` batches of ``batch_size`` rows drawn with
    ``seed``, learning rate decayed by a cosine to 10 % of ``lr``."""
    steps, batch_size = positive_int(steps, what="steps", minimum=0), positive_int(batch_size, what="batch_size")
    lr = finite_number(lr, what="lr", low=0.0, low_open=True)
    device, gen = model_device(model), torch.Generator().manual_seed(as_seed(seed))
    opt = torch.optim.AdamW([p for p in adapter.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    result = TrainResult(adapter.method, task.name, adapter.n_params(), steps, lr)
    start = time.perf_counter()
    with frozen(model):
        result.eval_before = evaluate(model, task, adapter)
        losses = []
        with eval_mode(model), adapted(model, adapter):
            for step in range(steps):
                opt.param_groups[0]["lr"] = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / max(steps, 1))))
                rows = torch.randint(0, task.train.shape[0], (batch_size,), generator=gen)
                tokens = task.train[rows].to(device)
                loss = task_loss(model(tokens), tokens, task.loss_mask)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.detach())
        result.losses = [float(x) for x in torch.stack(losses).cpu()] if losses else []
        result.eval_after = evaluate(model, task, adapter)
    result.seconds = time.perf_counter() - start
    return result
