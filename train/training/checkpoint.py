"""The training checkpoint format: atomic writes, a configuration fingerprint, ``latest.json`` and a fallback
to the previous checkpoint when the newest is unreadable.

Checkpoints hold no pickle (loading one never runs code). A run directory holds::

    latest.json              {"format", "checkpoints": ["ckpt-200", "ckpt-100"]}, newest first
    ckpt-200/state.safetensors   model.<param>, optimizer.state.<i>.<key>, rng.cpu (uint8), rng.cuda.<i>
    ckpt-200/meta.json           step, tokens_seen, wall_time, fingerprint, settings, optimizer param groups,
                                 tensors_sha1 (the sha1 of state.safetensors), meta_sha1 (of the rest)
    ckpt-100/...                 the previous checkpoint, the fallback when the newest is unreadable

What a resume checks: the fingerprint (architecture, data settings, batch shape, seed: anything that would make
the run another run) must equal the current one, or the resume is refused naming each differing setting; the
meta's own sha1 and the tensors' sha1 must hold (an edited step or a corrupt file falls back to the previous
checkpoint, naming it); ``settings`` (learning rate and schedule, total steps) may change, and the training
loop says which did.

A folder is written under a temporary name and renamed whole before ``latest.json`` is replaced,
so a crash at any point leaves a consistent pair of checkpoints. The format is the same whatever the
distribution strategy (an FSDP run's checkpoint holds whole tensors; train/training/distributed.py gathers them).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from treespec.io import atomic_write, atomic_write_json, file_digest, load_safetensors, read_json

FORMAT = "treespec-checkpoint-1"
LATEST = "latest.json"  # {"format", "checkpoints": ["ckpt-<step>", ...]}, newest first
TENSORS = "state.safetensors"
META = "meta.json"


class CheckpointMismatch(ValueError):
    """A checkpoint written for another configuration: never a reason to fall back to an older one."""


def _jsonable(obj):
    """``obj`` as it reads back from JSON (tuples become lists, keys strings): what saved metadata is compared with."""
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def _flat(settings: dict, prefix: str = "") -> dict:
    """Nested dicts as one dict with dotted keys ({"data": {"corpus": {"max_files": 5}}} → {"data.corpus.max_files":
    5}), so a difference names the setting, not the whole section."""
    out = {}
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def fingerprint_diff(saved: dict, now: dict) -> dict:
    """{setting: (saved value, current value)} for every setting that differs, nested ones by their dotted path
    (absent settings read as None)."""
    saved, now = _flat(_jsonable(saved or {})), _flat(_jsonable(now or {}))
    return {k: (saved.get(k), now.get(k)) for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)}


def meta_digest(meta: dict) -> str:
    """sha1 of a checkpoint's metadata without its ``meta_sha1``: an edited field (the step) is detected."""
    body = {k: v for k, v in meta.items() if k != "meta_sha1"}
    return hashlib.sha1(json.dumps(_jsonable(body), sort_keys=True).encode()).hexdigest()


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
    keep: list[str] | tuple[str, ...] = (), settings: dict | None = None,
) -> Path:
    """Write ``<run_dir>/ckpt-<step>/`` and then point ``<run_dir>/latest.json`` at it.

    The folder holds ``state.safetensors`` (tensors named ``model.<param>``, ``optimizer.state.<i>.<key>``,
    ``rng.<device>``) and ``meta.json`` (step, counters, fingerprint, ``settings`` a resume may change, the
    optimizer's param groups and non-tensor state, the sha1 of the tensor file, the sha1 of the rest). It is
    written under a temporary name and renamed whole, so a crash at any moment leaves the previous
    ``latest.json`` valid. ``latest.json`` lists the
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
            "fingerprint": _jsonable(fingerprint), "settings": _jsonable(settings or {}),
            "optimizer": {"param_groups": optimizer["param_groups"], "state": extra_state},
            "tensors_sha1": file_digest(tensor_file),
        }
        meta["meta_sha1"] = meta_digest(meta)
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
            names = read_json(pointer, "checkpoint pointer", dict)["checkpoints"]
            if not isinstance(names, list) or not all(map(_is_checkpoint_name, names)):
                raise ValueError(f"checkpoint pointer {pointer} does not list ckpt-<step> folders: {names!r}")
            return [run_dir / n for n in names]
        except (ValueError, KeyError, TypeError) as err:
            warnings.warn(f"{err}; looking for ckpt-<step> folders in {run_dir} instead", stacklevel=2)
    folders = [f for f in run_dir.glob("ckpt-*") if f.is_dir() and _is_checkpoint_name(f.name)]
    return sorted(folders, key=lambda f: int(f.name.split("-")[1]), reverse=True)


def read_checkpoint(folder: str | os.PathLike, fingerprint: dict) -> dict:
    """One checkpoint folder as {"step", "tokens_seen", "wall_time", "settings", "model", "optimizer", "rng",
    "path"}.

    The fingerprint is compared before any tensor is read: a difference raises ``CheckpointMismatch``
    naming the differing settings. A missing, truncated, corrupt or edited file (metadata that no longer
    matches its sha1) raises ValueError naming it. A fingerprint section the checkpoint predates (written
    before treespec recorded it) cannot be compared: a warning says so."""
    folder = Path(folder)
    meta_path, tensor_path = folder / META, folder / TENSORS
    if not folder.is_dir():
        raise ValueError(f"checkpoint {folder} is listed in {folder.parent / LATEST} but does not exist (deleted?)")
    try:
        meta = read_json(meta_path, "checkpoint metadata", dict)
    except FileNotFoundError as err:
        raise ValueError(str(err)) from None
    if "meta_sha1" in meta and meta["meta_sha1"] != meta_digest(meta):  # older checkpoints have none
        raise ValueError(f"checkpoint metadata {meta_path} does not match the meta_sha1 it was written with: edited "
                         "(its step, counters or fingerprint) or corrupt")
    try:
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
        predates = sorted(set(fingerprint) - set(meta["fingerprint"]))
        if predates:
            warnings.warn(f"checkpoint {meta_path} predates treespec recording {', '.join(predates)} in its "
                          "fingerprint: those settings cannot be compared on this resume", stacklevel=3)
        diff = fingerprint_diff(meta["fingerprint"], {k: v for k, v in fingerprint.items() if k not in predates})
        step, tokens_seen, wall_time = int(meta["step"]), int(meta["tokens_seen"]), float(meta["wall_time"])
        groups, extra_state = meta["optimizer"]["param_groups"], meta["optimizer"]["state"]
        digest = meta["tensors_sha1"]
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        raise ValueError(f"checkpoint metadata {meta_path} is malformed ({err!r})") from None
    if diff:
        fields = "; ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
        raise CheckpointMismatch(
            f"checkpoint {meta_path} was written for a different configuration: {', '.join(diff)} "
            f"{'differs' if len(diff) == 1 else 'differ'} "
            f"({fields}); resume=true continues that run: set these back, or train afresh (resume=false or "
            "another run_dir)"
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
    return {"step": step, "tokens_seen": tokens_seen, "wall_time": wall_time, "settings": meta.get("settings", {}),
            "model": model,
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
