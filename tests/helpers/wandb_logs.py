"""Reading what an offline wandb run wrote (its .wandb log is binary protobuf; keys appear verbatim)."""

import time
from pathlib import Path


def wandb_run_contains(run_dir, key: str, timeout_s: float = 30.0) -> bool:
    """True once some .wandb log under ``run_dir`` holds ``key``; wandb's service may still be flushing
    right after ``finish()`` on a loaded machine, so poll for a while."""
    deadline = time.monotonic() + timeout_s
    while True:
        logs = list(Path(run_dir).rglob("*.wandb"))
        if any(key.encode() in f.read_bytes() for f in logs):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
