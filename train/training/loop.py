"""The one training loop: AdamW, warm-up + cosine schedule, clipping, atomic checkpoints, exact resume.

Every trainer in treespec (language models, Medusa heads, EAGLE drafters) is this loop with a
different ``loss_fn`` and ``evaluate``. Exact resume rests on three facts: the learning rate is a
pure function of the step (no scheduler object to restore), the batch for a step is a pure function
of (seed, step) (``TokenBatches``), and the checkpoint carries the optimizer and RNG states (and jobs
reseed the RNG per micro-batch from (seed, step, micro-batch)).

The same loop runs on several processes (torchrun; train/training/distributed.py): the global batch is split over
ranks and ``grad_accum`` micro-batches, DDP or FSDP2 averages the gradients, and rank 0 alone logs and
writes checkpoints, in one format whatever the strategy (train/training/checkpoint.py: an FSDP run's checkpoint holds
whole tensors and resumes under DDP, one process, or another world size).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from treespec.heads.training.batches import batch_rows, batch_size_of, batch_to, batch_tokens
from treespec.train.training import distributed
from treespec.train.training.checkpoint import (
    clear_checkpoints,
    fingerprint_diff,
    load_latest_checkpoint,
    restore,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from treespec.train.training.distributed import Context

PRECISIONS = ("fp32", "bf16")


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Linear warm-up to ``cfg.lr``, then cosine decay to ``cfg.lr * min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


def changed_settings(saved: dict, now: dict, step: int) -> list[str]:
    """What a resume announces: each optimiser setting or step count that differs from the checkpoint's. They are
    allowed (the schedule is a pure function of the step, so it continues from ``step`` with the new values)."""
    lines = [f"resume: {k} was {a!r} in the checkpoint, now {b!r} (the schedule continues from step {step} with "
             "the new value)" for k, (a, b) in fingerprint_diff(saved, now).items() if a is not None]
    if now["total_steps"] <= step:
        lines.append(f"resume: the checkpoint is at step {step}, total steps are {now['total_steps']}: nothing left "
                     "to train")
    return lines


def make_optimizer(module: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over ``module``'s trainable parameters. No weight decay on norms and biases (1-D tensors), as in
    nanoGPT. A module with ``lr_scales() -> [(parameters, scale), ...]`` trains each part at ``scale`` × the
    schedule's rate (Medusa-2's smaller rate for the fine-tuned target; the group's ``lr_scale``)."""
    parts = module.lr_scales() if hasattr(module, "lr_scales") else [(module.parameters(), 1.0)]
    groups = []
    for params, scale in parts:
        params = [p for p in params if p.requires_grad]
        groups += [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay, "lr_scale": scale},
                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr_scale": scale}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas))


@dataclass
class TrainResult:
    step: int
    train_loss: float
    eval_metrics: dict
    wall_time: float
    tokens_seen: int
    # FSDP only: the trained parameters as whole tensors (every rank), to load into an unsharded module for
    # export; the sharded module cannot be used outside the loop's collectives
    full_state: dict | None = None


def micro_seed(seed: int, step: int, micro: int) -> int:
    """The RNG seed of global micro-batch ``micro`` of step ``step`` (feature noise, dropout): the same on any
    number of ranks and after a resume."""
    return (int(seed) * 1_000_003 + int(step) * 1009 + int(micro)) % (2**63 - 1)


def train(
    module: torch.nn.Module,
    loss_fn: Callable[[torch.Tensor], tuple[torch.Tensor, dict]],
    batch_at: Callable[[int], torch.Tensor],
    *,
    total_steps: int,
    optim: OptimConfig,
    run_dir: str | os.PathLike,
    fingerprint: dict,
    evaluate: Callable[[], dict] | None = None,
    eval_every: int = 500,
    ckpt_every: int = 200,
    log_every: int = 10,
    resume: bool = False,
    logger=None,
    progress: bool = True,
    stop_after: int | None = None,
    precision: str = "fp32",
    grad_accum: int = 1,
    seed: int | None = None,
    dist: Context | None = None,
    after_eval: Callable[[int, dict], None] | None = None,
) -> TrainResult:
    """Optimise the trainable parameters of ``module`` for ``total_steps`` steps.

    ``loss_fn(batch) -> (loss, metrics)``; ``batch_at(step)`` must be deterministic in ``step`` and returns the
    global batch (a tensor or a dict of row-aligned tensors, train/training/data.py). Each step, rank r of W takes rows
    [r·B/W, (r+1)·B/W) and runs them as ``grad_accum`` micro-batches, each loss divided by ``grad_accum``; the
    gradient is averaged over ranks (DDP or FSDP2 per ``dist``, train/training/distributed.py). With ``seed`` the RNG is
    reseeded from (seed, step, global micro-batch) before each micro-batch, so random draws (feature noise)
    do not depend on the number of ranks. ``stop_after`` ends the run early after that many steps (as an
    interruption would), leaving a checkpoint to resume from. ``precision="bf16"`` runs forward passes under
    CPU/GPU autocast. Only rank 0 logs, shows progress and writes checkpoints.

    ``evaluate()`` runs every ``eval_every`` steps and at the last step; its metrics are logged as ``val/<key>``,
    keys that already name their group (``eval/expected_tau_chain``) as they are. ``after_eval(step, metrics)``
    runs on rank 0 after they are logged (a plot of them).
    """
    ctx = dist or Context()
    if ctx.distributed and seed is None:
        raise ValueError("distributed training needs a seed (random draws are reseeded per micro-batch)")
    if not (isinstance(grad_accum, int) and grad_accum >= 1):
        raise ValueError(f"grad_accum must be an integer >= 1, got {grad_accum!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    for name, value in (("total_steps", total_steps), ("ckpt_every", ckpt_every), ("eval_every", eval_every),
                        ("log_every", log_every)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    run_dir = Path(run_dir)
    settings = {"optim": {**asdict(optim), "betas": list(optim.betas)}, "total_steps": total_steps}  # may change
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    wrapped = distributed.wrap(module, loss_fn, ctx)
    opt = make_optimizer(module, optim)  # after wrapping: FSDP replaces parameters by DTensors
    step, tokens_seen, elapsed = 0, 0, 0.0
    previous: list[str] = []  # the checkpoint to keep beside the next one
    say = print if ctx.is_main else (lambda *a, **k: None)
    if resume:
        ckpt = load_latest_checkpoint(run_dir, fingerprint)
        if ckpt is not None:
            if distributed.is_fsdp(wrapped):
                distributed.load_full_state(wrapped, opt, ckpt["model"], ckpt["optimizer"])
                set_rng_state(ckpt["rng"])
            else:
                restore(module, opt, ckpt)
            step, tokens_seen, elapsed = ckpt["step"], ckpt["tokens_seen"], ckpt["wall_time"]
            previous = [ckpt["path"].name]
            say(f"resuming from {ckpt['path']} at step {step}")
            for line in changed_settings(ckpt["settings"], settings, step):
                say(line)
        else:
            say(f"resume=true but no checkpoint in {run_dir}: starting from step 0")
        if logger is not None and hasattr(logger, "truncate"):
            logger.truncate(step)  # steps logged after the checkpoint are logged again
    elif ctx.is_main:
        clear_checkpoints(run_dir)
    distributed.barrier(ctx)  # every rank has read the checkpoint (or rank 0 cleared the old ones)

    def write_checkpoint() -> None:
        state, optimizer_state = distributed.full_state(wrapped, module, opt, trainable, ctx)  # FSDP: collective
        if ctx.is_main:
            folder = save_checkpoint(
                run_dir, step=step, model=state, optimizer=optimizer_state, rng=rng_state(),
                fingerprint=fingerprint, tokens_seen=tokens_seen, wall_time=elapsed, keep=previous, settings=settings,
            )
            previous[:] = [folder.name]

    device = ctx.device if ctx.distributed else next(module.parameters()).device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    params = [p for p in module.parameters() if p.requires_grad]
    end = total_steps if stop_after is None else min(total_steps, step + stop_after)
    bar = tqdm(total=total_steps, initial=step, disable=not (progress and ctx.is_main), dynamic_ncols=True)
    loss_ema, eval_metrics, t_last, tok_last = None, {}, time.perf_counter(), tokens_seen
    wrapped.train()
    try:
        while step < end:
            t0 = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = lr_at(step, total_steps, optim) * group.get("lr_scale", 1.0)
            if hasattr(module, "set_step"):  # a module whose loss changes with the step (Medusa-2's heads warm-up)
                module.set_step(step)
            batch = batch_at(step)
            rows = batch_size_of(batch)
            n_micro = ctx.world_size * grad_accum
            if rows % n_micro:
                raise ValueError(f"the global batch of {rows} rows does not split into {ctx.world_size} rank(s) × "
                                 f"grad_accum={grad_accum} equal micro-batches")
            size = rows // n_micro
            loss_sum, metrics = 0.0, {}
            for m in range(grad_accum):
                micro = ctx.rank * grad_accum + m  # global micro-batch index: rows [micro·size, (micro+1)·size)
                piece = batch_to(batch_rows(batch, micro * size, (micro + 1) * size), device)
                if seed is not None:
                    torch.manual_seed(micro_seed(seed, step, micro))
                with distributed.gradient_sync(wrapped, sync=m == grad_accum - 1):
                    with autocast:
                        loss, micro_metrics = wrapped(piece)
                    (loss / grad_accum if grad_accum > 1 else loss).backward()
                loss_sum += loss.item()
                for k, v in micro_metrics.items():
                    metrics[k] = metrics.get(k, 0.0) + v / grad_accum
            grad_norm = distributed.to_local(torch.nn.utils.clip_grad_norm_(params, optim.grad_clip))
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += batch_tokens(batch)
            elapsed += time.perf_counter() - t0
            loss_value = distributed.mean_over_ranks(ctx, loss_sum / grad_accum)
            loss_ema = loss_value if loss_ema is None else 0.95 * loss_ema + 0.05 * loss_value
            bar.update(1)
            if step % log_every == 0 or step == end:
                now = time.perf_counter()
                tok_s = (tokens_seen - tok_last) / max(now - t_last, 1e-9)
                t_last, tok_last = now, tokens_seen
                bar.set_postfix(loss=f"{loss_ema:.3f}", tok_s=f"{tok_s:.0f}")
                if logger is not None:
                    logger.log(
                        {"train/loss": loss_value, "train/lr": opt.param_groups[0]["lr"],
                         "train/grad_norm": float(grad_norm), "train/tokens_per_s": tok_s,
                         "train/tokens_seen": tokens_seen, **{f"train/{k}": v for k, v in metrics.items()}},
                        step=step,
                    )
            if evaluate is not None and (step % eval_every == 0 or step == total_steps):
                wrapped.eval()
                with torch.no_grad(), autocast, distributed.full_parameters(wrapped):
                    eval_metrics = evaluate()  # every rank (FSDP's layer units gather in lockstep); rank 0 logs
                wrapped.train()
                if ctx.is_main:
                    bar.write(f"step {step}: " + ", ".join(f"{k}={v:.4f}" for k, v in eval_metrics.items()))
                if logger is not None:
                    logger.log({k if "/" in k else f"val/{k}": v for k, v in eval_metrics.items()}, step=step)
                if after_eval is not None and ctx.is_main:
                    after_eval(step, eval_metrics)
            if step % ckpt_every == 0 or step == end:
                write_checkpoint()
    finally:
        bar.close()
    wrapped.eval()
    full = distributed.gathered_state(wrapped, trainable) if distributed.is_fsdp(wrapped) else None
    return TrainResult(step, loss_ema if loss_ema is not None else float("nan"), eval_metrics, elapsed, tokens_seen,
                       full)
