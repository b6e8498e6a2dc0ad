"""The training loop: read it top to bottom, like nanoGPT's ``train.py``.

:func:`train` builds a :class:`~sinklens.train.model.SinkLM` from ``cfg.model`` (seeded by
``cfg.seed``), a :class:`~sinklens.train.data.TokenSource` from ``cfg.data`` (ordered by
``cfg.data.seed`` only), AdamW with warmup + cosine decay (:func:`get_lr`), and then for every step:
evaluate (every ``eval.interval`` steps: validation loss and sink metrics), accumulate gradients
over ``grad_accum`` micro-batches (bf16 autocast on CUDA only), clip, step, log a JSON line,
checkpoint. Training-time interventions (``(hook_name, fn)`` pairs, e.g. from
:mod:`sinklens.interventions`) are attached with ``model.hooks(...)`` around every forward, so a
model can be pretrained with its sink moved. Under ``torchrun`` the model is wrapped in DDP.

Examples:
    >>> from sinklens.train.config import OptimConfig
    >>> opt = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10)
    >>> [round(get_lr(s, opt, total_steps=100), 6) for s in (0, 9, 10, 55, 100, 200)]
    [0.0001, 0.001, 0.001, 0.00055, 0.0001, 0.0001]
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import torch
import torch.nn.functional as F
from jaxtyping import Int
from torch import Tensor
from tqdm.auto import tqdm

from sinklens.inputs import TokenBatch
from sinklens.streaming import HookFn
from sinklens.train.checkpoint import has_checkpoint, load_checkpoint, save_checkpoint
from sinklens.train.config import OptimConfig, TrainConfig, parse_value
from sinklens.train.data import TokenSource, build_source
from sinklens.train.ddp import DistContext, cleanup_distributed, init_distributed

Hooks = list[tuple[str, HookFn]]
#: A training-time intervention: a spec string ``"name:key=value,..."`` or ``model -> hooks``.
Intervention = Union[str, Callable[[Any], Hooks]]

#: Dense bf16 peak FLOP/s per GPU, for the MFU estimate (matched against the device name).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12, "4090": 165e12, "3090": 71e12}
#: Modules searched, in order, for a named intervention factory ``fn(model, **kwargs) -> hooks``.
INTERVENTION_MODULES = ("sinklens.interventions.masks", "sinklens.interventions.variance", "sinklens.interventions.neurons")


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


def configure_optimizer(model: Any, optim: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over ``model.param_groups`` (no weight decay on <2-D parameters); fused on CUDA when available."""
    fused_ok = "fused" in inspect.signature(torch.optim.AdamW).parameters and device.type == "cuda"
    fused = fused_ok if optim.fused is None else bool(optim.fused)
    extra = {"fused": True} if fused else {}
    return torch.optim.AdamW(
        model.param_groups(optim.weight_decay), lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, **extra
    )


def _split_args(text: str) -> list[str]:
    """Split ``a=1,b=[2,3]`` at commas outside brackets."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [p for p in parts + [current] if p.strip()]


def parse_intervention(spec: str) -> tuple[str, dict[str, Any]]:
    """Split ``"name:key=value,key=value"`` into the factory name and its keyword arguments.

    Examples:
        >>> parse_intervention("restart:positions=16,layers=[0,1]")
        ('restart', {'positions': 16, 'layers': [0, 1]})
    """
    name, _, args = spec.partition(":")
    kwargs = {}
    for item in _split_args(args):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"Intervention argument {item!r} in {spec!r} is not of the form key=value.")
        kwargs[key.strip()] = parse_value(value)
    return name.strip(), kwargs


def resolve_interventions(model: Any, interventions: Sequence[Intervention]) -> Hooks:
    """Turn intervention specs into ``(hook_name, fn)`` pairs for ``model``.

    A string ``"name:key=value,..."`` names a factory ``fn(model, **kwargs) -> hooks`` in one of
    :data:`INTERVENTION_MODULES` (e.g. ``"restart:positions=16"`` →
    ``sinklens.interventions.masks.restart(model, positions=16)``, which makes every query at or
    after 16 ignore keys before 16, so position 16 becomes a second "first token");
    ``"module.name:..."`` picks the module explicitly. A callable is called with the model.
    """
    hooks: Hooks = []
    for item in interventions:
        if callable(item):
            hooks.extend(item(model))
            continue
        name, kwargs = parse_intervention(item)
        module_hint, _, func_name = name.rpartition(".")
        modules = [f"sinklens.interventions.{module_hint}"] if module_hint else list(INTERVENTION_MODULES)
        factory = None
        for module_name in modules:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError:
                continue
            candidate = getattr(module, func_name, None)
            if callable(candidate) and not func_name.startswith("_"):
                factory = candidate
                break
        if factory is None:
            raise ValueError(
                f"Unknown training intervention {name!r}; expected a factory in {modules} such as "
                f"'restart', 'self_only', 'block_keys' (masks) or 'amplify' (variance), as 'name:key=value,...'."
            )
        hooks.extend(factory(model, **kwargs))
    return hooks


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
) -> Tensor:
    """One micro-step: next-token cross-entropy of ``rows[:, 1:]`` given ``rows[:, :-1]``, backward
    of ``loss * loss_scale``; returns the unscaled loss (detached). ``hook_owner`` is the module that
    owns the hook points (the unwrapped model when ``model`` is DDP or compiled)."""
    inputs, targets = rows[:, :-1], rows[:, 1:]
    owner = hook_owner if hook_owner is not None else model
    with autocast, owner.hooks(fwd_hooks=list(hooks)):
        logits = model(inputs, return_type="logits")  # (B, T, V)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    (loss * loss_scale).backward()
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


@dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes:
        model: the trained (unwrapped) :class:`~sinklens.train.model.SinkLM`, in train mode.
        history: the metrics lines (also in ``out_dir/metrics.jsonl``): ``kind="train"`` lines
            with ``loss`` (mean over the step's batch), ``lr``, ``grad_norm`` (before clipping),
            ``tokens_per_s``, ``mfu``; ``kind="eval"`` lines with ``val_loss`` and sink metrics.
        out_dir: the run directory, or None.
    """

    model: Any
    history: list[dict[str, Any]] = field(default_factory=list)
    out_dir: Path | None = None

    def losses(self) -> list[float]:
        return [line["loss"] for line in self.history if line["kind"] == "train"]

    def evals(self) -> list[dict[str, Any]]:
        return [line for line in self.history if line["kind"] == "eval"]


def _read_history(path: Path, before_step: int) -> list[dict[str, Any]]:
    """Metrics lines of an interrupted run up to (not including) ``before_step`` (evals at it kept out too)."""
    if not path.is_file():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [line for line in lines if line["step"] < before_step]


# ----------------------------------------------------------------------------------------------
# The loop


def train(
    cfg: TrainConfig,
    *,
    out_dir: str | Path | None = None,
    resume: bool = False,
    interventions: Sequence[Intervention] = (),
    progress: bool = True,
    until: int | None = None,
) -> TrainResult:
    """Train a SinkLM as ``cfg`` describes; write metrics, checkpoints and tokenizer to ``out_dir``.

    Args:
        out_dir: run directory (``metrics.jsonl``, ``config.json``, ``model.safetensors``,
            ``optimizer.pt``, ``trainer_state.pt``, ``tokenizer/``); None keeps everything in memory.
        resume: continue from the checkpoint in ``out_dir`` (its step, weights, optimizer, RNG);
            the loss curve continues exactly as if the run had not stopped.
        interventions: extra training-time interventions on top of ``cfg.interventions`` (callables
            ``model -> [(hook_name, fn)]`` are accepted here; only strings are stored in the config).
        progress: tqdm bar over steps.
        until: stop (and checkpoint) after this many steps of ``cfg.steps`` — a time-limited job;
            the schedule still spans ``cfg.steps``, and ``resume=True`` continues from there.
    """
    from sinklens.train.model import SinkLM

    dist, device = init_distributed(cfg.device)
    try:
        # ---- data: the order depends on cfg.data only
        source = build_source(cfg.data, d_vocab=cfg.model.d_vocab)
        if source.vocab_size > cfg.model.d_vocab:
            raise ValueError(
                f"The data uses {source.vocab_size} token ids but model.d_vocab={cfg.model.d_vocab}; "
                f"set model.d_vocab={source.vocab_size} (or larger), e.g. --set model.d_vocab={source.vocab_size}."
            )
        per_rank, rem = divmod(cfg.batch_size // cfg.grad_accum, dist.world_size)
        if rem or per_rank == 0:
            raise ValueError(
                f"batch_size={cfg.batch_size} does not split into grad_accum={cfg.grad_accum} micro-batches "
                f"over {dist.world_size} processes; use a multiple of {cfg.grad_accum * dist.world_size}."
            )

        # ---- model and optimizer: init depends on cfg.seed
        torch.manual_seed(cfg.seed)
        model = SinkLM(cfg.model).to(device)
        model.tokenizer = source.tokenizer
        optimizer = configure_optimizer(model, cfg.optim, device)
        use_amp = device.type == "cuda" and cfg.autocast != "none"
        amp_dtype = torch.bfloat16 if cfg.autocast == "bfloat16" else torch.float16
        autocast = torch.autocast(device_type="cuda", dtype=amp_dtype) if use_amp else contextlib.nullcontext()
        scaler = torch.amp.GradScaler("cuda") if use_amp and amp_dtype == torch.float16 else None

        out = Path(out_dir) if out_dir is not None else None
        start_step = 0
        if resume:
            if out is None or not has_checkpoint(out):
                raise FileNotFoundError(f"resume=True but {str(out)!r} holds no checkpoint to resume from.")
            start_step = load_checkpoint(out, model=model, optimizer=optimizer, scaler=scaler)
        history = _read_history(out / "metrics.jsonl", start_step) if out is not None and resume else []
        if out is not None and dist.is_main:
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
            with open(out / "metrics.jsonl", "w") as fh:  # rewritten so a resumed run has no stale lines
                fh.writelines(json.dumps(line) + "\n" for line in history)

        hooks = resolve_interventions(model, [*cfg.interventions, *interventions])
        raw_model = model
        if cfg.compile:
            model = torch.compile(model)
        if dist.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        val_batches, val_targets = eval_batches(source, cfg, device) if cfg.eval.interval and dist.is_main else ([], [])
        flops_per_token = raw_model.flops_per_token(cfg.data.seq_len)
        tokens_per_step = cfg.batch_size * cfg.data.seq_len

        def log(line: dict[str, Any]) -> None:
            history.append(line)
            if out is not None and dist.is_main:
                with open(out / "metrics.jsonl", "a") as fh:
                    fh.write(json.dumps(line) + "\n")

        def run_eval(step: int) -> None:
            from sinklens.train.sink_metrics import evaluate

            metrics = evaluate(raw_model, val_batches, val_targets, threshold=cfg.eval.sink_threshold, extra_hooks=hooks)
            log({"kind": "eval", "step": step, **metrics.scalars()})

        def checkpoint(step: int) -> None:
            if out is not None and dist.is_main:
                save_checkpoint(out, model=raw_model, optimizer=optimizer, cfg=cfg, step=step, scaler=scaler)

        # ---- the loop
        model.train()
        stop = cfg.steps if until is None else min(int(until), cfg.steps)
        bar = tqdm(range(start_step, stop), desc="train", disable=not (progress and dist.is_main), initial=start_step, total=cfg.steps)
        for step in bar:
            if cfg.eval.interval and dist.is_main and step % cfg.eval.interval == 0:
                run_eval(step)

            lr = get_lr(step, cfg.optim, cfg.steps)
            for group in optimizer.param_groups:
                group["lr"] = lr

            t0 = time.perf_counter()
            rows = source.batch("train", step, cfg.batch_size).to(device, non_blocking=True)  # (B, T+1)
            loss_sum = torch.zeros((), device=device)
            for micro in range(cfg.grad_accum):
                sync = micro == cfg.grad_accum - 1 or not dist.enabled
                with contextlib.nullcontext() if sync else model.no_sync():
                    loss = forward_backward(
                        model,
                        micro_batch(rows, micro, cfg, dist),
                        hooks=hooks,
                        loss_scale=(scaler.get_scale() if scaler is not None else 1.0) / cfg.grad_accum,
                        autocast=autocast,
                        hook_owner=raw_model,
                    )
                loss_sum += loss
            if scaler is not None:  # float16 only: gradients were scaled, unscale before clipping
                scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.optim.grad_clip or float("inf"))
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)

            if step % cfg.log_interval == 0 or step == cfg.steps - 1:
                if dist.enabled:
                    torch.distributed.all_reduce(loss_sum, op=torch.distributed.ReduceOp.AVG)
                loss_value = float(loss_sum) / cfg.grad_accum  # .item() syncs the device
                dt = time.perf_counter() - t0
                tokens_per_s = tokens_per_step / dt
                log({
                    "kind": "train", "step": step, "loss": loss_value, "lr": lr, "grad_norm": float(grad_norm),
                    "tokens_per_s": tokens_per_s, "mfu": estimate_mfu(flops_per_token, tokens_per_s, device),
                })
                bar.set_postfix(loss=f"{loss_value:.4f}")
            if cfg.checkpoint_interval and (step + 1) % cfg.checkpoint_interval == 0 and step + 1 < stop:
                checkpoint(step + 1)

        if cfg.eval.interval and dist.is_main and stop == cfg.steps:
            run_eval(cfg.steps)
        checkpoint(stop)
        return TrainResult(model=raw_model, history=history, out_dir=out)
    finally:
        cleanup_distributed(dist)
