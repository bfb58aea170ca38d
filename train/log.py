"""Run logging: a local JSONL file always, wandb when asked (offline when no credentials are set).

The local file means a run can be read without wandb: every ``log`` call appends one JSON line
``{"step": ..., "metrics": {...}}`` to ``<run_dir>/metrics.jsonl``; ``summary`` writes
``<run_dir>/summary.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def _wandb_mode() -> str:
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    has_key = os.environ.get("WANDB_API_KEY") or (Path.home() / ".netrc").is_file()
    return "online" if has_key else "offline"


class RunLogger:
    def __init__(self, run_dir: str | os.PathLike, *, use_wandb: bool = False, project: str = "treespec",
                 name: str | None = None, config: dict | None = None, resume: bool = False):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        if not resume and self.path.exists():
            self.path.unlink()
        if config is not None:
            (self.run_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
        self.wandb = None
        if use_wandb:
            import wandb

            self.wandb = wandb.init(
                project=project, name=name, config=config, dir=str(self.run_dir),
                mode=_wandb_mode(), resume="allow" if resume else None, reinit="finish_previous",
            )

    def log(self, metrics: dict, step: int | None = None) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "metrics": metrics}, default=float) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def histogram(self, name: str, values, step: int | None = None) -> None:
        """Raw values to the local file, a wandb Histogram to wandb."""
        values = [int(v) if float(v).is_integer() else float(v) for v in values]
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "histogram": {name: values}}) + "\n")
        if self.wandb is not None:
            import wandb

            self.wandb.log({name: wandb.Histogram(values)}, step=step)

    def summary(self, metrics: dict) -> None:
        (self.run_dir / "summary.json").write_text(json.dumps(metrics, indent=2, default=float))
        if self.wandb is not None:
            self.wandb.summary.update(metrics)

    def finish(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]
