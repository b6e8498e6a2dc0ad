"""The training loop, read top to bottom like nanoGPT's ``train.py``: lock the run folder, build, then evaluate,
train and checkpoint step by step; one ``_Run`` carries the run's state."""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor
from tqdm.auto import tqdm

from sinklens.display import CompactRepr
from sinklens.inputs import TokenBatch
from sinklens.distributed import writes_outputs
from sinklens.errors import InvalidArgumentError, TrainingDivergedError, TrainingInterrupted
from sinklens.export import json_line, write_json
from sinklens.sinklm.checkpoint import (
    METRICS, TOKENIZER, load_checkpoint, load_run, read_metrics, save_checkpoint, save_tokenizer, write_metrics,
)
from sinklens.sinklm.run_folder import (
    RunLock, check_data_fingerprint, check_run_dir, clean_stale, discard_set_aside, recover_set_aside,
    restore_set_aside, resume_changes, set_aside_run, set_aside_runs, tokenizer_problem, write_data_fingerprint,
)
from sinklens.sinklm.config import TrainConfig
from sinklens.train.data import TokenSource, build_source, data_fingerprint
from sinklens.distributed.ddp import DistContext, cleanup_distributed, init_distributed
from sinklens.train.interrupt import StopSignals, interrupted_error
from sinklens.train.interventions import (
    Hooks, Intervention, check_interventions, resolve_interventions, try_interventions,
)
from sinklens.train.loggers import MetricsLog, check_log
from sinklens.train.optim import configure_optimizer, get_lr
from sinklens.train.persistence import PersistenceTracker
from sinklens.train.precision import mixed_precision
from sinklens.train.speed import attention_kernels, compile_failed_warning, compile_model, estimate_mfu, peak_flops
from sinklens.validate import positive_int, writable_dir

@dataclass(repr=False, eq=False)
class TrainResult(CompactRepr):
    """What :func:`train` returns: the trained ``model``, its ``history`` (the lines of ``metrics.jsonl``;
    ``grad_norm`` is before clipping), ``compile`` (``compiled``, ``compile_s`` of the first compiled step,
    ``error``), ``device`` type and ``autocast`` dtype."""

    model: Any
    history: list[dict[str, Any]] = field(default_factory=list)
    compile: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    autocast: str = "none"

    def losses(self) -> list[float]:
        return [line["loss"] for line in self.history if line["kind"] == "train"]

    def evals(self) -> list[dict[str, Any]]:
        return [line for line in self.history if line["kind"] == "eval"]


def micro_batch(rows: Int[Tensor, "batch seq_plus_1"], micro: int, cfg: TrainConfig, dist: DistContext) -> Tensor:
    """This process's rows of micro-step ``micro``: the batch cut into ``grad_accum`` micro-batches, each into
    ``world_size`` slices, so every split of a step trains on the same sequences."""
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
    """One micro-step: next-token cross-entropy of ``rows[:, 1:]`` given ``rows[:, :-1]``, backward of ``loss *
    loss_scale`` (through ``scaler`` when given); returns the unscaled loss, detached. ``hook_owner`` owns the
    hook points (the unwrapped model under DDP or compile)."""
    owner = hook_owner if hook_owner is not None else model
    with autocast, owner.hooks(fwd_hooks=list(hooks)) if hooks else contextlib.nullcontext():
        loss = model(rows[:, :-1], return_type="loss", targets=rows[:, 1:])
    scaled = loss * loss_scale if loss_scale != 1.0 else loss
    (scaler.scale(scaled) if scaler is not None else scaled).backward()
    return loss.detach()


def fetch_rows(source: TokenSource, step: int, cfg: TrainConfig, device: torch.device) -> Tensor:
    """The rows of ``step``, ``(batch, seq_len + 1)``, on ``device`` (on CUDA from pinned memory, non-blocking)."""
    rows = source.batch("train", step, cfg.batch_size)
    return (rows.pin_memory() if device.type == "cuda" else rows).to(device, non_blocking=True)


def eval_batches(source: TokenSource, cfg: TrainConfig, device: torch.device) -> tuple[list[TokenBatch], list[Tensor]]:
    """The fixed held-out batches every evaluation uses (validation split, steps ``0..batches-1``)."""
    rows = [source.batch("val", i, cfg.eval.batch_size).to(device) for i in range(cfg.eval.batches)]
    batches = [TokenBatch(r[:, :-1], torch.ones_like(r[:, :-1], dtype=torch.bool), source.bos_id is not None)
               for r in rows]
    return batches, [r[:, 1:] for r in rows]


def _check_weights_finite(model: Any) -> str | None:
    """None if every parameter of ``model`` is finite, else which are not (one host sync)."""
    params = list(model.named_parameters())
    flags = torch.stack([torch.isfinite(p).all() for _, p in params]).tolist()
    bad = [name for (name, _), ok in zip(params, flags) if not ok]
    more = ", ..." if len(bad) > 3 else ""
    return f"{len(bad)} of {len(params)} parameter tensors hold NaN/inf ({', '.join(bad[:3])}{more})" if bad else None


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
    """Train a SinkLM as ``cfg`` describes; write config, metrics, checkpoints and tokenizer to ``out_dir`` (None:
    in memory), touched only once data, model, optimizer and interventions are built.

    ``resume`` continues from the newest good checkpoint bit-exactly (``cfg`` may change only how the run goes on:
    :func:`~sinklens.sinklm.run_folder.resume_changes`). ``overwrite`` sets the run in ``out_dir`` aside, deletes it
    at the first checkpoint and restores it if the new run fails before; without either, a folder holding a run
    raises ``OutputExistsError``. ``interventions`` add to ``cfg.interventions``: registry specs (stored in
    ``config.json``) or callables ``model -> [(hook_name, fn)]`` (passed again on resume). ``until`` stops (and
    checkpoints) after that many steps; the schedule still spans ``cfg.steps``. Raises ``TrainingInterrupted`` on
    Ctrl-C or SIGTERM (the steps done are checkpointed) and ``TrainingDivergedError`` on a NaN/inf loss or gradient
    (``on_nonfinite``) or non-finite weights at a checkpoint (the last finite checkpoint is kept)."""
    out = Path(out_dir).expanduser() if out_dir is not None else None
    until = None if until is None else positive_int(until, what="until", minimum=0)
    check_interventions([*cfg.interventions, *interventions])
    check_log(cfg.log)
    specs = [item for item in interventions if isinstance(item, str)]  # stored in config.json: a resume applies them
    twice = [spec for spec in specs if spec in cfg.interventions]
    if twice:
        raise InvalidArgumentError(f"intervention {twice[0]!r} is given twice: in cfg.interventions (a resumed run's "
                                   "config stores the ones it was trained with) and in interventions=; pass it once.")
    cfg = cfg.replace(data=cfg.data.with_absolute_path(), interventions=[*cfg.interventions, *specs])  # data: absolute
    interventions = [item for item in interventions if not isinstance(item, str)]
    if cfg.keep_every and not cfg.checkpoint_interval:
        warnings.warn(f"keep_every={cfg.keep_every} keeps periodic checkpoints, but checkpoint_interval=0 writes none: "
                      "only the final one and its fallback are kept; set e.g. --set checkpoint_interval=100.",
                      stacklevel=2)
    with RunLock(out) if out is not None and writes_outputs() else contextlib.nullcontext():  # rank 0 holds it
        return _train(cfg, out, resume=resume, overwrite=overwrite, interventions=interventions, progress=progress,
                      until=until)


@dataclass(eq=False)
class _Run:
    """The state of one training run in this process."""

    cfg: TrainConfig
    out: Path | None
    dist: DistContext
    device: torch.device
    source: TokenSource
    model: Any  # the plain SinkLM: hooks, evaluation and checkpoints use it
    optimizer: torch.optim.Optimizer
    precision: Any
    hooks: Hooks
    persist: PersistenceTracker
    resumed: bool = False
    start_step: int = 0
    stop: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    step_model: Any = None  # what a step calls: the model, compiled and/or in DDP
    compile_info: dict[str, Any] = field(default_factory=dict)
    val_batches: list[TokenBatch] = field(default_factory=list)
    val_targets: list[Tensor] = field(default_factory=list)
    metrics_file: Any = None
    external: MetricsLog | None = None
    saved_steps: set[int] = field(default_factory=set)
    overwritten: list[Path] = field(default_factory=list)  # the run overwrite=True replaces, until a first checkpoint
    leftovers: list[Path] = field(default_factory=list)  # runs an earlier overwrite set aside (named, kept)
    skipped: int = 0  # non-finite steps skipped in a row


def _train(cfg: TrainConfig, out: Path | None, *, resume: bool, overwrite: bool, interventions: Sequence[Intervention],
           progress: bool, until: int | None) -> TrainResult:
    """:func:`train` once the run directory is locked."""
    if out is not None and out.is_dir() and writes_outputs():
        recovered = recover_set_aside(out)  # an overwrite killed before its first checkpoint: the old run comes back
        if recovered is not None:
            warnings.warn(recovered, stacklevel=3)
    check_run_dir(out, resume=resume, overwrite=overwrite)
    resumed_from = load_run(out) if resume else None  # verified once: compared, then loaded
    changes = resume_changes(resumed_from.config, cfg, run_dir=out) if resume else {}
    dist, device = init_distributed(cfg.device)
    resources = contextlib.ExitStack()
    run: _Run | None = None
    try:
        run = _build(cfg, out, dist, device, interventions, resumed=resume)
        _open_run_dir(run, resumed_from, overwrite=overwrite, until=until)
        _prepare_loop(run, resources)
        if resume and dist.is_main:
            _log(run, {"kind": "resume", "step": run.start_step, "changes": changes})
        stops = resources.enter_context(StopSignals(enabled=not dist.enabled))  # Ctrl-C: finish the step, checkpoint
        run.model.train()
        bar = tqdm(range(run.start_step, run.stop), desc="train", disable=not (progress and dist.is_main),
                   initial=run.start_step, total=cfg.steps)
        next_rows: Tensor | None = None  # fetched while the GPU works on the step before
        for step in bar:
            if stops.received:
                raise interrupted_error(stops.received, step, run.start_step, cfg.steps, out, partial(_checkpoint, run))
            if cfg.eval.interval and dist.is_main and step % cfg.eval.interval == 0:
                _evaluate(run, step)
            rows = next_rows if next_rows is not None else fetch_rows(run.source, step, cfg, device)  # (B, T+1)
            next_rows, loss = _train_step(run, step, rows)
            if loss is not None:
                bar.set_postfix(loss=f"{loss:.4f}")
            if cfg.checkpoint_interval and (step + 1) % cfg.checkpoint_interval == 0 and step + 1 < run.stop:
                _checkpoint(run, step + 1)
        if cfg.eval.interval and dist.is_main and run.stop == cfg.steps:
            _evaluate(run, cfg.steps)
        _checkpoint(run, run.stop)
        return TrainResult(model=run.model, history=run.history, compile=run.compile_info, device=device.type,
                           autocast=run.precision.dtype)
    except BaseException as error:
        if run is not None and run.metrics_file is not None:
            run.metrics_file.close()
        if run is not None and run.overwritten:  # failed before any checkpoint: the replaced run comes back
            restore_set_aside(out, run.overwritten[0])
        elif out is not None and set_aside_runs(out) and isinstance(error, (TrainingDivergedError, TrainingInterrupted)):
            warnings.warn(f"The run this overwrite replaced is kept in {[str(p) for p in set_aside_runs(out)]}: it is "
                          "deleted once this run writes a regular checkpoint (move its files back to keep it).",
                          stacklevel=2)
        raise
    finally:
        resources.close()
        cleanup_distributed(dist)


def _build(cfg: TrainConfig, out: Path | None, dist: DistContext, device: torch.device,
           interventions: Sequence[Intervention], *, resumed: bool) -> _Run:
    """Data, model, optimizer and interventions, built before ``out_dir`` is touched; the data order depends on
    ``cfg.data`` only, the initialisation on ``cfg.seed``."""
    from sinklens.sinklm.model import SinkLM
    source = build_source(cfg.data, d_vocab=None if cfg.model.d_vocab == "auto" else cfg.model.d_vocab)
    if cfg.model.d_vocab == "auto":
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_vocab=source.vocab_size))
    elif source.vocab_size > cfg.model.d_vocab:
        vocab = source.vocab_size
        raise InvalidArgumentError(f"The data uses {vocab} token ids but model.d_vocab={cfg.model.d_vocab}; set "
                                   f"model.d_vocab={vocab} (or larger, or 'auto'), e.g. --set model.d_vocab={vocab}.")
    per_rank, rem = divmod(cfg.batch_size // cfg.grad_accum, dist.world_size)
    if rem or per_rank == 0:
        raise InvalidArgumentError(f"batch_size={cfg.batch_size} does not split into grad_accum={cfg.grad_accum} "
                                   f"micro-batches over {dist.world_size} processes; use a multiple of "
                                   f"{cfg.grad_accum * dist.world_size}.")
    torch.manual_seed(cfg.seed)
    model = SinkLM(cfg.model).to(device)
    model.tokenizer = source.tokenizer
    every = [*cfg.interventions, *interventions]  # the specs (strings), then the callables
    hooks = resolve_interventions(model, every)
    # trial hooks are fresh (a trial leaves no state); where the spec interventions cannot run on the persistence
    # probe's shorter sequences, the probe measures without them
    probe_all = try_interventions(model, resolve_interventions(model, cfg.interventions), cfg)
    probed = every if probe_all else list(interventions)
    probe_hooks = hooks if probe_all else resolve_interventions(model, probed)
    persist = PersistenceTracker(cfg, out, lambda m: probe_hooks if m is model else resolve_interventions(m, probed))
    return _Run(cfg=cfg, out=out, dist=dist, device=device, source=source, model=model,
                optimizer=configure_optimizer(model, cfg.optim, device), precision=mixed_precision(cfg, device),
                hooks=hooks, persist=persist, resumed=resumed)


def _open_run_dir(run: _Run, resumed_from: Any, *, overwrite: bool, until: int | None) -> None:
    """Load the checkpoint a resume continues from, then write the run directory (only from here on)."""
    cfg, out, resumed = run.cfg, run.out, resumed_from is not None
    fingerprint = data_fingerprint(run.source)  # what the data is beyond its config (tokenizer, token streams)
    if resumed:
        check_data_fingerprint(out, fingerprint)
        run.start_step = load_checkpoint(resumed_from, model=run.model, optimizer=run.optimizer,
                                         scaler=run.precision.scaler)
        history = read_metrics(out) if (out / METRICS).is_file() else []
        run.history = [line for line in history if line["step"] < run.start_step]
    run.stop = cfg.steps if until is None else min(until, cfg.steps)
    if resumed and run.start_step >= run.stop:  # re-saving would replace step `stop`'s checkpoint
        asked = f"steps={cfg.steps}" + ("" if until is None else f" and until={until}")
        raise InvalidArgumentError(f"The run in {str(out)!r} is at step {run.start_step} already; {asked} leave "
                                   f"nothing to train. Pass a larger --steps (> {run.start_step}) to continue it.")
    if out is None or not run.dist.is_main:
        return
    writable_dir(out, what="out_dir")
    if overwrite:
        run.overwritten.extend(p for p in [set_aside_run(out)] if p is not None)
    clean_stale(out)
    write_json(out / "config.json", cfg.to_dict(), digits=None)
    write_metrics(out, run.history)  # a resumed run keeps only the lines before its checkpoint
    write_data_fingerprint(out, fingerprint)
    if resumed and run.source.tokenizer is not None:  # a kill may have left it broken or missing
        problem = tokenizer_problem(out)
        if problem is not None:
            if (out / TOKENIZER).exists():
                warnings.warn(f"{problem}; it is written again from the data's tokenizer.", stacklevel=4)
            save_tokenizer(out, run.source.tokenizer)


def _wrap(run: _Run, module: Any) -> Any:
    """What a step calls: ``module`` (possibly compiled), in DDP when distributed."""
    if not run.dist.enabled:
        return module
    from torch.nn.parallel import DistributedDataParallel as DDP
    return DDP(module, device_ids=[run.device.index] if run.device.type == "cuda" else None)


def _prepare_loop(run: _Run, resources: contextlib.ExitStack) -> None:
    """Compile, the evaluation batches, the persistence reference, the metrics files and the attention kernels."""
    cfg, out, device, main = run.cfg, run.out, run.device, run.dist.is_main
    compiled = cfg.compile is True or (cfg.compile == "auto" and device.type == "cuda")
    run.compile_info = {"compiled": compiled, "compile_s": None, "error": None}
    run.step_model = _wrap(run, compile_model(run.model) if compiled else run.model)
    if cfg.eval.interval and main:
        run.val_batches, run.val_targets = eval_batches(run.source, cfg, device)
    if run.resumed and main:
        run.persist.resume(device)
    run.leftovers = [] if out is None else set_aside_runs(out)
    if out is not None and main:
        run.metrics_file = resources.enter_context(open(out / "metrics.jsonl", "a"))  # noqa: SIM115
    if cfg.log != "none" and main:
        run.external = MetricsLog(cfg.log, cfg.to_dict(), out)
        resources.callback(run.external.close)
    resources.enter_context(attention_kernels(device))
    if device.type == "cuda" and main:  # the peak that the train lines' mfu divides by
        name = torch.cuda.get_device_name(device)
        _log(run, {"kind": "device", "step": run.start_step, "device": name, "peak_flops": peak_flops(name),
                   "peak": "dense bfloat16 tensor-core peak FLOP/s (sinklens.train.speed.PEAK_FLOPS)"})


def _log(run: _Run, line: dict[str, Any]) -> None:
    """Add a metrics line to the history, ``metrics.jsonl`` (strict JSON) and the ``cfg.log`` library."""
    run.history.append(line)
    if run.metrics_file is not None:
        run.metrics_file.write(json_line(line) + "\n")
        run.metrics_file.flush()
    if run.external is not None:
        run.external.write(line)


def _evaluate(run: _Run, step: int) -> None:
    """Validation loss, sink metrics and persistence of the step-0 bias, as a ``kind="eval"`` line."""
    from sinklens.train.sink_metrics import evaluate
    metrics = evaluate(run.model, run.val_batches, run.val_targets, threshold=run.cfg.eval.sink_threshold,
                       extra_hooks=run.hooks)
    _log(run, {"kind": "eval", "step": step, **metrics.scalars(), **run.persist.measure(run.model)})


def _micro_steps(run: _Run, rows: Tensor) -> Tensor:
    """Forward and backward of every micro-batch of the step; the summed (unscaled) loss, on the device."""
    cfg, model = run.cfg, run.step_model
    loss_sum = torch.zeros((), device=run.device)
    for micro in range(cfg.grad_accum):
        sync = micro == cfg.grad_accum - 1 or not run.dist.enabled
        with contextlib.nullcontext() if sync else model.no_sync():
            loss_sum += forward_backward(model, micro_batch(rows, micro, cfg, run.dist), hooks=run.hooks,
                                         loss_scale=1.0 / cfg.grad_accum, autocast=run.precision.autocast,
                                         hook_owner=run.model, scaler=run.precision.scaler)
    return loss_sum


def _train_step(run: _Run, step: int, rows: Tensor) -> tuple[Tensor | None, float | None]:
    """One optimizer step on ``rows``; returns the next step's rows (fetched while the device works) and the
    loss when the step was logged."""
    cfg, optimizer, scaler, device = run.cfg, run.optimizer, run.precision.scaler, run.device
    lr = get_lr(step, cfg.optim, cfg.steps)
    for group in optimizer.param_groups:
        group["lr"] = lr
    first_compiled = run.compile_info["compiled"] and step == run.start_step
    t0 = time.perf_counter()
    try:
        loss_sum = _micro_steps(run, rows)
    except Exception as error:  # noqa: BLE001 - a compiler error at the first compiled step: go on eagerly
        if not first_compiled:
            raise
        optimizer.zero_grad(set_to_none=True)
        run.step_model = _wrap(run, run.model)
        run.compile_info.update(compiled=False, error=compile_failed_warning(error))
        warnings.warn(run.compile_info["error"], stacklevel=3)
        loss_sum = _micro_steps(run, rows)
    next_rows = fetch_rows(run.source, step + 1, cfg, device) if step + 1 < run.stop else None
    if scaler is not None:  # float16: unscale before clipping
        scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.optim.grad_clip or float("inf"), foreach=True)
    # one host sync per step: a NaN/inf loss or gradient never reaches the weights (under float16's scaler an
    # inf gradient with a finite loss is the scaler's to skip)
    if not bool(torch.isfinite(loss_sum if scaler is not None else loss_sum + grad_norm)):
        _skip_nonfinite(run, step, loss_sum, grad_norm, lr)
        return next_rows, None
    run.skipped = 0
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if first_compiled:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if run.compile_info["compiled"]:
            run.compile_info["compile_s"] = time.perf_counter() - t0
        _log(run, {"kind": "compile", "step": step, **run.compile_info})
    if step % cfg.log_interval and step != cfg.steps - 1:
        return next_rows, None
    if run.dist.enabled:
        torch.distributed.all_reduce(loss_sum, op=torch.distributed.ReduceOp.AVG)
    loss = float(loss_sum) / cfg.grad_accum  # syncs the device: once per logged step
    tokens_per_s = cfg.batch_size * cfg.data.seq_len / (time.perf_counter() - t0)
    mfu = estimate_mfu(run.model.flops_per_token(cfg.data.seq_len), tokens_per_s, device)
    _log(run, {"kind": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": float(grad_norm),
               "tokens_per_s": tokens_per_s, "mfu": mfu, "compiled": run.compile_info["compiled"]})
    return next_rows, loss


def _skip_nonfinite(run: _Run, step: int, loss_sum: Tensor, grad_norm: Tensor, lr: float) -> None:
    """Drop and log the update of a step whose loss or gradient is NaN/inf; ``on_nonfinite="skip"`` goes on for up
    to ``max_skips`` such steps in a row, else the run stops with its last finite weights kept."""
    cfg = run.cfg
    run.optimizer.zero_grad(set_to_none=True)
    run.skipped += 1
    stopping = cfg.on_nonfinite == "stop" or run.skipped > cfg.max_skips
    line = {"kind": "nonfinite", "step": step, "loss": float(loss_sum) / cfg.grad_accum,
            "grad_norm": float(grad_norm), "lr": lr, "action": "stop" if stopping else "skip"}
    _log(run, line)
    if not stopping:
        warnings.warn(f"Step {step}: non-finite loss or gradient; the update was skipped.", stacklevel=4)
        return
    if cfg.on_nonfinite == "stop":
        why, advice = "on_nonfinite='stop'", "or set on_nonfinite='skip' to drop such steps"
    else:
        why, advice = f"non-finite again after max_skips={cfg.max_skips} skipped steps in a row", "or raise max_skips"
    raise TrainingDivergedError(f"Training diverged at step {step}: loss {line['loss']}, gradient norm "
                                f"{line['grad_norm']} (lr {lr:.3g}); stopped ({why}), {_kept(run, step)}. Lower "
                                f"optim.lr, raise optim.warmup_steps, {advice}.")


def _kept(run: _Run, step: int | None) -> str:
    """What a run stopping on a non-finite step keeps: its last finite checkpoint; one with none checkpoints its
    weights after ``step`` (not None) when they are finite."""
    out = str(run.out)
    if run.out is None:
        return "nothing was saved (no out_dir)"
    if run.saved_steps or run.resumed:
        return f"its last finite checkpoint (step {max(run.saved_steps, default=run.start_step)}) in {out!r} is kept"
    if step is None:
        return f"{out!r} holds no checkpoint of this run"
    if step <= run.start_step:
        return f"no step had finished, so {out!r} holds no checkpoint"
    bad = _check_weights_finite(run.model)
    if bad is not None:  # an earlier update (with a finite loss) already broke them
        return f"it had no checkpoint, and its weights after step {step} are not finite ({bad}), so none was written"
    _checkpoint(run, step, regular=False)
    return (f"it had no checkpoint, so its finite weights after step {step} are checkpointed in {out!r} "
            "(--resume continues from there)")


def _checkpoint(run: _Run, step: int, *, regular: bool = True) -> None:
    """Checkpoint the weights after ``step`` steps, once per step. The run an overwrite replaces is deleted only
    after a ``regular`` (periodic or final) checkpoint, not one a divergence or Ctrl-C saves."""
    out = run.out
    if out is None or step in run.saved_steps:
        return
    bad = _check_weights_finite(run.model)  # at checkpoints only: never a per-step host sync
    if bad is not None:
        _log(run, {"kind": "nonfinite", "step": step, "weights": bad,
                   "lr": get_lr(max(step - 1, 0), run.cfg.optim, run.cfg.steps), "action": "stop"})
        raise TrainingDivergedError(f"Training diverged: the weights after step {step} are not finite ({bad}); the "
                                    f"checkpoint of step {step} was not written and {_kept(run, None)}. Lower optim.lr, "
                                    "raise optim.warmup_steps or set optim.grad_clip.")
    if not run.dist.is_main:
        return
    save_checkpoint(out, model=run.model, optimizer=run.optimizer, cfg=run.cfg, step=step, scaler=run.precision.scaler)
    run.saved_steps.add(step)
    if regular and (run.overwritten or run.leftovers):
        discard_set_aside(out)
        run.overwritten.clear()
        run.leftovers.clear()
    elif run.overwritten:  # a divergence or Ctrl-C after this checkpoint keeps both: say where the old one is
        run.leftovers.extend(run.overwritten)
        run.overwritten.clear()
