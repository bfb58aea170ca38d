"""Files, safely: written so that a crash never leaves half of one (write a temporary file beside the
target, flush it, rename it over the target: atomic on POSIX and Windows); read so that a missing,
truncated or corrupt file is an error naming it (JSON, safetensors; never pickle); and digests of
weights and files, so caches are keyed by content."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_path)`` to produce the file, then move it to ``path`` in one step. Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
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


def read_json(path: str | os.PathLike, what: str = "file") -> dict:
    """A JSON file's contents; a missing, unreadable or malformed file is a ValueError naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{what} {path} is not valid JSON ({err}); the file is truncated or corrupt") from None


def load_safetensors(path: str | os.PathLike, what: str = "weights") -> dict:
    """Every tensor of a safetensors file, on the CPU: {name: Tensor}.

    A missing, truncated or corrupt file is a ValueError naming it, and so is a floating-point tensor
    holding NaN or infinity (naming the tensor): no caller should train or decode from such weights."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} {path} does not exist")
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
