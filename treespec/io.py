"""Files, safely: written so that a crash never leaves half of one (write a temporary file beside the
target, flush it, rename it over the target: atomic on POSIX and Windows); read so that a missing,
truncated or corrupt file is an error naming it (JSON, safetensors; never pickle); and digests of
weights and files, so caches are keyed by content; and one run at a time per output (``single_run``)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file


def folder_path(path: str | os.PathLike, what: str = "folder") -> Path:
    """``path`` where a folder is or can be made: one that is a file, or lies under a file, is a ValueError naming
    both (rather than mkdir's bare FileExistsError / NotADirectoryError)."""
    path = Path(path)
    for folder in (path, *path.parents):
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"{what} {path}: {folder} is a file, not a folder; choose another path")
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


@contextlib.contextmanager
def single_run(lock: str | os.PathLike, what: str):
    """Hold ``lock`` (a file: a run folder's ``.treespec.lock``, an output's ``<out>.lock``) while one run writes
    ``what``: a second run given the same output is refused, naming the first (its pid, host and start), rather
    than interleaving with it. A lock left by a killed run (its process gone, on this host) is taken over."""
    lock = Path(lock)
    folder_path(lock.parent, f"the folder of {what}").mkdir(parents=True, exist_ok=True)
    mine = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                held = json.loads(lock.read_text())
            except (OSError, ValueError):
                held = {}
            if held.get("host") == mine["host"] and isinstance(held.get("pid"), int) and not _alive(held["pid"]):
                lock.unlink(missing_ok=True)  # its run was killed: take over
                continue
            raise RuntimeError(f"{what} is in use by another run (pid {held.get('pid')} on {held.get('host')}, "
                               f"since {held.get('started')}; lock {lock}): wait for it to finish, or choose another "
                               "output; delete the lock only if that run is gone") from None
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)
        break
    try:
        yield lock
    finally:
        lock.unlink(missing_ok=True)


def remove_stale_temps(folder: str | os.PathLike) -> list[str]:
    """Delete the temporary files ``atomic_write`` left in ``folder`` when its process was killed (their names
    carry the writer's pid; a live writer's are kept) → the names removed."""
    removed = []
    for tmp in Path(folder).glob(".*.tmp"):
        pid = tmp.name.rsplit(".", 2)[-2]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)
            removed.append(tmp.name)
    return removed


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_path)`` to produce the file, then move it to ``path`` in one step. Returns ``path``."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give a file path to write")
    folder_path(path.parent, f"the folder of {path.name}").mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def atomic_write_json(path: str | os.PathLike, obj, **kwargs) -> Path:
    return atomic_write_text(path, json.dumps(obj, **kwargs))


def regular_file(path: str | os.PathLike, what: str = "file") -> Path:
    """``path`` when it is a regular file (a link to one included); a missing path, a folder or a device
    (a weight file linked to /dev/zero reads forever) is an error naming it."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.exists():
        raise FileNotFoundError(f"{what} {path} does not exist" + (
            f" (it is a link to {os.readlink(path)}, which is missing)" if path.is_symlink() else ""))
    target = f" (a link to {path.resolve()})" if path.is_symlink() else ""
    raise ValueError(f"{what} {path}{target} is not a regular file")


def read_json(path: str | os.PathLike, what: str = "file", kind: type | None = None):
    """A JSON file's contents; a missing, unreadable or malformed file is an error naming it (FileNotFoundError
    when it is missing, ValueError otherwise), and so is contents that are not a ``kind`` (dict, list) when
    one is given."""
    path = regular_file(path, what)
    try:
        obj = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{what} {path} is not valid JSON ({err}); the file is truncated or corrupt") from None
    except RecursionError:
        raise ValueError(f"{what} {path} nests too deeply to be read (thousands of levels): not a file treespec "
                         "wrote") from None
    if kind is not None and not isinstance(obj, kind):
        expected = {dict: "a JSON object", list: "a JSON list"}.get(kind, kind.__name__)
        raise ValueError(f"{what} {path} must hold {expected}, got {type(obj).__name__}: {str(obj)[:60]}")
    return obj


def read_measurements(path: str | os.PathLike, what: str, from_record: Callable[[dict], object]) -> list:
    """The entries of a ``{"measurements": [record, ...]}`` file (a profile's chain τ, its measured trees), each made
    by ``from_record``; [] without the file; a file of another shape is a ValueError naming it."""
    path = Path(path)
    if not path.is_file():
        return []
    data = read_json(path, what, dict)
    if not isinstance(data.get("measurements"), list):  # was "'measurements'" (a KeyError's text) alone
        raise ValueError(f"{what} {path} must hold {{\"measurements\": [record, ...]}}, got keys {sorted(data)}")
    try:
        return [from_record(m) for m in data["measurements"]]
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{what} {path}: {err}") from None


def load_safetensors(path: str | os.PathLike, what: str = "weights") -> dict:
    """Every tensor of a safetensors file, on the CPU: {name: Tensor}.

    A missing, truncated or corrupt file is a ValueError naming it, and so is a floating-point tensor
    holding NaN or infinity (naming the tensor): no caller should train or decode from such weights."""
    try:
        path = regular_file(path, what)
    except FileNotFoundError as err:
        raise ValueError(str(err)) from None
    try:
        tensors = load_file(path, device="cpu")
    except (SafetensorError, OSError, RuntimeError) as err:
        raise ValueError(
            f"{what} {path} cannot be read as safetensors ({err}); the file is truncated or corrupt"
        ) from None
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{what} {path}: tensor {name!r} holds non-finite values (NaN or inf)")
    return tensors


def index_shards(path: str | os.PathLike, what: str = "weight index") -> list[str]:
    """The shard files a ``*.index.json`` lists (its ``weight_map`` values), sorted: paths relative to the index's
    folder, inside it (``../x`` or an absolute path is refused, so an index cannot make a loader read elsewhere)."""
    path = Path(path)
    index = read_json(path, what, dict)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{what} {path} has no weight_map")
    names = sorted(set(map(str, weight_map.values())))
    outside = [n for n in names if Path(n).is_absolute() or ".." in Path(n).parts]
    if outside:
        raise ValueError(f"{what} {path} names shards outside its folder ({', '.join(outside)}): shard paths must be "
                         "file names inside the folder")
    return names


def check_float_weights(weights: dict, module: torch.nn.Module, where: str) -> None:
    """Refuse integer or boolean tensors for ``module``'s floating-point parameters and buffers (load_state_dict
    would cast them silently: an int32 weight file is not trained weights). ``where`` names the file."""
    expected = module.state_dict()
    bad = [f"{name} ({t.dtype})" for name, t in weights.items()
           if name in expected and expected[name].is_floating_point() and not t.is_floating_point()]
    if bad:
        raise ValueError(f"{where}: {', '.join(bad[:3])} should hold floating-point weights; integer or boolean "
                         "tensors are not trained weights (a corrupt or wrongly converted file?)")


def load_checked_weights(module: torch.nn.Module, weights: dict, where: str) -> None:
    """``module.load_state_dict(weights)`` (copied into the module's device and dtype) after
    ``check_float_weights``; missing, unexpected or mis-shaped tensors are a ValueError naming ``where``."""
    check_float_weights(weights, module, where)
    try:
        module.load_state_dict(weights)
    except RuntimeError as err:
        raise ValueError(f"{where} do not fit the drafter: {err}") from None


def weights_digest(module) -> str:
    """sha1 over every parameter and buffer of ``module`` (name, dtype, shape and bytes), in name order:
    equal digests mean equal weights, so a cache keyed by it is never served for other weights."""
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    h = hashlib.sha1()
    for name in sorted(named):
        t = named[name].detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        flat = t.to("cpu").contiguous().reshape(-1)
        if flat.numel():
            h.update(flat.view(torch.uint8).numpy().data)
    return h.hexdigest()


def file_digest(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """sha1 of a file's bytes."""
    h = hashlib.sha1()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
