"""Several processes training one model, on PyTorch's own engine: ``torchrun`` starts the processes,
``torch.distributed`` connects them (nccl on GPUs, gloo on CPUs, chosen automatically), and
``DistributedDataParallel`` (the default) or FSDP2 (``trainer.strategy=fsdp``,
``torch.distributed.fsdp.fully_shard``) share the work::

    torchrun --nproc_per_node 2 scripts/train_heads.py ...                          # DDP
    torchrun --nproc_per_node 2 scripts/train_heads.py ... trainer.strategy=fsdp    # FSDP2

What the training loop (train/training/loop.py) relies on:

- ``Context``: rank, world size, the process's device; ``is_main`` (rank 0) alone logs (wandb,
  metrics.jsonl), prints progress and writes checkpoints and exports. Without torchrun (``WORLD_SIZE``
  unset or 1) it is one process and nothing here changes how a run trains.
- The global batch (``trainer.batch_size`` rows) is a function of (seed, step); rank r takes rows
  [r·B/W, (r+1)·B/W) and splits them into ``trainer.grad_accum`` micro-batches, so W processes make the
  same update as one process with ``grad_accum = W`` (tests/train/training/test_distributed.py).
- ``wrap``: the loss function becomes the forward of a module holding the trainable one, so that DDP's
  and FSDP's hooks see every use of its parameters (the recipes call more methods than ``forward``).
  FSDP2 shards each transformers decoder layer (``_no_split_modules``) and then the rest (the root).
- A collective that waits longer than ``trainer.dist_timeout_s`` (a hung rank) raises instead of
  hanging; a rank that raises is reported with its rank (``failure_message``) and, under torchrun,
  ``record`` hands its traceback to the launcher, which stops every other rank and names the failed one.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record as _elastic_record
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from treespec.io import single_run

STRATEGIES = ("ddp", "fsdp")
DEFAULT_TIMEOUT_S = 1800.0  # torch's own default for gloo; a rank waits this long for a hung peer


@dataclass
class Context:
    """Where this process stands: rank ``rank`` of ``world_size``, on ``device``."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    strategy: str = "ddp"
    owns_group: bool = False  # this Context initialised the process group (and destroys it)
    timeout_s: float | None = None  # the process group's collective timeout, when this Context set it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def record(fn):
    """torch.distributed.elastic's ``record`` when torchrun started this process (it then hands a failing
    rank's traceback to the launcher, which names it in its summary); the plain function otherwise."""
    recorded = _elastic_record(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return (recorded if os.environ.get("TORCHELASTIC_ERROR_FILE") else fn)(*args, **kwargs)

    return wrapper


def launched_world_size() -> int:
    """The world size torchrun (or any launcher setting ``WORLD_SIZE``) started this process in."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def default_device(local_rank: int = 0) -> torch.device:
    return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """nccl for CUDA devices, gloo for CPUs."""
    return "nccl" if device.type == "cuda" else "gloo"


def check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"trainer.strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")


def check_trainer(t) -> None:
    """The trainer keys every job shares (conf/trainer/default.yaml), distributed ones included; the split of
    the global batch is checked against the world size torchrun started this process in."""
    for key in ("batch_size", "seq_len"):
        if not (isinstance(t[key], int) and t[key] >= 1):
            raise ValueError(f"trainer.{key} must be an integer >= 1, got {t[key]!r}")
    check_strategy(t.get("strategy", "ddp"))
    accum = t.get("grad_accum", 1)
    if not (isinstance(accum, int) and accum >= 1):
        raise ValueError(f"trainer.grad_accum must be an integer >= 1, got {accum!r}")
    timeout = t.get("dist_timeout_s", DEFAULT_TIMEOUT_S)
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"trainer.dist_timeout_s must be a number of seconds > 0, got {timeout!r}")
    world = launched_world_size()
    if t["batch_size"] % (accum * world):
        raise ValueError(f"trainer.batch_size={t['batch_size']} (the global batch) does not split into {world} rank(s) "
                         f"× trainer.grad_accum={accum} equal micro-batches")


def setup(strategy: str = "ddp", timeout_s: float | None = DEFAULT_TIMEOUT_S, *, device: torch.device | None = None
          ) -> Context:
    """The process's Context. Under torchrun (``WORLD_SIZE`` > 1) the default process group is created
    with the backend for this process's device and a ``timeout_s`` timeout on every collective; one that
    already exists (a test, an outer launcher) is used as it is."""
    check_strategy(strategy)
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
        return Context(rank, world, local, device or default_device(local), strategy, owns_group=False)
    if launched_world_size() <= 1:
        return Context(device=device or default_device(0), strategy=strategy)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = device or default_device(local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=float(timeout_s or DEFAULT_TIMEOUT_S))
    dist.init_process_group(backend_for(device), timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    return Context(dist.get_rank(), dist.get_world_size(), local, device, strategy, owns_group=True,
                   timeout_s=timeout.total_seconds())


def teardown(ctx: Context) -> None:
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def failure_message(ctx: Context, err: BaseException) -> str:
    """What a failing rank prints: its rank, the error, and for a failed collective what it usually means."""
    if not _is_comm_error(err):
        return f"[rank {ctx.rank}/{ctx.world_size}] failed: {type(err).__name__}: {err}"
    timeout = f"collectives time out after {ctx.timeout_s:g} s (trainer.dist_timeout_s); " if ctx.timeout_s else ""
    return (f"[rank {ctx.rank}/{ctx.world_size}] a collective timed out or lost a peer: {type(err).__name__}: "
            f"{str(err).strip()[:400]} ({timeout}another rank probably died or hangs: see its log)")


def _is_comm_error(err: BaseException) -> bool:
    text = f"{type(err).__name__} {err}".lower()
    return isinstance(err, getattr(dist, "DistError", ())) or any(
        s in text for s in ("timed out", "timeout", "connection closed", "connection reset", "gloo", "nccl",
                            "broken pipe", "peer"))


LOCK_FILE = ".treespec.lock"


def run_job(cfg, job):
    """A training job's start: the trainer's thread count, then ``job(cfg, ctx)`` inside a ``session`` (every
    rank under torchrun)."""
    t = cfg.trainer
    if t.threads:
        torch.set_num_threads(t.threads)
    with session(t.get("strategy", "ddp"), t.get("dist_timeout_s")) as ctx:
        # rank 0 holds the run folder: a second run given it is refused (the ranks of one run share it)
        hold = single_run(Path(cfg.run_dir) / LOCK_FILE, f"run_dir {cfg.run_dir}") if ctx.is_main \
            else contextlib.nullcontext()
        with hold:
            return job(cfg, ctx)


@contextlib.contextmanager
def session(strategy: str = "ddp", timeout_s: float | None = DEFAULT_TIMEOUT_S):
    """``setup`` for the duration of a job; an error is printed with this process's rank before it
    propagates (torchrun then stops the other ranks), and the process group is destroyed at the end."""
    ctx = setup(strategy, timeout_s)
    try:
        yield ctx
    except BaseException as err:
        if ctx.distributed and not isinstance(err, KeyboardInterrupt):
            print(failure_message(ctx, err), file=sys.stderr, flush=True)
        raise
    finally:
        teardown(ctx)


def barrier(ctx: Context) -> None:
    if ctx.distributed:
        dist.barrier()


@contextlib.contextmanager
def rank0_first(ctx: Context):
    """Rank 0 runs the block first (it fills the content-keyed caches: tokens, self-distillation, chat
    data), then the others (which find the caches filled)."""
    if ctx.distributed and not ctx.is_main:
        dist.barrier()
    yield
    if ctx.distributed and ctx.is_main:
        dist.barrier()


def mean_over_ranks(ctx: Context, value: float) -> float:
    if not ctx.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device if ctx.device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return t.item() / ctx.world_size


# -- the trainable module, wrapped ----------------------------------------------------------------------
class LossModule(nn.Module):
    """A module whose forward is ``loss_fn(batch)``: the trainable ``module`` is its submodule, so DDP's
    and FSDP's hooks (which run around ``forward``) cover every use of its parameters inside the loss."""

    def __init__(self, module: nn.Module, loss_fn):
        super().__init__()
        self.module = module
        self._loss_fn = [loss_fn]  # a plain attribute, not a submodule

    def forward(self, batch):
        return self._loss_fn[0](batch)


def decoder_layers(module: nn.Module) -> list[nn.Module]:
    """The transformers decoder layers inside ``module`` (classes named in a PreTrainedModel's
    ``_no_split_modules``) that hold trainable parameters: FSDP's units."""
    names: set[str] = set()
    for sub in module.modules():
        names |= set(getattr(sub, "_no_split_modules", None) or ())
    return [sub for sub in module.modules() if type(sub).__name__ in names and sub is not module
            and any(p.requires_grad for p in sub.parameters())]


def wrap(module: nn.Module, loss_fn, ctx: Context) -> nn.Module:
    """The module the loop calls: ``LossModule(module, loss_fn)`` as it is (one process), under DDP, or
    sharded by FSDP2 (decoder layers first, then the root). The returned module's forward(batch) is the
    loss; ``module``'s parameters are what the optimizer steps (DTensors under FSDP)."""
    wrapped = LossModule(module, loss_fn)
    if not ctx.distributed:
        return wrapped
    if ctx.strategy == "fsdp":

        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        for layer in decoder_layers(module):
            fully_shard(layer, mesh=mesh)
        fully_shard(wrapped, mesh=mesh)
        return wrapped

    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(wrapped, device_ids=device_ids, broadcast_buffers=False)


def is_fsdp(wrapped: nn.Module) -> bool:

    return isinstance(wrapped, FSDPModule)


@contextlib.contextmanager
def gradient_sync(wrapped: nn.Module, sync: bool):
    """Around one micro-batch's forward and backward: gradients are reduced across ranks only when
    ``sync`` (the last micro-batch of a step), accumulated locally otherwise."""

    if isinstance(wrapped, DistributedDataParallel) and not sync:
        with wrapped.no_sync():
            yield
    elif is_fsdp(wrapped):
        wrapped.set_requires_gradient_sync(sync)
        yield
    else:
        yield


@contextlib.contextmanager
def full_parameters(wrapped: nn.Module):
    """Inside the block the trainable module's own parameters are whole (FSDP: the root unit all-gathered;
    decoder-layer units gather themselves in their forward, so every rank must run the block)."""
    if is_fsdp(wrapped):
        wrapped.unshard()
        try:
            yield
        finally:
            wrapped.reshard()
    else:
        yield


def to_local(value):
    """A DTensor (FSDP's gradient norm) as a plain tensor."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


# -- checkpoints: one format whatever the strategy ------------------------------------------------------
def _fqn_order(wrapped: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """The fully qualified names of the optimizer's parameters in its state_dict numbering (groups in order)."""
    names = {id(p): n for n, p in wrapped.named_parameters()}
    return [names[id(p)] for group in opt.param_groups for p in group["params"]]


def full_state(wrapped: nn.Module, module: nn.Module, opt: torch.optim.Optimizer, trainable: set[str], ctx: Context
               ) -> tuple[dict | None, dict | None]:
    """(trainable parameters {name: tensor}, optimizer state_dict numbered as torch numbers it) on rank 0,
    (None, None) elsewhere. Under FSDP a collective: every rank must call it."""
    if not is_fsdp(wrapped):
        if not ctx.is_main:
            return None, None
        return {n: t for n, t in module.state_dict().items() if n in trainable}, opt.state_dict()

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(wrapped, options=options)
    optim_sd = get_optimizer_state_dict(wrapped, opt, options=options)
    if not ctx.is_main:
        return None, None
    prefix = "module."
    model_sd = {k[len(prefix):]: v for k, v in model_sd.items() if k[len(prefix):] in trainable}
    index = {name: i for i, name in enumerate(_fqn_order(wrapped, opt))}
    state = {index[name]: value for name, value in optim_sd["state"].items()}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in optim_sd["param_groups"]]
    return model_sd, {"state": state, "param_groups": groups}


def load_full_state(wrapped: nn.Module, opt: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
    """Under FSDP: load a checkpoint's full tensors (read by every rank) into the sharded module and optimizer."""

    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(wrapped, {f"module.{k}": v for k, v in model_sd.items()}, options=options)
    order = _fqn_order(wrapped, opt)
    state = {order[int(i)]: value for i, value in optim_sd["state"].items()}
    groups = [{**g, "params": [order[int(i)] for i in g["params"]]} for g in optim_sd["param_groups"]]
    set_optimizer_state_dict(wrapped, opt, {"state": state, "param_groups": groups},
                             options=StateDictOptions(full_state_dict=True))


def gathered_state(wrapped: nn.Module, trainable: set[str]) -> dict[str, torch.Tensor]:
    """Under FSDP, every rank: the trainable parameters as whole CPU tensors (a collective), to load into an
    unsharded copy of the module for export and evaluation after training."""

    sd = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True))
    prefix = "module."
    return {k[len(prefix):]: v.detach().cpu() for k, v in sd.items() if k[len(prefix):] in trainable}
