"""Run logging: a local JSONL file always, wandb when asked (offline when no credentials are set).

The local file means a run can be read without wandb: every ``log`` call appends one JSON line
``{"step": ..., "metrics": {...}}`` to ``<run_dir>/metrics.jsonl`` (``histogram`` and ``table`` lines carry
``"histogram"`` / ``"table"`` instead of ``"metrics"``); ``summary`` writes ``<run_dir>/summary.json``.

wandb never blocks or ends a run: ``wandb.init`` runs with a bounded timeout in a helper thread; when
it fails or times out the logger retries in offline mode, then goes on without wandb, printing a
warning each time; a failing ``log`` call disables wandb for the rest of the run.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from treespec.io import atomic_write_text

WANDB_INIT_TIMEOUT_S = 90.0


def _wandb_mode() -> str:
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    has_key = os.environ.get("WANDB_API_KEY") or (Path.home() / ".netrc").is_file()
    return "online" if has_key else "offline"


def _call_with_timeout(fn, timeout_s: float):
    """``fn()`` in a daemon thread: its result, or raises its exception, or TimeoutError after ``timeout_s``
    (the thread is then abandoned: a hung network call cannot hold the run)."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            box["error"] = err

    thread = threading.Thread(target=target, name="wandb-init", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("result")


def truncate_metrics(path: str | os.PathLike, step: int) -> int:
    """Keep the lines of a metrics.jsonl file whose step is <= ``step`` (and lines without a step); drop
    later ones and unparseable ones (a line cut by a kill). Rewritten atomically; returns lines dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(errors="replace").split("\n"):
        if not line.strip():
            continue
        try:
            row_step = json.loads(line).get("step")
        except (json.JSONDecodeError, AttributeError):
            dropped += 1
            continue
        if isinstance(row_step, (int, float)) and row_step > step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        atomic_write_text(path, "".join(line + "\n" for line in kept))
    return dropped


class RunLogger:
    def __init__(self, run_dir: str | os.PathLike, *, use_wandb: bool = False, project: str = "treespec",
                 name: str | None = None, config: dict | None = None, resume: bool = False,
                 wandb_init_timeout: float = WANDB_INIT_TIMEOUT_S):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        if not resume and self.path.exists():
            self.path.unlink()
        if config is not None:
            (self.run_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
        self.wandb = None
        if use_wandb:
            self.wandb = self._init_wandb(project=project, name=name, config=config, resume=resume,
                                          timeout_s=wandb_init_timeout)

    def _init_wandb(self, *, project, name, config, resume, timeout_s: float):
        """A wandb run in the configured mode, else an offline one, else None; never raises or hangs."""
        try:
            import wandb
        except Exception as err:  # noqa: BLE001 - a broken wandb install must not end the run
            print(f"warning: wandb cannot be imported ({err!r}); logging to {self.path} only")
            return None
        mode = _wandb_mode()
        for attempt in dict.fromkeys([mode, "offline"]):  # the configured mode, then offline
            def init(attempt=attempt):
                try:
                    settings = wandb.Settings(init_timeout=timeout_s)
                except Exception:  # noqa: BLE001 - an older wandb without the setting
                    settings = None
                return wandb.init(project=project, name=name, config=config, dir=str(self.run_dir), mode=attempt,
                                  resume="allow" if resume else None, reinit="finish_previous", settings=settings)

            try:  # wandb's own timeout first; the thread's bound catches a hang anywhere else in init
                return _call_with_timeout(init, timeout_s + min(timeout_s, 10.0))
            except (Exception, SystemExit) as err:  # noqa: BLE001 - wandb must never end the run
                then = "retrying offline" if attempt != "offline" else f"logging to {self.path} only"
                print(f"warning: wandb.init (mode={attempt}) failed: {err!r}; {then}")
        return None

    def _wandb_call(self, fn) -> None:
        """Run a call on the wandb run; an error disables wandb (with a warning) instead of ending the run."""
        if self.wandb is None:
            return
        try:
            fn(self.wandb)
        except Exception as err:  # noqa: BLE001
            print(f"warning: wandb failed ({err!r}); logging to {self.path} only from now on")
            self.wandb = None

    def truncate(self, step: int) -> None:
        """Forget what was logged after ``step`` (a resumed run logs those steps again)."""
        dropped = truncate_metrics(self.path, step)
        if dropped:
            print(f"{self.path}: dropped {dropped} lines logged after step {step}, the step resumed from")

    def log(self, metrics: dict, step: int | None = None) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "metrics": metrics}, default=float) + "\n")
        self._wandb_call(lambda run: run.log(metrics, step=step))

    def histogram(self, name: str, values, step: int | None = None) -> None:
        """Raw values to the local file, a wandb Histogram to wandb."""
        values = [int(v) if float(v).is_integer() else float(v) for v in values]
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "histogram": {name: values}}) + "\n")
        if self.wandb is not None:
            import wandb

            self._wandb_call(lambda run: run.log({name: wandb.Histogram(values)}, step=step))

    def table(self, name: str, columns: list[str], rows: list[list], step: int | None = None) -> None:
        """A table: one metrics.jsonl line ``{"step", "table": {name: {"columns", "data"}}}``, and a wandb.Table
        (which an offline run also keeps as JSON: ``wandb/*run-*/files/media/table/<name>_<step>_*.table.json``)."""
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "table": {name: {"columns": columns, "data": rows}}}, default=float)
                    + "\n")
        if self.wandb is not None:
            import wandb

            self._wandb_call(lambda run: run.log({name: wandb.Table(columns=columns, data=rows)}, step=step))

    def summary(self, metrics: dict) -> None:
        (self.run_dir / "summary.json").write_text(json.dumps(metrics, indent=2, default=float))
        self._wandb_call(lambda run: run.summary.update(metrics))

    def finish(self) -> None:
        self._wandb_call(lambda run: run.finish())
        self.wandb = None


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]
