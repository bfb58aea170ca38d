"""The reproducibility stamp of a comparison run (results.md header, results.json, the wandb config): the
command line and resolved config, git commit and dirty state, package versions, device and threads,
checksums of the target's and the drafters' weights, the prompt set and the seed; for a workload run also
the workload (its source, a sha1 of the selected prompts, the template, the selection settings) and
whether the assisted-generation peer ran (it needs the target's vocabulary)."""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import torch
import transformers

from treespec.io import file_digest, weights_digest
from treespec.planning.profile_cache import cpu_name

ROOT = Path(__file__).resolve().parents[1]
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def command_line(argv: list[str] | None = None) -> str:
    argv = sys.argv if argv is None else argv
    return shlex.join(["python", *argv])


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def git_state() -> dict:
    """{commit, dirty, changed (tracked files that differ from the commit), diff_sha1}; commit None outside git."""
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no") or ""
    changed = sorted(line[3:] for line in status.splitlines() if line.strip())
    state = {"commit": commit.strip(), "dirty": bool(changed), "changed": changed}
    if changed:  # two dirty runs from the same commit are comparable only if their diffs are equal
        diff = _git("diff", "HEAD", "--no-ext-diff", "--binary") or ""
        state["diff_sha1"] = hashlib.sha1(diff.encode()).hexdigest()
    return state


def versions() -> dict:
    try:
        treespec = metadata.version("treespec")
    except metadata.PackageNotFoundError:
        treespec = None
    return {"treespec": treespec, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def device_info(device: torch.device | str = "cpu") -> dict:
    device = torch.device(device)
    info = {"device": str(device), "cpu": cpu_name(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def folder_checksums(folder: str | os.PathLike | None) -> dict:
    """sha1 of every weight file in a model folder, {file name: sha1} (empty when there is none)."""
    if folder is None or not Path(folder).is_dir():
        return {}
    return {p.name: file_digest(p) for p in sorted(Path(folder).iterdir()) if p.suffix in WEIGHT_SUFFIXES}


def model_checksum(module=None, source: str | None = None, folder: str | os.PathLike | None = None) -> dict:
    """Where a model came from and what it holds: its source, its weight files' sha1, and a sha1 over its
    loaded parameters (treespec.io.weights_digest); {"weights": None} for a drafter without weights."""
    if module is None and folder is None:
        return {"source": source, "weights": None}
    out = {"source": source, "files": folder_checksums(folder)}
    if module is not None:
        out["weights_sha1"] = weights_digest(module)
    return out


def prompts_digest(prompts: list[torch.Tensor]) -> str:
    """sha1 over the token ids of the prompts, in order: equal digests mean the same prompts were decoded."""
    h = hashlib.sha1()
    for p in prompts:
        h.update(p.reshape(-1).to("cpu", torch.int64).numpy().tobytes())
        h.update(b"|")
    return h.hexdigest()


def collect(*, target, target_source: str | None = None, target_folder=None, drafters: dict | None = None,
            prompts: list[torch.Tensor], prompt_set: str, command: str | None = None, config: dict | None = None,
            seed: int = 0, workload: dict | None = None, assistant: dict | None = None) -> dict:
    """Everything needed to tell whether two runs measured the same thing the same way; ``workload`` and
    ``assistant`` as train/compare/job.py records them."""
    device = next(target.parameters()).device
    return {
        "command": command if command is not None else command_line(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "git": git_state(),
        "versions": versions(),
        "device": device_info(device),
        "target": model_checksum(target, target_source, target_folder),
        "drafters": drafters or {},
        "prompts": {"set": prompt_set, "count": len(prompts), "token_ids_sha1": prompts_digest(prompts)},
        "seed": seed,
        **({"workload": workload} if workload is not None else {}),
        **({"assistant": assistant} if assistant is not None else {}),
        "config": config,
    }


def flatten(obj, prefix: str = "") -> dict[str, str]:
    """Nested dicts and lists as {dotted key: short text}, for listing where two stamps differ."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out or {prefix: "{}"}
    return {prefix: str(obj)}
