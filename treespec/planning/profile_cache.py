"""A drafter's measurements cached on this machine, each measured once on first use: its cost model (the
target's cost curve, its drafting costs, the engine's cost per step: ``autotree.cost_curve_record``) per
machine, target and drafter, and its chain τ (treespec/planning/chain_tau.py) per target, drafter and sampling.

They live in treespec's cache folder (``treespec.gguf_models.cache_root``: ``$TREESPEC_CACHE``, else
``~/.cache/treespec``), under ``profiles/``, one JSON file per key. Keys are made of fingerprints, never of
paths: a target or drafter is known by its weights (``fingerprint``), a machine by its device, its processor
and the threads torch runs with (``machine``), since a cost curve timed with 2 threads is not one timed with 1, and
a target also by the kernels its passes run (``kernels``).
Chain τ does not depend on the machine. Delete the folder to measure again.
"""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import Callable
from pathlib import Path

import torch

from treespec.gguf_models import cache_root
from treespec.io import atomic_write_json, read_json
from treespec.linear_kernels import linear_kernel_of

# bump when what a cached record means changes: older entries are then measured again (2: drafting timed in the
# decoding loop, with a per-node term)
FORMAT = 2
WHAT = {"cost_model": "cost model on this machine", "chain_tau": "chain τ at this sampling"}  # for the log line


def fingerprint(*modules) -> str:
    """sha1 of the modules' parameter names, shapes, dtypes and a strided sample of each one's values (64 per
    tensor): different weights give different fingerprints, at a small fraction of hashing every byte."""
    digest = hashlib.sha1()
    for module in modules:
        digest.update(type(module).__name__.encode())
        for name, tensor in sorted(module.state_dict().items()):
            flat = tensor.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 64)].float().cpu() if flat.numel() else flat.float().cpu()
            digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def cpu_name() -> str:
    """The processor's model name (Linux: /proc/cpuinfo), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device) -> dict:
    """What a cost curve's seconds depend on besides the models: the device (its GPU's name), the processor, and
    torch's threads on a CPU."""
    device = torch.device(device)
    out = {"device": device.type, "cpu": cpu_name(), "torch": torch.__version__}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    else:
        out["threads"] = torch.get_num_threads()
    return out


def kernels(target) -> dict:
    """The kernels a target's passes run (its linear layers': treespec/linear_kernels.py; its attention
    implementation): a cost curve timed on one is not one timed on another."""
    return {"linear": linear_kernel_of(target), "attention": getattr(target.config, "_attn_implementation", None)}


def key(**parts) -> str:
    """A cache entry's name: sha1 of ``parts`` (JSON, sorted) and FORMAT."""
    return hashlib.sha1(json.dumps({"format": FORMAT, **parts}, sort_keys=True).encode()).hexdigest()[:20]


def entry(kind: str, name: str) -> Path:
    return cache_root() / "profiles" / kind / f"{name}.json"


def cached(kind: str, name: str, measure: Callable[[], dict], log=print) -> dict:
    """The record cached under ``kind``/``name``, or ``measure()``'s, written there first (once per key)."""
    path = entry(kind, name)
    if path.is_file():
        return read_json(path, f"cached {kind} record", dict)
    log(f"measuring this drafter's {WHAT.get(kind, kind)} once (cached in {path.parent})")
    record = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, record, indent=1)
    return record


def cost_key(target, drafter_fingerprint: str) -> str:
    """The cost model's key: this machine (the target's device), the target and its kernels, the drafter."""
    return key(machine=machine(target.device), kernels=kernels(target), target=fingerprint(target),
               drafter=drafter_fingerprint)


def measured_here(record: dict | None, target) -> bool:
    """Whether a saved cost record (a folder's cost_curve.json) was measured on this machine for this target on its
    kernels: written with ``machine``, ``kernels`` and ``target`` fields that match (older files lack them)."""
    return bool(record) and record.get("machine") == machine(target.device) and \
        record.get("kernels") == kernels(target) and record.get("target") == fingerprint(target)
