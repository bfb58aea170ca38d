"""The one training loop: AdamW, warm-up + cosine schedule, clipping, atomic checkpoints, exact resume.

Every trainer in treespec (language models, Medusa heads, EAGLE drafters) is this loop with a
different ``loss_fn`` and ``evaluate``. Exact resume rests on three facts: the learning rate is a
pure function of the step (no scheduler object to restore), the batch for a step is a pure function
of (seed, step) (``TokenBatches``), and the checkpoint carries the optimizer and RNG states.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

CHECKPOINT = "checkpoint.pt"


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


def make_optimizer(params, cfg: OptimConfig) -> torch.optim.AdamW:
    # No weight decay on norms and biases (1-D tensors), as in nanoGPT.
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas))


def save_atomic(obj, path: str | os.PathLike) -> None:
    """torch.save to a temporary file, then rename: a crash never leaves a half-written checkpoint."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str | os.PathLike, fingerprint: dict) -> dict:
    """Load a checkpoint and refuse it when it was written for another model configuration."""
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    if ckpt.get("fingerprint") != fingerprint:
        diff = {
            k: (ckpt.get("fingerprint", {}).get(k), v)
            for k, v in fingerprint.items()
            if ckpt.get("fingerprint", {}).get(k) != v
        }
        raise ValueError(f"checkpoint {path} was written for a different configuration: {diff} (saved, now)")
    return ckpt


@dataclass
class TrainResult:
    step: int
    train_loss: float
    eval_metrics: dict
    wall_time: float
    tokens_seen: int


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
) -> TrainResult:
    """Optimise the trainable parameters of ``module`` for ``total_steps`` steps.

    ``loss_fn(batch) -> (loss, metrics)``; ``batch_at(step)`` must be deterministic in ``step``.
    ``stop_after`` ends the run early after that many steps (as an interruption would), leaving a
    checkpoint to resume from. ``precision="bf16"`` runs forward passes under CPU/GPU autocast.
    """
    from tqdm import tqdm

    run_dir = Path(run_dir)
    ckpt_path = run_dir / CHECKPOINT
    opt = make_optimizer(module.parameters(), optim)
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    step, tokens_seen, elapsed = 0, 0, 0.0
    if resume and ckpt_path.is_file():
        ckpt = load_checkpoint(ckpt_path, fingerprint)
        module.load_state_dict(ckpt["model"], strict=False)
        opt.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["rng"])
        step, tokens_seen, elapsed = ckpt["step"], ckpt["tokens_seen"], ckpt["wall_time"]
    elif resume:
        print(f"resume=true but no checkpoint at {ckpt_path}: starting from step 0")

    def checkpoint() -> None:
        state = {n: t for n, t in module.state_dict().items() if n in trainable}
        save_atomic(
            {
                "step": step, "model": state, "optimizer": opt.state_dict(), "rng": torch.get_rng_state(),
                "fingerprint": fingerprint, "tokens_seen": tokens_seen, "wall_time": elapsed,
            },
            ckpt_path,
        )

    device_type = next(module.parameters()).device.type
    autocast = torch.autocast(device_type, dtype=torch.bfloat16, enabled=precision == "bf16")
    end = total_steps if stop_after is None else min(total_steps, step + stop_after)
    bar = tqdm(total=total_steps, initial=step, disable=not progress, dynamic_ncols=True)
    loss_ema, eval_metrics, t_last, tok_last = None, {}, time.perf_counter(), tokens_seen
    module.train()
    while step < end:
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total_steps, optim)
        batch = batch_at(step)
        with autocast:
            loss, metrics = loss_fn(batch)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in module.parameters() if p.requires_grad], optim.grad_clip
        )
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += batch.shape[0] * (batch.shape[1] - 1)
        elapsed += time.perf_counter() - t0
        loss_value = loss.item()
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
            module.eval()
            with torch.no_grad(), autocast:
                eval_metrics = evaluate()
            module.train()
            bar.write(f"step {step}: " + ", ".join(f"{k}={v:.4f}" for k, v in eval_metrics.items()))
            if logger is not None:
                logger.log({f"val/{k}": v for k, v in eval_metrics.items()}, step=step)
        if step % ckpt_every == 0 or step == end:
            checkpoint()
    bar.close()
    module.eval()
    return TrainResult(step, loss_ema if loss_ema is not None else float("nan"), eval_metrics, elapsed, tokens_seen)
