"""The training loop: read it top to bottom, like nanoGPT's ``train.py``.

:func:`train` builds a :class:`~sinklens.sinklm.model.SinkLM` from ``cfg.model`` (seeded by
``cfg.seed``), a :class:`~sinklens.train.data.TokenSource` from ``cfg.data`` (ordered by
``cfg.data.seed`` only), AdamW with warmup + cosine decay (:func:`get_lr`), and then for every step:
evaluate (every ``eval.interval`` steps: validation loss, sink metrics, persistence of the step-0
bias), accumulate gradients over ``grad_accum`` micro-batches (under ``cfg.autocast`` on CUDA and
``cfg.cpu_autocast`` on a CPU: :mod:`sinklens.train.precision`), clip, step, log a JSON line,
checkpoint. Training-time interventions (``(hook_name, fn)`` pairs, e.g. from
:mod:`sinklens.interventions`) are attached with ``model.hooks(...)`` around every forward, so a
model can be pretrained with its sink moved. Under ``torchrun`` the model is wrapped in DDP.

Examples:
    >>> from sinklens.sinklm.config import OptimConfig
    >>> opt = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10)
    >>> [round(get_lr(s, opt, total_steps=100), 6) for s in (0, 9, 10, 55, 100, 200)]
    [0.0001, 0.001, 0.001, 0.00055, 0.0001, 0.0001]
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import torch
from jaxtyping import Int
from torch import Tensor
from tqdm.auto import tqdm

from sinklens.display import CompactRepr
from sinklens.inputs import TokenBatch
from sinklens.streaming import HookFn
from sinklens.distributed import writes_outputs
from sinklens.errors import (
    InvalidArgumentError, OutputExistsError, RunExistsError, RunNotFoundError, TrainingDivergedError,
    TrainingInterrupted,
)
from sinklens.export import json_line, write_json
from sinklens.train.compile import CompileSwitch
from sinklens.train.allocator import retained_cpu_memory
from sinklens.sinklm.checkpoint import (
    METRICS, TOKENIZER, RunLock, check_data_fingerprint, clean_stale, discard_set_aside, foreign_entries,
    has_checkpoint, is_run_dir, load_checkpoint, load_run, read_metrics, recover_set_aside, restore_set_aside,
    resume_changes, save_checkpoint, save_tokenizer, set_aside_run, set_aside_runs, tokenizer_problem,
    write_data_fingerprint, write_metrics,
)
from sinklens.sinklm.config import OptimConfig, TrainConfig
from sinklens.train.data import TokenSource, build_source, data_fingerprint
from sinklens.distributed.ddp import DistContext, cleanup_distributed, init_distributed
from sinklens.train.interrupt import StopSignals
from sinklens.sinklm.matmul import cpu_matmul_backend, set_cpu_matmul
from sinklens.sinklm.model import next_token_loss
from sinklens.train.persistence import PersistenceTracker
from sinklens.train.precision import mixed_precision
from sinklens.validate import positive_int, writable_dir

Hooks = list[tuple[str, HookFn]]
#: A training-time intervention: a registry spec string ``"name:key=value,..."`` or ``model -> hooks``.
Intervention = Union[str, Callable[[Any], Hooks]]

#: Dense bf16 peak FLOP/s per GPU, for the MFU estimate (matched against the device name).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12, "4090": 165e12, "3090": 71e12}


# ----------------------------------------------------------------------------------------------
# Pieces of the loop


def get_lr(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Learning rate at ``step``: linear warmup, cosine decay to ``min_lr`` at ``decay_steps``, then flat.

    ``lr·(step+1)/warmup_steps`` for ``step < warmup_steps``; then
    ``min_lr + ½(1 + cos(π·r))·(lr - min_lr)`` with ``r = (step - warmup)/(decay - warmup)``;
    ``min_lr`` from ``decay_steps`` (default ``total_steps``) on.
    """
    decay = optim.decay_steps or total_steps
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if step >= decay:
        return optim.final_lr
    ratio = (step - optim.warmup_steps) / max(1, decay - optim.warmup_steps)
    return optim.final_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (optim.lr - optim.final_lr)


#: Device types whose AdamW ``fused=None`` resolves to the fused kernel.
FUSED_ADAMW_DEVICES = ("cuda", "cpu")


def configure_optimizer(model: Any, optim: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over ``model.param_groups`` (no weight decay on <2-D parameters).

    ``optim.fused=None``: the fused kernel on CUDA and on the CPU (one pass over each parameter: at the
    ``headnorm-cpu`` configuration 1.5 ms a step against 12–21 ms for the multi-tensor ``foreach`` one,
    ``benchmarks/RESULTS.md``), the ``foreach`` one on other devices.
    """
    params = inspect.signature(torch.optim.AdamW).parameters
    fused = (device.type in FUSED_ADAMW_DEVICES and "fused" in params) if optim.fused is None else bool(optim.fused)
    extra: dict[str, Any] = {"fused": True} if fused else ({"foreach": True} if "foreach" in params else {})
    return torch.optim.AdamW(
        model.param_groups(optim.weight_decay), lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, **extra
    )


def resolve_interventions(model: Any, interventions: Sequence[Intervention]) -> Hooks:
    """The ``(hook_name, fn)`` pairs of training-time interventions, built by the intervention registry.

    A string is a registry spec ``"name:key=value,..."`` (e.g. ``"restart:positions=16"`` →
    :func:`sinklens.interventions.masks.restart`, which makes every query at or after 16 ignore
    keys before 16, so position 16 becomes a second "first token"); see
    :func:`sinklens.interventions.registry.build`. A callable is called with the model.
    """
    from sinklens.interventions import registry

    hooks: Hooks = []
    for item in interventions:
        hooks.extend(registry.build(model, item))
    return hooks


def check_interventions(interventions: Sequence[Intervention]) -> None:
    """Validate intervention specs without a model (registered name, ``key=value`` arguments)."""
    from sinklens.interventions import registry

    for item in interventions:
        registry.check_spec(item)


def micro_batch(rows: Int[Tensor, "batch seq_plus_1"], micro: int, cfg: TrainConfig, dist: DistContext) -> Tensor:
    """This process's rows of micro-step ``micro``: the global batch is cut into ``grad_accum`` micro
    batches, and each into ``world_size`` equal slices, so every (world size, accumulation) split of
    the same step trains on the same sequences."""
    per_micro = cfg.batch_size // cfg.grad_accum
    per_rank = per_micro // dist.world_size
    start = micro * per_micro + dist.rank * per_rank
    return rows[start : start + per_rank]


def forward_backward(
    model: Any,
    rows: Int[Tensor, "batch seq_plus_1"],
    *,
    hooks: Hooks = (),
    loss_scale: float = 1.0,
    autocast: Any = contextlib.nullcontext(),
    hook_owner: Any = None,
    scaler: torch.amp.GradScaler | None = None,
) -> Tensor:
    """One micro-step: next-token cross-entropy of ``rows[:, 1:]`` given ``rows[:, :-1]``, backward
    of ``loss * loss_scale`` (multiplied by float16's loss ``scaler`` when given, through
    ``scaler.scale`` so that its ``unscale_``/``step`` see it); returns the unscaled loss (detached).
    ``hook_owner`` is the module that owns the hook points (the unwrapped model when ``model`` is DDP
    or compiled)."""
    inputs, targets = rows[:, :-1], rows[:, 1:]
    owner = hook_owner if hook_owner is not None else model
    with autocast, owner.hooks(fwd_hooks=list(hooks)) if hooks else contextlib.nullcontext():
        logits = model(inputs, return_type="logits")  # (B, T, V)
    loss = next_token_loss(logits, targets)
    scaled = loss * loss_scale if loss_scale != 1.0 else loss
    (scaler.scale(scaled) if scaler is not None else scaled).backward()
    return loss.detach()


def estimate_mfu(flops_per_token: float, tokens_per_s: float, device: torch.device) -> float | None:
    """Model FLOPs utilisation: ``flops_per_token × tokens/s`` over the GPU's dense bf16 peak
    (:data:`PEAK_FLOPS`); None on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((value for key, value in PEAK_FLOPS.items() if key in name), None)
    return None if peak is None else flops_per_token * tokens_per_s / peak


def eval_batches(source: TokenSource, cfg: TrainConfig, device: torch.device) -> tuple[list[TokenBatch], list[Tensor]]:
    """The fixed held-out batches every evaluation uses (validation split, steps ``0..batches-1``)."""
    batches, targets = [], []
    for i in range(cfg.eval.batches):
        rows = source.batch("val", i, cfg.eval.batch_size).to(device)
        inputs = rows[:, :-1]
        batches.append(TokenBatch(inputs, torch.ones_like(inputs, dtype=torch.bool), source.bos_id is not None))
        targets.append(rows[:, 1:])
    return batches, targets


@dataclass(repr=False, eq=False)
class TrainResult(CompactRepr):
    """What :func:`train` returns.

    Attributes:
        model: the trained (unwrapped) :class:`~sinklens.sinklm.model.SinkLM`, in train mode.
        history: the metrics lines (also in ``out_dir/metrics.jsonl``): ``kind="train"`` lines
            with ``loss`` (mean over the step's batch), ``lr``, ``grad_norm`` (before clipping),
            ``tokens_per_s``, ``mfu``; ``kind="eval"`` lines with ``val_loss``, sink metrics and
            ``persistence_*`` (correlations with step 0, :mod:`sinklens.train.persistence`); in a
            resumed run a ``kind="resume"`` line where it was picked up (``step``, ``changes``:
            ``{config key: [before, now]}``).
        out_dir: the run directory, or None.
        compile: whether this process trained compiled and why (``TrainConfig.compile``, see
            :mod:`sinklens.train.compile`): ``mode``, ``compiled``, ``reason``, ``compile_s``
            (seconds the first compiled step took beyond an eager one), ``error`` (a failed
            compile, after which the run went on eagerly), ``eager_step_s`` and
            ``compiled_step_s`` (``"auto"``'s timings: it keeps the compiled model only where it
            measured faster). Also a ``kind="compile"`` metrics line when a compile was attempted
            and another when ``"auto"`` checked it, and ``compiled`` on every ``kind="train"`` line.
        cpu: the CPU fast paths of the run: ``device`` (the device type it trained on),
            ``matmul`` (``"onednn"`` or ``"aten"``: the backend ``TrainConfig.cpu_matmul`` resolved
            to, used for CPU float32 products only, :mod:`sinklens.sinklm.matmul`),
            ``matmul_fallback_reason`` (why ``"auto"`` fell back to aten, else None) and
            ``retained_memory`` (freed memory kept mapped during a CPU run,
            :mod:`sinklens.train.allocator`), ``autocast`` (the forward's autocast dtype,
            ``"bfloat16"``/``"float16"``, or ``"none"``: :mod:`sinklens.train.precision`).
    """

    model: Any
    history: list[dict[str, Any]] = field(default_factory=list)
    out_dir: Path | None = None
    compile: dict[str, Any] = field(default_factory=dict)
    cpu: dict[str, Any] = field(default_factory=dict)

    def losses(self) -> list[float]:
        return [line["loss"] for line in self.history if line["kind"] == "train"]

    def evals(self) -> list[dict[str, Any]]:
        return [line for line in self.history if line["kind"] == "eval"]


def _read_history(run_dir: Path, before_step: int) -> list[dict[str, Any]]:
    """Metrics lines of an interrupted run up to (not including) ``before_step`` (evals at it kept out too)."""
    if not (run_dir / METRICS).is_file():
        return []
    return [line for line in read_metrics(run_dir) if line["step"] < before_step]


def _check_run_dir(out: Path | None, *, resume: bool, overwrite: bool) -> None:
    """Read-only checks of the run directory, before any work: refuse to clobber a run by accident."""
    if resume and overwrite:
        raise InvalidArgumentError("resume and overwrite exclude each other: resume continues the run in out_dir, "
                                   "overwrite deletes it.")
    if out is None:
        if resume:
            raise InvalidArgumentError("resume=True needs out_dir, the run directory to continue.")
        return
    if out.exists() and not out.is_dir():
        raise InvalidArgumentError(f"out_dir {str(out)!r} exists and is not a folder.")
    foreign = foreign_entries(out)
    if foreign and not resume:
        raise OutputExistsError(
            f"out_dir {str(out)!r} is not a sinklens training run but holds {', '.join(foreign)} (another tool's "
            f"files?), which a run there would replace or be loaded with; "
            + ("overwrite=True (--overwrite) only replaces a sinklens run. " if overwrite else "")
            + "Pick an empty or new out_dir."
        )
    if resume and not has_checkpoint(out):
        again = (" It stopped before its first checkpoint, so there is nothing to continue: start it again with "
                 "overwrite=True (--overwrite instead of --resume), or pick another out_dir.") if is_run_dir(out) else ""
        raise RunNotFoundError(f"resume=True but {str(out)!r} holds no checkpoint to resume from.{again}")
    if not resume and not overwrite and is_run_dir(out):
        if not has_checkpoint(out):  # a run that failed before its first checkpoint: --resume cannot continue it
            raise RunExistsError(
                f"{str(out)!r} already holds a training run that stopped before its first checkpoint (it has "
                f"config.json or metrics.jsonl but nothing to resume from). Start it again with overwrite=True "
                f"(--overwrite), which deletes what it left, or pick another out_dir."
            )
        raise RunExistsError(
            f"{str(out)!r} already holds a training run. Continue it with resume=True (--resume), replace it "
            f"with overwrite=True (--overwrite), or pick another out_dir."
        )


def _resolve_vocab(cfg: TrainConfig, source: TokenSource) -> TrainConfig:
    """``cfg`` with ``model.d_vocab="auto"`` replaced by the data's vocabulary; checks an explicit one is large enough."""
    if cfg.model.d_vocab == "auto":
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_vocab=source.vocab_size))
    if source.vocab_size > cfg.model.d_vocab:
        raise InvalidArgumentError(
            f"The data uses {source.vocab_size} token ids but model.d_vocab={cfg.model.d_vocab}; "
            f"set model.d_vocab={source.vocab_size} (or larger, or 'auto'), e.g. --set model.d_vocab={source.vocab_size}."
        )
    return cfg


def try_interventions(model: Any, hooks: Hooks, cfg: TrainConfig) -> bool:
    """Run the hooks of the training-time interventions given as registry specs once on the run's training
    sequences (``data.seq_len`` tokens), before the run directory is touched, so that one that cannot run there (a
    position past those sequences) is an error up front rather than at the first step, with ``config.json``
    already written. (A callable intervention is the caller's own code and is not called before the run.)

    Returns whether they also run on the persistence probe's shorter sequences (``eval.persistence_seq_len``, when
    persistence is measured); where they do not (a position past the probe's sequences, which would not exist on
    them anyway), the probe measures the model without them, at step 0 and later alike, so that the metric still
    compares like with like.

    Raises:
        InvalidArgumentError: they cannot run on the training sequences; the message names ``data.seq_len``.
    """
    if not hooks:
        return True
    device = next(model.parameters()).device

    def runs_on(length: int) -> InvalidArgumentError | None:
        tokens = torch.zeros(1, length, dtype=torch.long, device=device)
        try:
            with torch.no_grad(), model.hooks(fwd_hooks=hooks):
                model(tokens)
        except InvalidArgumentError as error:
            return error
        return None

    error = runs_on(cfg.data.seq_len)
    if error is not None:
        raise InvalidArgumentError(f"A training-time intervention cannot run on the run's {cfg.data.seq_len}-token "
                                   f"training sequences (data.seq_len={cfg.data.seq_len}): {error}") from None
    probe = min(cfg.eval.persistence_seq_len, cfg.data.seq_len)
    if not (cfg.eval.interval and cfg.eval.persistence_sequences) or probe >= cfg.data.seq_len:
        return True
    error = runs_on(probe)
    if error is None:
        return True
    warnings.warn(f"The training-time interventions cannot run on the persistence probe's {probe}-token sequences "
                  f"(eval.persistence_seq_len={cfg.eval.persistence_seq_len}): {error} Persistence is measured without "
                  f"them; raise eval.persistence_seq_len to measure it with them.", stacklevel=3)
    return False


def _keep_finite_weights(step: int, start_step: int, saved: set[int], resumed: bool, out: Path | None,
                         checkpoint: Callable[..., None], weights_problem: Callable[[], str | None] = lambda: None) -> str:
    """What a run that diverged at ``step`` keeps, and say it: its last finite checkpoint (the newest of ``saved``,
    or the one it resumed from) stays current; a run with none checkpoints its finite weights after ``step``
    steps (the bad update was dropped), so that it is never lost."""
    if out is None:
        return "nothing was saved (no out_dir)"
    if saved or resumed:
        return f"its last finite checkpoint (step {max(saved, default=start_step)}) in {str(out)!r} is kept"
    if step > start_step:
        bad = weights_problem()
        if bad is not None:  # an earlier update (with a finite loss) already broke them: nothing finite to keep
            return f"it had no checkpoint, and its weights after step {step} are not finite ({bad}), so none was written"
        checkpoint(step, regular=False)
        return (f"it had no checkpoint, so its finite weights after step {step} are checkpointed in {str(out)!r} "
                "(--resume continues from there)")
    return f"no step had finished, so {str(out)!r} holds no checkpoint"


def _interrupted(
    signal_name: str, step: int, start_step: int, steps: int, out: Path | None, checkpoint: Callable[..., None]
) -> TrainingInterrupted:
    """Checkpoint the ``step`` steps done (when any were done since ``start_step``) and say so."""
    if step > start_step and out is not None:
        checkpoint(step, regular=False)
        kept = f"its checkpoint is saved in {str(out)!r}; continue with --resume (train(..., resume=True))"
    elif out is not None:
        kept = f"no step had finished since step {start_step}, so the run in {str(out)!r} is as it was"
    else:
        kept = "nothing was saved (no out_dir)"
    return TrainingInterrupted(f"{signal_name} at step {step} of {steps}: training stopped after a whole step; {kept}.")


# ----------------------------------------------------------------------------------------------
# The loop


def train(
    cfg: TrainConfig,
    *,
    out_dir: str | Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    interventions: Sequence[Intervention] = (),
    progress: bool = True,
    until: int | None = None,
) -> TrainResult:
    """Train a SinkLM as ``cfg`` describes; write metrics, checkpoints and tokenizer to ``out_dir``.

    Nothing in ``out_dir`` is touched until the whole set-up has succeeded: the run directory is
    checked, the data source built (``model.d_vocab="auto"`` resolved from it, once), the model and
    optimizer built and every intervention built on the model; only then is the folder written.

    Args:
        out_dir: run directory (``config.json``, ``metrics.jsonl``, ``checkpoint.json`` and
            ``checkpoints/``, ``tokenizer/``; see :mod:`sinklens.sinklm.checkpoint`); None keeps
            everything in memory.
        resume: continue from the newest good checkpoint in ``out_dir`` (its step, weights,
            optimizer, RNG); the loss curve continues exactly as if the run had not stopped. ``cfg``
            is the run's own (:func:`~sinklens.sinklm.checkpoint.resume_config`), changed at most in how the run goes
            on (``steps``, ``optim``, ``eval``...: :func:`~sinklens.sinklm.checkpoint.resume_changes`);
            a ``kind="resume"`` metrics line records the step and those changes.
        overwrite: replace the run already in ``out_dir`` and start afresh: its own files are moved
            aside, deleted at the new run's first checkpoint and restored if the new run fails before it.
            Without ``resume`` or ``overwrite``, a folder that holds a run raises
            :class:`~sinklens.errors.RunExistsError`; one that holds another tool's files (a model's
            ``config.json``, ``model.safetensors``, ``tokenizer/``) raises
            :class:`~sinklens.errors.OutputExistsError` either way.
        interventions: extra training-time interventions on top of ``cfg.interventions``: registry spec strings
            are added to ``cfg.interventions`` (so ``config.json`` stores them and a resume applies them again);
            callables ``model -> [(hook_name, fn)]``, which no file can store, run after them and must be passed
            again on resume.
        progress: tqdm bar over steps.
        until: stop (and checkpoint) after this many steps of ``cfg.steps`` — a time-limited job;
            the schedule still spans ``cfg.steps``, and ``resume=True`` continues from there. An integer
            ``>= 0`` (0 writes the step-0 checkpoint only).

    Raises:
        ResumeMismatchError: ``resume=True`` with a ``cfg`` whose model, data or seed differ from the run's, or
            data that changed since the run started (its stored fingerprint: tokenizer, token streams).
        RunLockedError: another process is training in ``out_dir`` (it holds ``out_dir/.lock``).
        TrainingInterrupted: Ctrl-C or SIGTERM (not in DDP runs): the step in progress finished, the
            steps done were checkpointed, and the run can go on with ``resume=True``; a second signal
            stops at once (:mod:`sinklens.train.interrupt`).
        TrainingDivergedError: a step's loss or gradient norm was NaN/inf (``cfg.on_nonfinite="stop"``,
            or a non-finite step right after ``cfg.max_skips`` skipped steps in a row); the last finite checkpoint is kept (a
            run with none checkpoints its finite weights) and metrics.jsonl ends with a ``kind="nonfinite"`` line; also
            weights that turned NaN/inf after a finite loss, found when a checkpoint is due (never checkpointed).
        InvalidArgumentError: among others, ``resume=True`` on a run already at ``cfg.steps`` (or ``until``), or
            a registry intervention that cannot run on the run's sequences (checked before ``out_dir`` is touched).
    """

    out = Path(out_dir).expanduser() if out_dir is not None else None
    if until is not None:
        until = positive_int(until, what="until", minimum=0)
    cfg = cfg.replace(data=cfg.data.with_absolute_path())  # config.json names the same data from any folder
    check_interventions([*cfg.interventions, *interventions])
    # Registry specs are part of the run: stored with cfg.interventions in config.json, so a resume applies them.
    specs = [item for item in interventions if isinstance(item, str)]
    twice = [spec for spec in specs if spec in cfg.interventions]
    if twice:
        raise InvalidArgumentError(
            f"intervention {twice[0]!r} is given twice: in cfg.interventions (a resumed run's config stores the ones "
            "it was trained with) and in interventions=; pass it once.")
    if specs:
        cfg = cfg.replace(interventions=[*cfg.interventions, *specs])
        interventions = [item for item in interventions if not isinstance(item, str)]
    if cfg.keep_every and not cfg.checkpoint_interval:
        warnings.warn(f"keep_every={cfg.keep_every} keeps every {cfg.keep_every}-th periodic checkpoint, but "
                      "checkpoint_interval=0 writes none: only the final checkpoint and its fallback are kept. Set "
                      "checkpoint_interval (e.g. --set checkpoint_interval=100) to keep periodic ones.", stacklevel=2)
    # one trainer per run directory (only the process that writes it, rank 0, holds the lock)
    with RunLock(out) if out is not None and writes_outputs() else contextlib.nullcontext():
        return _train(cfg, out, resume=resume, overwrite=overwrite, interventions=interventions, progress=progress,
                      until=until)


def _check_weights_finite(model: Any) -> str | None:
    """None if every parameter of ``model`` is finite, else which are not (one host sync: checkpoints only)."""
    params = list(model.named_parameters())
    flags = torch.stack([torch.isfinite(p).all() for _, p in params]).tolist()
    bad = [name for (name, _), ok in zip(params, flags) if not ok]
    if not bad:
        return None
    return f"{len(bad)} of {len(params)} parameter tensors hold NaN/inf ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})"


def _train(cfg: TrainConfig, out: Path | None, *, resume: bool, overwrite: bool, interventions: Sequence[Intervention],
           progress: bool, until: int | None) -> TrainResult:
    """:func:`train` once the run directory is locked."""
    from sinklens.sinklm.model import SinkLM

    if out is not None and out.is_dir() and writes_outputs():
        recovered = recover_set_aside(out)  # an overwrite killed before its first checkpoint: the old run comes back
        if recovered is not None:
            warnings.warn(recovered, stacklevel=3)
    _check_run_dir(out, resume=resume, overwrite=overwrite)
    resumed_from = load_run(out) if out is not None and resume else None  # verified once: compared, then loaded
    resume_changed = resume_changes(resumed_from.config, cfg, run_dir=out) if resumed_from is not None else {}
    dist, device = init_distributed(cfg.device)
    matmul_before = cpu_matmul_backend()["requested"]
    resources = contextlib.ExitStack()
    overwritten: list[Path] = []  # the run that overwrite=True replaces, until the new one's first checkpoint
    try:
        set_cpu_matmul(cfg.cpu_matmul)  # raises before any work when "onednn" is asked for and missing
        # ---- data: the order depends on cfg.data only; d_vocab="auto" is resolved here, once
        source = build_source(cfg.data, d_vocab=None if cfg.model.d_vocab == "auto" else cfg.model.d_vocab)
        cfg = _resolve_vocab(cfg, source)
        fingerprint = data_fingerprint(source)  # what the data is beyond its config (tokenizer, token streams)
        fingerprinted = resumed_from is not None and check_data_fingerprint(out, fingerprint)
        if resumed_from is not None and not fingerprinted and fingerprint:
            warnings.warn(f"The run in {str(out)!r} was written before runs stored a fingerprint of their data, so "
                          "this resume cannot check that the data (tokenizer, token ids) is what it trained on; later "
                          "resumes check it against the data used from here on.", stacklevel=3)
        per_rank, rem = divmod(cfg.batch_size // cfg.grad_accum, dist.world_size)
        if rem or per_rank == 0:
            raise InvalidArgumentError(
                f"batch_size={cfg.batch_size} does not split into grad_accum={cfg.grad_accum} micro-batches "
                f"over {dist.world_size} processes; use a multiple of {cfg.grad_accum * dist.world_size}."
            )

        # ---- model, optimizer, interventions: init depends on cfg.seed; all built before out_dir is touched
        torch.manual_seed(cfg.seed)
        model = SinkLM(cfg.model).to(device)
        model.tokenizer = source.tokenizer
        optimizer = configure_optimizer(model, cfg.optim, device)
        precision = mixed_precision(cfg, device)
        autocast, scaler = precision.autocast, precision.scaler
        hooks = resolve_interventions(model, [*cfg.interventions, *interventions])
        specs = [item for item in [*cfg.interventions, *interventions] if isinstance(item, str)]
        # fresh hooks: a trial leaves no state. The persistence probe runs without the spec interventions where
        # they cannot run on its shorter sequences (try_interventions says why)
        probe_all = try_interventions(model, resolve_interventions(model, specs), cfg)
        probed = [item for item in [*cfg.interventions, *interventions] if probe_all or not isinstance(item, str)]
        probe_hooks = hooks if probe_all else resolve_interventions(model, probed)

        # ---- the run directory: written only from here on
        start_step = 0
        history: list[dict[str, Any]] = []
        if resumed_from is not None:
            start_step = load_checkpoint(resumed_from, model=model, optimizer=optimizer, scaler=scaler)
            history = _read_history(out, start_step)
        stop = cfg.steps if until is None else min(until, cfg.steps)
        if resumed_from is not None and start_step >= stop:  # re-saving would replace step `stop`'s checkpoint
            asked = f"steps={cfg.steps}" + ("" if until is None else f" and until={until}")
            raise InvalidArgumentError(
                f"The run in {str(out)!r} is at step {start_step} already; {asked} leave nothing to train. "
                f"Pass a larger --steps (train(..., resume=True) with cfg.steps > {start_step}) to continue it."
            )
        if out is not None and dist.is_main:
            writable_dir(out, what="out_dir")
            if overwrite:  # the old run is moved aside: deleted at the new run's first checkpoint, restored on failure
                overwritten.extend(p for p in [set_aside_run(out)] if p is not None)
            clean_stale(out)
            write_json(out / "config.json", cfg.to_dict(), digits=None)
            write_metrics(out, history)  # a resumed run keeps only the lines before its checkpoint
            if not fingerprinted:
                write_data_fingerprint(out, fingerprint)
            if resumed_from is not None and source.tokenizer is not None:  # a kill may have left it broken or missing
                problem = tokenizer_problem(out)
                if problem is not None:
                    if (out / TOKENIZER).exists():
                        warnings.warn(f"{problem}; it is written again from the data's tokenizer.", stacklevel=3)
                    save_tokenizer(out, source.tokenizer)

        raw_model = model

        def wrap(module: Any) -> Any:  # what a step calls: the (possibly compiled) model, in DDP when distributed
            if not dist.enabled:
                return module
            from torch.nn.parallel import DistributedDataParallel as DDP

            return DDP(module, device_ids=[device.index] if device.type == "cuda" else None)

        # compile=True now, False never, "auto" when safe and the run is long enough (sinklens.train.compile)
        switch = CompileSwitch(cfg.compile, raw_model, wrap, device, hooks=bool(hooks), distributed=dist.enabled,
                               steps_left=stop - start_step)
        val_batches, val_targets = eval_batches(source, cfg, device) if cfg.eval.interval and dist.is_main else ([], [])
        persist = PersistenceTracker(cfg, out, lambda m: probe_hooks if m is raw_model else resolve_interventions(
            m, probed))
        if resume and dist.is_main:
            persist.resume(device)
        flops_per_token = raw_model.flops_per_token(cfg.data.seq_len)
        tokens_per_step = cfg.batch_size * cfg.data.seq_len
        metrics_file = open(out / "metrics.jsonl", "a") if out is not None and dist.is_main else None  # noqa: SIM115

        def log(line: dict[str, Any]) -> None:
            history.append(line)
            if metrics_file is not None:
                metrics_file.write(json_line(line) + "\n")  # strict JSON: a non-finite number is written null
                metrics_file.flush()

        if resumed_from is not None and dist.is_main:  # where the run was picked up again, and what changed then
            log({"kind": "resume", "step": start_step, "changes": resume_changed})

        def run_eval(step: int) -> None:
            from sinklens.train.sink_metrics import evaluate

            metrics = evaluate(raw_model, val_batches, val_targets, threshold=cfg.eval.sink_threshold, extra_hooks=hooks)
            log({"kind": "eval", "step": step, **metrics.scalars(), **persist.measure(raw_model)})

        saved_steps: set[int] = set()
        leftovers = [] if out is None else set_aside_runs(out)  # runs an earlier overwrite set aside (named, kept)

        def last_checkpoint() -> str:
            if saved_steps or resumed_from is not None:
                return f"its last finite checkpoint (step {max(saved_steps, default=start_step)}) in {str(out)!r} is kept"
            return f"{str(out)!r} holds no checkpoint of this run"

        def checkpoint(step: int, *, regular: bool = True) -> None:  # once per step: Ctrl-C right after a periodic
            # checkpoint writes none. regular=False: what a divergence or Ctrl-C saves; the run an overwrite replaces
            # is deleted only after a regular (periodic or final) one
            if out is not None and step not in saved_steps:
                bad = _check_weights_finite(raw_model)  # at checkpoints only: never a per-step host sync
                if bad is not None:  # a finite loss, yet the update left NaN/inf weights: never checkpoint them
                    log({"kind": "nonfinite", "step": step, "weights": bad, "lr": get_lr(max(step - 1, 0), cfg.optim,
                                                                                         cfg.steps), "action": "stop"})
                    raise TrainingDivergedError(
                        f"Training diverged: the weights after step {step} are not finite ({bad}); the checkpoint of "
                        f"step {step} was not written and {last_checkpoint()}. Lower optim.lr, raise "
                        f"optim.warmup_steps or set optim.grad_clip."
                    )
                if not dist.is_main:
                    return
                save_checkpoint(out, model=raw_model, optimizer=optimizer, cfg=cfg, step=step, scaler=scaler)
                saved_steps.add(step)
                if regular and (overwritten or leftovers):  # a regular checkpoint: the run it replaces goes now
                    discard_set_aside(out)
                    overwritten.clear()
                    leftovers.clear()
                elif overwritten:  # a divergence or Ctrl-C after this checkpoint keeps both: say where the old one is
                    leftovers.extend(overwritten)
                    overwritten.clear()

        def periodic_checkpoint(steps_done: int) -> None:
            if cfg.checkpoint_interval and steps_done % cfg.checkpoint_interval == 0 and steps_done < stop:
                checkpoint(steps_done)

        # ---- the loop
        retained = resources.enter_context(retained_cpu_memory(device.type == "cpu"))
        stops = resources.enter_context(StopSignals(enabled=not dist.enabled))  # Ctrl-C: finish the step, checkpoint
        backend = cpu_matmul_backend()
        cpu = {"device": device.type, "matmul": backend["resolved"], "matmul_fallback_reason": backend["reason"],
               "retained_memory": retained, "autocast": precision.dtype}
        try:
            raw_model.train()
            bar = tqdm(range(start_step, stop), desc="train", disable=not (progress and dist.is_main), initial=start_step,
                       total=cfg.steps)
            skipped = 0
            step_s: float | None = None  # wall time of the last step (timed while "auto" probes)

            def micro_steps(model: Any, rows: Tensor) -> Tensor:
                """Forward and backward of every micro-batch of the step; the summed (unscaled) loss."""
                loss_sum = torch.zeros((), device=device)
                for micro in range(cfg.grad_accum):
                    sync = micro == cfg.grad_accum - 1 or not dist.enabled
                    with contextlib.nullcontext() if sync else model.no_sync():
                        loss_sum += forward_backward(
                            model,
                            micro_batch(rows, micro, cfg, dist),
                            hooks=hooks,
                            loss_scale=1.0 / cfg.grad_accum,
                            autocast=autocast,
                            hook_owner=raw_model,
                            scaler=scaler,
                        )
                return loss_sum

            for step in bar:
                if stops.received:
                    raise _interrupted(stops.received, step, start_step, cfg.steps, out, checkpoint)
                if cfg.eval.interval and dist.is_main and step % cfg.eval.interval == 0:
                    run_eval(step)

                lr = get_lr(step, cfg.optim, cfg.steps)
                for group in optimizer.param_groups:
                    group["lr"] = lr

                switch.maybe_decide(step - start_step, stop - step, step_s)
                first_compiled = switch.compiled and switch.compile_s is None
                timing = switch.decision is None or first_compiled or switch.checking  # sync and time this step
                if timing and device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                rows = source.batch("train", step, cfg.batch_size).to(device, non_blocking=True)  # (B, T+1)
                if first_compiled:
                    try:  # compilation happens here; a failure never ends the run
                        loss_sum = micro_steps(switch.model, rows)
                    except Exception as error:  # noqa: BLE001 - any compiler error: retry this step eagerly
                        optimizer.zero_grad(set_to_none=True)
                        warnings.warn(switch.fall_back(error), stacklevel=2)
                        loss_sum = micro_steps(switch.model, rows)
                else:
                    loss_sum = micro_steps(switch.model, rows)
                step_compiled = switch.compiled  # before "auto" may go back to eager after this step
                if scaler is not None:  # float16 only: gradients were scaled, unscale before clipping
                    scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.optim.grad_clip or float("inf"),
                                                           foreach=True)
                # one host sync per step: a NaN/inf loss or gradient must never reach the weights. Under float16's
                # loss scaler an inf/NaN gradient with a finite loss is the scaler's to handle (it skips that update
                # and lowers the scale); a non-finite loss is divergence either way.
                finite = bool(torch.isfinite(loss_sum if scaler is not None else loss_sum + grad_norm))
                if not finite:
                    optimizer.zero_grad(set_to_none=True)
                    skipped += 1
                    # "skip" drops up to max_skips non-finite steps in a row; the next one stops the run
                    stopping = cfg.on_nonfinite == "stop" or skipped > cfg.max_skips
                    line = {"kind": "nonfinite", "step": step, "loss": float(loss_sum) / cfg.grad_accum,
                            "grad_norm": float(grad_norm), "lr": lr, "action": "stop" if stopping else "skip"}
                    log(line)
                    if stopping:
                        kept = _keep_finite_weights(step, start_step, saved_steps, resumed_from is not None, out,
                                                    checkpoint, lambda: _check_weights_finite(raw_model))
                        if cfg.on_nonfinite == "stop":
                            why, advice = "on_nonfinite='stop'", "or set on_nonfinite='skip' to drop such steps"
                        else:
                            why = f"non-finite again after max_skips={cfg.max_skips} skipped steps in a row"
                            advice = "or raise max_skips to skip more such steps in a row"
                        raise TrainingDivergedError(
                            f"Training diverged at step {step}: loss {line['loss']}, gradient norm {line['grad_norm']} "
                            f"(lr {lr:.3g}); stopped ({why}), {kept}. Lower optim.lr, raise optim.warmup_steps, "
                            f"{advice}."
                        )
                    warnings.warn(f"Step {step}: non-finite loss or gradient; the update was skipped.", stacklevel=2)
                    periodic_checkpoint(step + 1)  # a skipped step is still a step: its checkpoint is due as usual
                    continue
                skipped = 0
                if scaler is not None:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if timing:
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    elapsed = time.perf_counter() - t0
                    if first_compiled:  # compiled now, or failed and went on eagerly (switch.error)
                        if switch.compiled:
                            switch.compile_s = elapsed - (step_s or 0.0)
                        log({"kind": "compile", "step": step, **switch.summary()})
                    elif switch.record_compiled_step(elapsed):  # "auto" kept the compiled model or went back
                        log({"kind": "compile", "step": step, **switch.summary()})
                    step_s = elapsed

                if step % cfg.log_interval == 0 or step == cfg.steps - 1:
                    if dist.enabled:
                        torch.distributed.all_reduce(loss_sum, op=torch.distributed.ReduceOp.AVG)
                    loss_value = float(loss_sum) / cfg.grad_accum  # .item() syncs the device
                    dt = time.perf_counter() - t0
                    tokens_per_s = tokens_per_step / dt
                    log({
                        "kind": "train", "step": step, "loss": loss_value, "lr": lr, "grad_norm": float(grad_norm),
                        "tokens_per_s": tokens_per_s, "mfu": estimate_mfu(flops_per_token, tokens_per_s, device),
                        "compiled": step_compiled,
                    })
                    bar.set_postfix(loss=f"{loss_value:.4f}")
                periodic_checkpoint(step + 1)

            if cfg.eval.interval and dist.is_main and stop == cfg.steps:
                run_eval(cfg.steps)
            checkpoint(stop)
        finally:
            if metrics_file is not None:
                metrics_file.close()
        return TrainResult(model=raw_model, history=history, out_dir=out, compile=switch.summary(), cpu=cpu)
    except BaseException as error:
        if overwritten:  # failed before any checkpoint: the run it was to replace comes back
            restore_set_aside(out, overwritten[0])
        elif out is not None and set_aside_runs(out) and isinstance(error, (TrainingDivergedError, TrainingInterrupted)):
            warnings.warn(f"The run this overwrite replaced is kept in {[str(p) for p in set_aside_runs(out)]}: it is "
                          "deleted once this run writes a regular checkpoint (move its files back to keep it).",
                          stacklevel=2)
        raise
    finally:
        resources.close()
        set_cpu_matmul(matmul_before)
        cleanup_distributed(dist)
