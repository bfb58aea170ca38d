"""Checkpoints: no pickle, exact resume, surviving the loss of one checkpoint; a metrics log without
repeated steps; wandb that never blocks a run; loading weights that names the file."""

import json
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from treespec.io import load_safetensors
from treespec.train.training import checkpoint
from treespec.train.training.checkpoint import CheckpointMismatch
from treespec.train.training.log import RunLogger, read_metrics, truncate_metrics
from treespec.train.training.loop import OptimConfig, train

VOCAB, HIDDEN, STEPS = 32, 16, 12


class Tiny(torch.nn.Module):
    """2-D and 1-D parameters, a frozen layer (never checkpointed) and dropout (so the RNG state matters)."""

    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, hidden)
        self.frozen = torch.nn.Linear(hidden, hidden).requires_grad_(False)
        self.norm = torch.nn.LayerNorm(hidden)
        self.drop = torch.nn.Dropout(0.2)
        self.out = torch.nn.Linear(hidden, VOCAB)

    def forward(self, ids):
        return self.out(self.drop(self.norm(self.frozen(self.embed(ids)))))


def batch_at(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 9), generator=torch.Generator().manual_seed(1000 + step))


class Killed(Exception):
    pass


def run(run_dir: Path, *, resume=False, stop_after=None, kill_at=None, hidden=HIDDEN, logger=True):
    """A 12-step run with checkpoints every 4 steps; ``kill_at`` raises when that step's batch is drawn,
    after steps < kill_at were logged, like a kill between a log line and the next checkpoint."""
    torch.manual_seed(0)
    model = Tiny(hidden)

    def batches(step):
        if kill_at is not None and step == kill_at:
            raise Killed(step)
        return batch_at(step)

    def loss_fn(batch):
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()), {}

    log = RunLogger(run_dir, resume=resume) if logger else None
    fingerprint = {"hidden": hidden, "vocab": VOCAB, "betas": (0.9, 0.95), "layers": [1, 2]}  # tuples too
    try:
        train(model, loss_fn, batches, total_steps=STEPS, optim=OptimConfig(lr=1e-2, warmup_steps=2),
              run_dir=run_dir, fingerprint=fingerprint, ckpt_every=4, log_every=1, resume=resume,
              logger=log, progress=False, stop_after=stop_after)
    except Killed:
        pass
    return model


def weights(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def logged_losses(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["metrics"]["train/loss"]) for r in read_metrics(run_dir) if "train/loss" in r["metrics"]]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """An uninterrupted run: (its run dir, its final weights)."""
    run_dir = tmp_path_factory.mktemp("whole")
    return run_dir, weights(run(run_dir))


def test_layout_holds_no_pickle_and_keeps_two_checkpoints(whole):
    run_dir, _ = whole
    assert json.loads((run_dir / "latest.json").read_text())["checkpoints"] == ["ckpt-12", "ckpt-8"]
    assert sorted(p.name for p in run_dir.iterdir()) == ["ckpt-12", "ckpt-8", "latest.json", "metrics.jsonl"]
    assert sorted(p.name for p in (run_dir / "ckpt-12").iterdir()) == ["meta.json", "state.safetensors"]
    tensors = load_file(run_dir / "ckpt-12" / "state.safetensors")
    assert "model.frozen.weight" not in tensors and "model.out.weight" in tensors
    assert tensors["rng.cpu"].dtype == torch.uint8
    assert {"optimizer.state.0.exp_avg", "optimizer.state.0.exp_avg_sq", "optimizer.state.0.step"} <= tensors.keys()
    meta = json.loads((run_dir / "ckpt-12" / "meta.json").read_text())
    assert meta["step"] == 12 and meta["tokens_seen"] == 12 * 4 * 8
    assert [len(g["params"]) for g in meta["optimizer"]["param_groups"]] == [2, 3]  # decay / no decay


def test_killed_run_resumes_bit_identically_without_logging_a_step_twice(whole, tmp_path):
    run_dir, expected = whole
    run(tmp_path, kill_at=6)  # steps 1..6 logged, last checkpoint at step 4
    assert [s for s, _ in logged_losses(tmp_path)] == [1, 2, 3, 4, 5, 6]
    resumed = weights(run(tmp_path, resume=True))
    assert_same(resumed, expected)
    assert logged_losses(tmp_path) == logged_losses(run_dir)  # steps 1..12 once each, the same losses


def test_stop_after_then_resume_is_bit_identical(whole, tmp_path):
    run(tmp_path, stop_after=5)  # a checkpoint at step 4 and at step 5
    assert json.loads((tmp_path / "latest.json").read_text())["checkpoints"] == ["ckpt-5", "ckpt-4"]
    assert_same(weights(run(tmp_path, resume=True)), whole[1])


class Plant:
    """Unpickling this creates ``marker``: what a malicious checkpoint.pt would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def plant_pickle(path: Path, marker: Path) -> None:
    torch.save({"step": 999, "model": Plant(marker)}, path)


def test_planted_pickle_checkpoint_is_never_executed(tmp_path, forbid_unpickling, capsys):
    # the plant works: loading it with pickle enabled runs its code
    plant_pickle(tmp_path / "probe.pt", tmp_path / "probe-marker")
    torch.load(tmp_path / "probe.pt", weights_only=False)
    assert (tmp_path / "probe-marker").exists()

    # alone in a run folder it is no checkpoint: the run starts from step 0 without opening it
    run_dir, marker = tmp_path / "run", tmp_path / "pwned"
    run_dir.mkdir()
    plant_pickle(run_dir / "checkpoint.pt", marker)
    forbid_unpickling()
    run(run_dir, resume=True, stop_after=1)
    assert "no checkpoint" in capsys.readouterr().out
    assert not marker.exists()

    # beside a real checkpoint it is ignored: the run resumes from ckpt-4, still without running it
    run(tmp_path / "run2", stop_after=4)
    plant_pickle(tmp_path / "run2" / "checkpoint.pt", marker)
    run(tmp_path / "run2", resume=True)
    assert not marker.exists()
    assert json.loads((tmp_path / "run2" / "latest.json").read_text())["checkpoints"] == ["ckpt-12", "ckpt-8"]


def test_pickle_disguised_as_the_tensor_file_is_refused(tmp_path, forbid_unpickling):
    run(tmp_path, stop_after=4)
    marker = tmp_path / "pwned"
    tensor_file = tmp_path / "ckpt-4" / "state.safetensors"
    plant_pickle(tensor_file, marker)
    meta = json.loads((tmp_path / "ckpt-4" / "meta.json").read_text())
    meta["tensors_sha1"] = checkpoint.file_digest(tensor_file)  # even with matching digests
    meta["meta_sha1"] = checkpoint.meta_digest(meta)
    (tmp_path / "ckpt-4" / "meta.json").write_text(json.dumps(meta))
    forbid_unpickling()
    with pytest.warns(UserWarning, match="ckpt-4/state.safetensors"), \
            pytest.raises(ValueError, match=r"no readable checkpoint.*ckpt-4/state\.safetensors"):
        run(tmp_path, resume=True)
    assert not marker.exists()


def corrupt(folder: Path, how: str) -> str:
    """Damage one checkpoint folder; returns the file the error must name."""
    tensors, meta = folder / "state.safetensors", folder / "meta.json"
    if how == "truncated tensors":
        tensors.write_bytes(tensors.read_bytes()[:-100])
    elif how == "flipped byte":
        data = bytearray(tensors.read_bytes())
        data[-5] ^= 0xFF
        tensors.write_bytes(bytes(data))
    elif how == "missing tensors":
        tensors.unlink()
    elif how == "truncated meta":
        meta.write_text(meta.read_text()[:40])
    elif how == "nan weights":
        state = load_file(tensors)
        state["model.out.bias"][0] = float("nan")
        save_file(state, tensors)
        info = json.loads(meta.read_text())
        info["tensors_sha1"] = checkpoint.file_digest(tensors)
        info["meta_sha1"] = checkpoint.meta_digest(info)
        meta.write_text(json.dumps(info))
        return "model.out.bias"
    return (meta if "meta" in how else tensors).relative_to(folder.parent).as_posix()


@pytest.mark.parametrize("how", ["truncated tensors", "flipped byte", "missing tensors", "truncated meta",
                                 "nan weights"])
def test_unreadable_latest_falls_back_to_previous(whole, tmp_path, how):
    run(tmp_path, stop_after=8)  # ckpt-8 and ckpt-4
    named = corrupt(tmp_path / "ckpt-8", how)
    with pytest.warns(UserWarning, match=named):
        resumed = weights(run(tmp_path, resume=True))
    assert_same(resumed, whole[1])  # from step 4, still exact
    assert json.loads((tmp_path / "latest.json").read_text())["checkpoints"] == ["ckpt-12", "ckpt-8"]


def test_no_readable_checkpoint_names_every_file(tmp_path):
    run(tmp_path, stop_after=8)
    corrupt(tmp_path / "ckpt-8", "truncated tensors")
    corrupt(tmp_path / "ckpt-4", "truncated meta")
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"no readable checkpoint") as err:
        run(tmp_path, resume=True)
    assert "ckpt-8/state.safetensors" in str(err.value) and "ckpt-4/meta.json" in str(err.value)


def test_corrupt_pointer_falls_back_to_the_folders(whole, tmp_path):
    run(tmp_path, stop_after=8)
    (tmp_path / "latest.json").write_text('{"checkpoints": ["ckpt-8"')
    with pytest.warns(UserWarning, match="latest.json"):
        assert_same(weights(run(tmp_path, resume=True)), whole[1])


def test_fingerprint_is_checked_before_any_tensor_is_read(tmp_path, monkeypatch):
    run(tmp_path, stop_after=4)
    corrupt(tmp_path / "ckpt-4", "truncated tensors")  # reading the tensors would fail differently

    def boom(*args, **kwargs):
        raise AssertionError("tensors read before the fingerprint was checked")

    monkeypatch.setattr(checkpoint, "load_safetensors", boom)
    monkeypatch.setattr(checkpoint, "file_digest", boom)
    with pytest.raises(CheckpointMismatch, match=r"different configuration: hidden differ.*saved 16, now 24"):
        run(tmp_path, resume=True, hidden=24)


def test_fresh_run_never_resumes_an_earlier_runs_checkpoint(tmp_path, capsys):
    run(tmp_path, stop_after=8)
    run(tmp_path, kill_at=2)  # a new run (resume=false) killed before its first checkpoint
    assert not (tmp_path / "latest.json").exists() and not list(tmp_path.glob("ckpt-*"))
    run(tmp_path, resume=True, stop_after=1)
    assert "no checkpoint" in capsys.readouterr().out
    assert [s for s, _ in logged_losses(tmp_path)] == [1]


def test_truncate_metrics_drops_later_and_cut_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "metrics": {"x": s}} for s in range(1, 7)] + [{"step": None, "histogram": {"h": [1]}}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7, "metr')
    assert truncate_metrics(path, 4) == 3
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, None]
    assert truncate_metrics(path, 4) == 0


# --- loading that names the file -------------------------------------------------------------------


def test_load_safetensors_names_the_file_and_the_tensor(tmp_path):
    good = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(50), "ids": torch.arange(5), "half": torch.ones(3, dtype=torch.bfloat16)}, good)
    loaded = load_safetensors(good)
    assert torch.equal(loaded["ids"], torch.arange(5)) and loaded["half"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"weights .*missing\.safetensors does not exist"):
        load_safetensors(tmp_path / "missing.safetensors")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-10])
    with pytest.raises(ValueError, match=r"drafter .*cut\.safetensors .*truncated or corrupt"):
        load_safetensors(cut, "drafter")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match=r"junk\.safetensors .*truncated or corrupt"):
        load_safetensors(junk)
    for bad in (float("nan"), float("inf")):
        save_file({"fine": torch.ones(2), "bad": torch.tensor([1.0, bad])}, tmp_path / "bad.safetensors")
        with pytest.raises(ValueError, match=r"bad\.safetensors: tensor 'bad' holds non-finite"):
            load_safetensors(tmp_path / "bad.safetensors")


# --- wandb never blocks a run -----------------------------------------------------------------------


class FakeRun:
    def __init__(self, fail_log=False):
        self.logged, self.fail_log, self.finished = [], fail_log, False

    def log(self, metrics, step=None):
        if self.fail_log:
            raise ConnectionError("wandb backend went away")
        self.logged.append((step, metrics))

    def finish(self):
        self.finished = True


@pytest.fixture
def wandb_module(monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "online")
    return wandb


def test_wandb_init_failure_falls_back_to_offline(tmp_path, wandb_module, monkeypatch, capsys):
    modes, fake = [], FakeRun()

    def init(**kwargs):
        modes.append(kwargs["mode"])
        assert kwargs["settings"].init_timeout == 2.0
        if kwargs["mode"] != "offline":
            raise ConnectionError("api.wandb.ai unreachable")
        return fake

    monkeypatch.setattr(wandb_module, "init", init)
    logger = RunLogger(tmp_path, use_wandb=True, wandb_init_timeout=2.0)
    assert modes == ["online", "offline"] and logger.wandb is fake
    assert "wandb.init (mode=online) failed" in capsys.readouterr().out
    logger.log({"loss": 1.0}, step=1)
    logger.finish()
    assert fake.logged == [(1, {"loss": 1.0})] and fake.finished


def test_hanging_wandb_init_never_blocks_the_run(tmp_path, wandb_module, monkeypatch, capsys):
    release, calls = threading.Event(), []

    def init(**kwargs):
        calls.append(kwargs["mode"])
        release.wait(30)
        raise ConnectionError("gave up")

    monkeypatch.setattr(wandb_module, "init", init)
    t0 = time.monotonic()
    try:
        logger = RunLogger(tmp_path, use_wandb=True, wandb_init_timeout=0.3)
        elapsed = time.monotonic() - t0
    finally:
        release.set()
    assert elapsed < 3 and calls == ["online", "offline"]
    assert logger.wandb is None
    out = capsys.readouterr().out
    assert "no answer within" in out and "metrics.jsonl only" in out
    logger.log({"loss": 2.0}, step=3)
    logger.finish()
    assert read_metrics(tmp_path) == [{"step": 3, "metrics": {"loss": 2.0}}]


def test_failing_wandb_log_disables_wandb_not_the_run(tmp_path, wandb_module, monkeypatch, capsys):
    monkeypatch.setattr(wandb_module, "init", lambda **kwargs: FakeRun(fail_log=True))
    logger = RunLogger(tmp_path, use_wandb=True)
    logger.log({"loss": 1.0}, step=1)
    logger.log({"loss": 0.5}, step=2)
    assert logger.wandb is None and "wandb failed" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
