"""Several processes on PyTorch's own engine (gloo on CPU, 2 processes of 1 thread, started by one forkserver
that imports torch and treespec once, so no process inherits the test session's threads): DDP makes the same
update as one process with grad_accum=2 on the same global batch, FSDP2 the same as DDP, a resumed DDP run the
same as an uninterrupted one; only rank 0 writes logs and checkpoints; a rank that dies or hangs ends the others
with an error naming it instead of a hang. ``torchrun`` itself runs in the slow test at the end."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from treespec.train.training import distributed
from treespec.train.training import drafter_job as train_heads
from treespec.train.training.loop import OptimConfig, train

from tests.helpers import (
    BAD_ROWS,
    ROOT,
    assert_ok,
    conversations,
    free_port,
    heads_cfg,
    run_ranks,
    tiny_chat_target,
    write_jsonl,
)


def _heads_run(rank, cfg):
    return train_heads.run(cfg)


def drafter_weights(run_dir: Path) -> dict:
    return load_file(run_dir / "final" / "eagle.safetensors")


def assert_close(a: dict, b: dict, atol: float):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    target = tiny_chat_target(root / "target")
    source = write_jsonl(root / "chat.jsonl", conversations(40) + BAD_ROWS)
    train_heads.run(heads_cfg(root / "warm", target, source, "trainer.max_steps=1"))  # fills the chat data cache
    return root, target, source


@pytest.fixture(scope="module")
def ddp_run(setup):
    """A 3-step EAGLE run on chat data with 2 DDP ranks (feature noise on: reseeded per micro-batch)."""
    root, target, source = setup
    run_dir = root / "ddp"
    summaries = assert_ok(run_ranks(_heads_run, heads_cfg(run_dir, target, source)))
    return run_dir, summaries


# the runs on two ranks (about 25 s of the default suite's 2 cores) with -m slow, as the torchrun job is; the default
# suite keeps the global batch's split and a dead rank's clear end
@pytest.mark.slow
def test_ddp_equals_one_process_with_grad_accum(setup, ddp_run):
    root, target, source = setup
    run_dir, _ = ddp_run
    single = train_heads.run(heads_cfg(root / "accum", target, source, "trainer.grad_accum=2"))
    assert single["steps"] == 3
    assert_close(drafter_weights(run_dir), drafter_weights(root / "accum"), atol=1e-5)
    plain = drafter_weights(root / "warm")  # a different run: the comparison can fail
    assert any(not torch.allclose(plain[k], drafter_weights(run_dir)[k], atol=1e-5) for k in plain)


@pytest.mark.slow
def test_only_rank0_logs_and_writes(ddp_run):
    run_dir, (summary0, summary1) = ddp_run
    assert summary0["steps"] == 3 and summary0["world_size"] == 2 and summary1 == {}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "train/loss" in r.get("metrics", {})]
    assert steps == [1, 2, 3]  # each step logged once, by one rank
    files = {p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*") if p.is_file()}
    assert not [f for f in files if f.endswith(".tmp") or f.startswith(".")]
    assert {"metrics.jsonl", "summary.json", "config.json", "latest.json", "final/eagle.safetensors"} <= files
    assert json.loads((run_dir / "latest.json").read_text())["checkpoints"] == ["ckpt-3", "ckpt-2"]


@pytest.mark.slow
def test_fsdp_equals_ddp(setup, ddp_run):
    root, target, source = setup
    run_dir, _ = ddp_run
    summaries = assert_ok(run_ranks(_heads_run, heads_cfg(root / "fsdp", target, source, "trainer.strategy=fsdp")))
    assert summaries[0]["steps"] == 3
    assert_close(drafter_weights(root / "fsdp"), drafter_weights(run_dir), atol=1e-5)


@pytest.mark.slow
def test_resume_under_ddp_equals_uninterrupted(setup, ddp_run):
    root, target, source = setup
    run_dir, _ = ddp_run
    split = root / "resumed"
    assert_ok(run_ranks(_heads_run, heads_cfg(split, target, source, "trainer.stop_after=2")))
    assert not (split / "final").exists()
    assert_ok(run_ranks(_heads_run, heads_cfg(split, target, source, "resume=true")))
    assert_close(drafter_weights(split), drafter_weights(run_dir), atol=0)
    steps = [json.loads(line)["step"] for line in (split / "metrics.jsonl").read_text().splitlines()
             if "train/loss" in line]
    assert steps == [1, 2, 3]


def test_the_global_batch_must_split_over_ranks_and_micro_batches(monkeypatch):
    trainer = {"batch_size": 6, "seq_len": 8, "strategy": "ddp", "grad_accum": 4, "dist_timeout_s": 60}
    with pytest.raises(ValueError, match=r"does not split into 1 rank\(s\) × trainer.grad_accum=4"):
        distributed.check_trainer(trainer)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"does not split into 4 rank\(s\) × trainer.grad_accum=1"):
        distributed.check_trainer({**trainer, "grad_accum": 1})
    with pytest.raises(ValueError, match="strategy must be one of ddp, fsdp"):
        distributed.check_trainer({**trainer, "batch_size": 8, "grad_accum": 1, "strategy": "zero3"})


# -- a rank that dies --------------------------------------------------------------------------------------
def _failing(rank, run_dir, how):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)

    def batch_at(step):
        if rank == 1 and step == 2:
            if how == "dies":
                os._exit(3)  # a crash: no exception, no goodbye
            time.sleep(20)  # hangs (then dies unheard)
            os._exit(3)
        return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))

    def loss_fn(batch):
        return F.mse_loss(model(batch), batch), {}

    ctx = distributed.setup("ddp")
    ctx.timeout_s = 3.0  # what the test's group was given
    t0 = time.monotonic()
    try:
        train(model, loss_fn, batch_at, total_steps=10, optim=OptimConfig(warmup_steps=1), run_dir=run_dir,
              fingerprint={}, ckpt_every=100, progress=False, seed=0, dist=ctx)
    except Exception as err:  # noqa: BLE001 - what the job prints before torchrun stops the others
        return {"message": distributed.failure_message(ctx, err), "seconds": time.monotonic() - t0}
    return {"message": None}


@pytest.mark.parametrize("how", ["dies", pytest.param("hangs", marks=pytest.mark.slow)])  # a hang waits out a timeout
def test_a_dead_or_hung_rank_ends_the_others_with_a_clear_error(tmp_path, how):
    """A crash is seen at once (the peer's socket closes); a hang when the group's timeout (here 3 s) expires."""
    results = run_ranks(_failing, tmp_path, how, timeout_s=3.0, wait_s=6.0)
    assert 1 not in results  # it died without a word
    status, value = results[0]
    assert status == "ok" and value["message"] is not None, value
    assert value["message"].startswith("[rank 0/2] a collective timed out or lost a peer")
    assert "another rank probably died or hangs" in value["message"]
    assert value["seconds"] < 10


@pytest.mark.slow
def test_torchrun_trains_and_writes_once(setup, tmp_path):
    """The command line the README gives: torchrun, 2 processes, FSDP, then a DDP resume of the FSDP checkpoint."""
    root, target, source = setup
    base = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
            str(free_port()), str(ROOT / "scripts" / "train_heads.py"), "drafter=eagle", "data=chat",
            f"data.chat.source={source}", f"target={target}", f"run_dir={tmp_path}",
            f"data.cache_dir={root / 'cache'}", "logger=none", "trainer.seq_len=96", "trainer.batch_size=4",
            "trainer.max_steps=4", "trainer.eval_every=2", "trainer.eval_windows=4", "trainer.ckpt_every=2",
            "trainer.progress=false", "drafter.accuracy_depth=2", "eval.prompts=1", "eval.max_new_tokens=4",
            "trainer.threads=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([*base, "trainer.strategy=fsdp", "trainer.stop_after=2"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    out = subprocess.run([*base, "resume=true"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "final" / "eagle.safetensors").is_file()
    assert "resuming from" in out.stdout and out.stdout.count("resuming from") == 1  # rank 0 alone prints
