"""Several processes on PyTorch's own engine for a test: gloo on CPU, one thread each, started by one forkserver
that imports torch and treespec once (so no process inherits the test session's threads)."""

import multiprocessing as mp
import os
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, queue, timeout_s):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        queue.put((rank, "ok", fn(rank, *args)))
    except BaseException as err:  # noqa: BLE001 - reported to the test
        queue.put((rank, "error", f"{err!r}\n{traceback.format_exc()}"))
    finally:
        queue.close()
        queue.join_thread()  # the result is written before the process ends
        if dist.is_initialized():
            dist.destroy_process_group()
        os._exit(0)


def run_ranks(fn, *args, world: int = 2, timeout_s: float = 60.0, wait_s: float = 120.0) -> dict:
    """fn(rank, *args) (a module-level function, picklable args) on ``world`` processes joined by a gloo group
    → {rank: ("ok", result) or ("error", traceback)}; a process that reports nothing within ``wait_s`` is
    killed and missing."""
    ctx = mp.get_context("forkserver")
    # taken when the server first starts: the test module that ``fn`` lives in too, so each rank finds it imported
    ctx.set_forkserver_preload(["torch", "treespec.train.training.drafter_job", __name__, fn.__module__])
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue, timeout_s)) for r in range(world)]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + wait_s
    while len(results) < world and time.monotonic() < deadline:
        try:
            rank, status, value = queue.get(timeout=0.5)
            results[rank] = (status, value)
        except Exception:  # noqa: BLE001 - queue.Empty: a process died without reporting
            if not any(p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(timeout=5 if time.monotonic() < deadline else 0.1)
        if p.is_alive():
            p.kill()
            p.join()
    return results


def assert_ok(results: dict, world: int = 2) -> list:
    for rank in range(world):
        assert rank in results, f"rank {rank} reported nothing"
        assert results[rank][0] == "ok", f"rank {rank}: {results[rank][1]}"
    return [results[r][1] for r in range(world)]


KILL_AFTER = """
import importlib, os, signal, sys
from hydra import compose, initialize_config_dir
fsyncs, real = [0], os.fsync

def fsync(fd):  # SIGKILL right after the n-th durable write: a kill between a job's writes
    real(fd)
    fsyncs[0] += 1
    if fsyncs[0] == int(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGKILL)

os.fsync = fsync
with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
    cfg = compose(config_name=sys.argv[4], overrides=sys.argv[5:])
module, function = sys.argv[3].split(":")
getattr(importlib.import_module(module), function)(cfg)
"""


def run_killed(job: str, overrides: list[str], after: int, config: str = "train_heads") -> int:
    """Run ``job`` ("module:function", called with the hydra ``config`` of ``overrides``: train_heads, compare) in
    a fresh process that SIGKILLs itself right after its ``after``-th fsync (treespec's durable writes) → its
    return code (-9 when killed)."""
    import subprocess
    import sys

    from .models import CONF

    done = subprocess.run([sys.executable, "-c", KILL_AFTER, str(CONF), str(after), job, config, *overrides],
                          capture_output=True, text=True)
    return done.returncode
