"""The one training loop: AdamW, warm-up + cosine schedule, clipping, atomic checkpoints, exact resume.

Every trainer in treespec (language models, Medusa heads, EAGLE drafters) is this loop with a
different ``loss_fn`` and ``evaluate``. Exact resume rests on three facts: the learning rate is a
pure function of the step (no scheduler object to restore), the batch for a step is a pure function
of (seed, step) (``TokenBatches``), and the checkpoint carries the optimizer and RNG states (and jobs
reseed the RNG per micro-batch from (seed, step, micro-batch)).

The same loop runs on several processes (torchrun; train/distributed.py): the global batch is split over
ranks and ``grad_accum`` micro-batches, DDP or FSDP2 averages the gradients, and rank 0 alone logs and
writes checkpoints, in one format whatever the strategy (an FSDP run's checkpoint holds whole tensors and
resumes under DDP, one process, or another world size).

Checkpoints hold no pickle (loading one never runs code). A run directory holds::

    latest.json              {"format", "checkpoints": ["ckpt-200", "ckpt-100"]}, newest first
    ckpt-200/state.safetensors   model.<param>, optimizer.state.<i>.<key>, rng.cpu (uint8), rng.cuda.<i>
    ckpt-200/meta.json           step, tokens_seen, wall_time, fingerprint, optimizer param groups,
                                 tensors_sha1 (the sha1 of state.safetensors)
    ckpt-100/...                 the previous checkpoint, the fallback when the newest is unreadable

A folder is written under a temporary name and renamed whole before ``latest.json`` is replaced,
so a crash at any point leaves a consistent pair of checkpoints.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from treespec.io import atomic_write, atomic_write_json, file_digest, load_safetensors, read_json

from . import distributed
from .data import batch_rows, batch_size_of, batch_to, batch_tokens
from .distributed import Context

FORMAT = "treespec-checkpoint-1"
LATEST = "latest.json"  # {"format", "checkpoints": ["ckpt-<step>", ...]}, newest first
TENSORS = "state.safetensors"
META = "meta.json"
# Older treespec pickled checkpoints here; they are never loaded (unpickling runs arbitrary code).
LEGACY_CHECKPOINT = "checkpoint.pt"


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


class CheckpointMismatch(ValueError):
    """A checkpoint written for another configuration: never a reason to fall back to an older one."""


def _jsonable(obj):
    """``obj`` as it reads back from JSON (tuples become lists, keys strings): what saved metadata is compared with."""
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def fingerprint_diff(saved: dict, now: dict) -> dict:
    """{field: (saved value, current value)} for every field that differs (absent fields read as None)."""
    saved, now = _jsonable(saved or {}), _jsonable(now or {})
    return {k: (saved.get(k), now.get(k)) for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)}


def _cpu_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached CPU tensors that safetensors can write: contiguous, no two sharing a storage."""
    out, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _is_checkpoint_name(name) -> bool:
    return isinstance(name, str) and re.fullmatch(r"ckpt-\d+", name) is not None


def save_checkpoint(
    run_dir: str | os.PathLike, *, step: int, model: dict[str, torch.Tensor], optimizer: dict,
    rng: dict[str, torch.Tensor], fingerprint: dict, tokens_seen: int = 0, wall_time: float = 0.0,
    keep: list[str] | tuple[str, ...] = (),
) -> Path:
    """Write ``<run_dir>/ckpt-<step>/`` and then point ``<run_dir>/latest.json`` at it.

    The folder holds ``state.safetensors`` (tensors named ``model.<param>``, ``optimizer.state.<i>.<key>``,
    ``rng.<device>``) and ``meta.json`` (step, counters, fingerprint, the optimizer's param groups and
    non-tensor state, the sha1 of the tensor file). It is written under a temporary name and renamed
    whole, so a crash at any moment leaves the previous ``latest.json`` valid. ``latest.json`` lists the
    new folder, then the folders in ``keep`` (the previous checkpoint); every other ``ckpt-*`` folder is
    then deleted. ``optimizer`` is a ``torch.optim.Optimizer.state_dict()``."""
    run_dir = Path(run_dir)
    name = f"ckpt-{step}"
    tensors = {f"model.{k}": v for k, v in model.items()}
    extra_state: dict[str, dict] = {}
    for pid, state in optimizer["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"optimizer.state.{pid}.{key}"] = value
            else:
                extra_state.setdefault(str(pid), {})[key] = value
    tensors.update({f"rng.{k}": v for k, v in rng.items()})
    tmp = run_dir / f".{name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tensor_file = atomic_write(tmp / TENSORS, lambda p: save_file(_cpu_tensors(tensors), str(p)))
        meta = {
            "format": FORMAT, "step": step, "tokens_seen": tokens_seen, "wall_time": wall_time,
            "fingerprint": _jsonable(fingerprint),
            "optimizer": {"param_groups": optimizer["param_groups"], "state": extra_state},
            "tensors_sha1": file_digest(tensor_file),
        }
        atomic_write_json(tmp / META, meta, indent=1, default=str)
        final = run_dir / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    listed = [name, *(k for k in keep if _is_checkpoint_name(k) and k != name)]
    atomic_write_json(run_dir / LATEST, {"format": FORMAT, "checkpoints": listed}, indent=1)
    for folder in run_dir.iterdir():
        stale_tmp = folder.name.startswith(".ckpt-") and folder.name.endswith(".tmp")
        if folder.is_dir() and (stale_tmp or (_is_checkpoint_name(folder.name) and folder.name not in listed)):
            shutil.rmtree(folder, ignore_errors=True)
    return final


def checkpoint_folders(run_dir: str | os.PathLike) -> list[Path]:
    """The checkpoints of a run, newest first: those ``latest.json`` lists, or, when it is missing or
    unreadable, every ``ckpt-<step>`` folder (a crash between a folder's rename and the pointer update)."""
    run_dir = Path(run_dir)
    pointer = run_dir / LATEST
    if pointer.is_file():
        try:
            names = read_json(pointer, "checkpoint pointer")["checkpoints"]
            if not isinstance(names, list) or not all(map(_is_checkpoint_name, names)):
                raise ValueError(f"checkpoint pointer {pointer} does not list ckpt-<step> folders: {names!r}")
            return [run_dir / n for n in names]
        except (ValueError, KeyError, TypeError) as err:
            warnings.warn(f"{err}; looking for ckpt-<step> folders in {run_dir} instead", stacklevel=2)
    folders = [f for f in run_dir.glob("ckpt-*") if f.is_dir() and _is_checkpoint_name(f.name)]
    return sorted(folders, key=lambda f: int(f.name.split("-")[1]), reverse=True)


def read_checkpoint(folder: str | os.PathLike, fingerprint: dict) -> dict:
    """One checkpoint folder as {"step", "tokens_seen", "wall_time", "model", "optimizer", "rng", "path"}.

    The fingerprint is compared before any tensor is read: a difference raises ``CheckpointMismatch``
    naming the differing fields. A missing, truncated or corrupt file raises ValueError naming it."""
    folder = Path(folder)
    meta_path, tensor_path = folder / META, folder / TENSORS
    try:
        meta = read_json(meta_path, "checkpoint metadata")
    except FileNotFoundError as err:
        raise ValueError(str(err)) from None
    try:
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
        diff = fingerprint_diff(meta["fingerprint"], fingerprint)
        step, tokens_seen, wall_time = int(meta["step"]), int(meta["tokens_seen"]), float(meta["wall_time"])
        groups, extra_state = meta["optimizer"]["param_groups"], meta["optimizer"]["state"]
        digest = meta["tensors_sha1"]
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        raise ValueError(f"checkpoint metadata {meta_path} is malformed ({err!r})") from None
    if diff:
        fields = "; ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
        raise CheckpointMismatch(
            f"checkpoint {meta_path} was written for a different configuration: {', '.join(diff)} differ "
            f"({fields})"
        )
    if not tensor_path.is_file():
        raise ValueError(f"checkpoint tensors {tensor_path} do not exist")
    if file_digest(tensor_path) != digest:
        raise ValueError(
            f"checkpoint tensors {tensor_path} do not match the sha1 recorded in {meta_path}: truncated or corrupt"
        )
    tensors = load_safetensors(tensor_path, "checkpoint tensors")
    model, rng, state = {}, {}, {int(pid): dict(values) for pid, values in extra_state.items()}
    for key, t in tensors.items():
        kind, _, rest = key.partition(".")
        if kind == "model":
            model[rest] = t
        elif kind == "rng":
            rng[rest] = t
        elif kind == "optimizer" and rest.startswith("state."):
            pid, _, name = rest[len("state."):].partition(".")
            state.setdefault(int(pid), {})[name] = t
        else:
            raise ValueError(f"checkpoint tensors {tensor_path}: unexpected tensor {key!r}")
    return {"step": step, "tokens_seen": tokens_seen, "wall_time": wall_time, "model": model,
            "optimizer": {"state": state, "param_groups": groups}, "rng": rng, "path": folder}


def load_latest_checkpoint(run_dir: str | os.PathLike, fingerprint: dict) -> dict | None:
    """The newest readable checkpoint of a run (see ``read_checkpoint``), None when the run has none.

    An unreadable checkpoint is skipped with a warning naming its file, falling back to the previous
    one; when none is readable, a ValueError names every file tried. A fingerprint mismatch is raised
    at once."""
    failures = []
    for folder in checkpoint_folders(run_dir):
        try:
            return read_checkpoint(folder, fingerprint)
        except CheckpointMismatch:
            raise
        except ValueError as err:
            failures.append(str(err))
            warnings.warn(f"skipping unreadable checkpoint: {err}; falling back to the previous checkpoint",
                          stacklevel=2)
    if failures:
        raise ValueError(f"no readable checkpoint in {run_dir}: " + " | ".join(failures))
    return None


def clear_checkpoints(run_dir: str | os.PathLike) -> None:
    """Remove a run's checkpoints (pointer first): a fresh run must never resume an earlier run's state."""
    run_dir = Path(run_dir)
    (run_dir / LATEST).unlink(missing_ok=True)
    for folder in run_dir.glob("ckpt-*"):
        if folder.is_dir() and _is_checkpoint_name(folder.name):
            shutil.rmtree(folder, ignore_errors=True)


def rng_state() -> dict[str, torch.Tensor]:
    """Every RNG state the training loop draws from, as uint8 tensors."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return states


def set_rng_state(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["cpu"])
    cuda = [states[k] for k in sorted((k for k in states if k.startswith("cuda.")), key=lambda k: int(k[5:]))]
    if cuda and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            warnings.warn(f"checkpoint holds {len(cuda)} CUDA RNG states for {torch.cuda.device_count()} devices; "
                          "restoring the first ones", stacklevel=2)
        for i, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


def restore(module: torch.nn.Module, opt: torch.optim.Optimizer, ckpt: dict) -> None:
    """Load a ``read_checkpoint`` result into ``module`` (its trainable parameters), ``opt`` and the RNGs."""
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    missing, unexpected = sorted(trainable - ckpt["model"].keys()), sorted(ckpt["model"].keys() - trainable)
    if missing or unexpected:
        raise ValueError(f"checkpoint {ckpt['path']} does not hold this module's trainable parameters: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    module.load_state_dict(ckpt["model"], strict=False)
    groups = []
    for saved, current in zip(ckpt["optimizer"]["param_groups"], opt.param_groups, strict=False):
        # JSON turned tuples (betas) into lists: give them back the type the optimizer was built with
        groups.append({k: tuple(v) if isinstance(current.get(k), tuple) and isinstance(v, list) else v
                       for k, v in saved.items()})
    groups += ckpt["optimizer"]["param_groups"][len(groups):]
    opt.load_state_dict({"state": ckpt["optimizer"]["state"], "param_groups": groups})
    set_rng_state(ckpt["rng"])


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
) -> TrainResult:
    """Optimise the trainable parameters of ``module`` for ``total_steps`` steps.

    ``loss_fn(batch) -> (loss, metrics)``; ``batch_at(step)`` must be deterministic in ``step`` and returns the
    global batch (a tensor or a dict of row-aligned tensors, train/data.py). Each step, rank r of W takes rows
    [r·B/W, (r+1)·B/W) and runs them as ``grad_accum`` micro-batches, each loss divided by ``grad_accum``; the
    gradient is averaged over ranks (DDP or FSDP2 per ``dist``, train/distributed.py). With ``seed`` the RNG is
    reseeded from (seed, step, global micro-batch) before each micro-batch, so random draws (feature noise)
    do not depend on the number of ranks. ``stop_after`` ends the run early after that many steps (as an
    interruption would), leaving a checkpoint to resume from. ``precision="bf16"`` runs forward passes under
    CPU/GPU autocast. Only rank 0 logs, shows progress and writes checkpoints.
    """
    ctx = dist or Context()
    if ctx.distributed and seed is None:
        raise ValueError("distributed training needs a seed (random draws are reseeded per micro-batch)")
    if not (isinstance(grad_accum, int) and grad_accum >= 1):
        raise ValueError(f"grad_accum must be an integer >= 1, got {grad_accum!r}")
    run_dir = Path(run_dir)
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    wrapped = distributed.wrap(module, loss_fn, ctx)
    opt = make_optimizer(module.parameters(), optim)  # after wrapping: FSDP replaces parameters by DTensors
    step, tokens_seen, elapsed = 0, 0, 0.0
    previous: list[str] = []  # the checkpoint to keep beside the next one
    legacy = run_dir / LEGACY_CHECKPOINT
    say = print if ctx.is_main else (lambda *a, **k: None)
    if resume:
        ckpt = load_latest_checkpoint(run_dir, fingerprint)
        if ckpt is None and legacy.exists():
            raise ValueError(
                f"{legacy} is a pickle checkpoint from an older treespec: it is never loaded (unpickling a file "
                f"can run arbitrary code) and {run_dir} holds no {LATEST} or ckpt-<step>/ checkpoint to resume "
                f"from; delete {legacy} to start this run from step 0, or use a new run_dir"
            )
        if legacy.exists():
            say(f"ignoring {legacy}: pickle checkpoints are never loaded; resuming from {ckpt['path']}")
        if ckpt is not None:
            if distributed.is_fsdp(wrapped):
                distributed.load_full_state(wrapped, opt, ckpt["model"], ckpt["optimizer"])
                set_rng_state(ckpt["rng"])
            else:
                restore(module, opt, ckpt)
            step, tokens_seen, elapsed = ckpt["step"], ckpt["tokens_seen"], ckpt["wall_time"]
            previous = [ckpt["path"].name]
            say(f"resuming from {ckpt['path']} at step {step}")
        else:
            say(f"resume=true but no checkpoint in {run_dir}: starting from step 0")
        if logger is not None and hasattr(logger, "truncate"):
            logger.truncate(step)  # steps logged after the checkpoint are logged again
    elif ctx.is_main:
        clear_checkpoints(run_dir)
    distributed.barrier(ctx)  # every rank has read the checkpoint (or rank 0 cleared the old ones)

    def checkpoint() -> None:
        state, optimizer_state = distributed.full_state(wrapped, module, opt, trainable, ctx)  # FSDP: collective
        if ctx.is_main:
            folder = save_checkpoint(
                run_dir, step=step, model=state, optimizer=optimizer_state, rng=rng_state(),
                fingerprint=fingerprint, tokens_seen=tokens_seen, wall_time=elapsed, keep=previous,
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
                group["lr"] = lr_at(step, total_steps, optim)
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
                    logger.log({f"val/{k}": v for k, v in eval_metrics.items()}, step=step)
            if step % ckpt_every == 0 or step == end:
                checkpoint()
    finally:
        bar.close()
    wrapped.eval()
    full = distributed.gathered_state(wrapped, trainable) if distributed.is_fsdp(wrapped) else None
    return TrainResult(step, loss_ema if loss_ema is not None else float("nan"), eval_metrics, elapsed, tokens_seen,
                       full)
