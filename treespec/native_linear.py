"""Few-row linear kernels compiled on this machine: ``treespec/skinny_linear.c`` for the "native" CPU kernel of
treespec/linear_kernels.py, and ``treespec/packed_linear.c`` for its "packed" one on AVX-512 CPUs.

A decoding or tree pass of a small model on a CPU multiplies 1-16 rows by each weight, and the weights come from
memory once per pass. torch's BLAS kernels are built for large products: MKL reads a weight near the memory's
bandwidth for one or two rows only, and oneDNN's reordered kernel has a per-call cost several times a small layer's
read from L2 (docs/results.md, "A tree pass on CPU"). The C kernel streams each weight row once and multiplies it
against up to six input rows held in AVX2 registers, so that a pass over 3-8 tokens costs little more than a
one-token one (measured on SmolLM2-135M: docs/results.md, "A tree pass on CPU").

It is compiled on first use with the system's C compiler (``$CC``, else ``gcc``, else ``cc``) for this CPU
(``-march=native``, OpenMP: the threads torch uses), into treespec's cache folder, keyed by the source, the
compiler and the CPU, and loaded with ctypes: no torch headers to compile. Where there is no
compiler, no AVX2 and FMA, or the build fails, ``available()`` is False, ``why_unavailable()`` says why, and the
"auto" kernel takes the few-row one instead. It needs float32 rows whose width is a multiple of 8.

The packed kernel (``packed_available``, ``pack``, ``packed_linear``) is built into the same library where the CPU
has AVX-512. Its weight is packed once into panels of 16 output rows, k-major, so that each weight is read in one
sequential stream per call while up to 16 input rows multiply it from registers: the two kernels above read a
weight once per call too, but do the arithmetic of a tree pass after the read rather than under it (a 16-token pass
of SmolLM2 cost about its memory time plus its arithmetic: results/notes/2026-12-05-tree-pass-breakdown.md). It
takes any width, any number of rows (more than 16 in groups of 16) and gives each row the same bits whatever the
rows beside it. What it does to SmolLM2's passes: docs/results.md, "A tree pass on CPU".
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

from treespec.gguf_models import cache_root

SOURCES = tuple(Path(__file__).with_name(name) for name in ("skinny_linear.c", "packed_linear.c",
                                                             "few_query_attention.c"))
HEADERS = (Path(__file__).with_name("vector_exp.h"),)  # included by the sources: part of the build's key
#: the most rows a call takes; more go to the caller's other kernel (the C kernel re-reads each weight block from L1
#: once per six rows, and past 16 rows oneDNN's blocked kernel is faster: docs/results.md)
MAX_ROWS = 16
#: ... and for weights of at least ``LARGE_WEIGHTS``: the few-row kernel was faster for SmolLM2's MLP products
#: (576 x 1536 both ways) at 12-16 rows, the native one for its attention products (results/linear_kernels/)
LARGE_ROWS, LARGE_WEIGHTS = 8, 1 << 19
FLAGS = ("-O3", "-march=native", "-funroll-loops", "-fopenmp", "-fPIC", "-shared")

_state: dict = {}  # "lib": the loaded library, or "why": why there is none (built or refused once per process)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build() -> ctypes.CDLL:
    """Compile (once per source, compiler and CPU) and load the library; RuntimeError naming what is missing."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"the native kernel is AVX2 code; this CPU is {platform.machine()}")
    flags = _cpu_flags()
    if not {"avx2", "fma"} <= flags:
        raise RuntimeError("the native kernel needs AVX2 and FMA, which /proc/cpuinfo does not list")
    compiler = next((path for name in (os.environ.get("CC"), "gcc", "cc") if name and (path := shutil.which(name))),
                    None)
    if compiler is None:
        raise RuntimeError("no C compiler found ($CC, gcc or cc) to build the native kernel")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\n".join([*(f.read_text() for f in (*SOURCES, *HEADERS)), compiler, version, " ".join(FLAGS),
                                    " ".join(sorted(flags))]).encode()).hexdigest()[:16]
    path = cache_root() / "native" / f"skinny_linear-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # then renamed: another process never loads half
        done = subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", str(tmp)], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"building the native kernel failed ({compiler}): {done.stderr.strip()[-500:]}")
        os.replace(tmp, path)
    lib = ctypes.CDLL(str(path))  # its OpenMP is the libgomp torch already loaded (one soname, one thread pool)
    lib.skinny_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.skinny_linear.restype = None
    lib.packed_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.packed_linear.restype = ctypes.c_int
    lib.packed_gated.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.packed_gated.restype = ctypes.c_int
    lib.packed_linear_built.restype = ctypes.c_int
    P, L = ctypes.c_void_p, ctypes.c_long  # few_query_attention: its wrapper is treespec/gqa_attention.py's
    lib.few_query_attention.argtypes = [P, L, L, L, P, L, L, L, P, L, L, L, P, L, P, *[L] * 6, ctypes.c_float,
                                        ctypes.c_int]
    lib.few_query_attention.restype = ctypes.c_int
    lib.few_query_attention_built.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded native library (built once per process on first use), or None where it cannot build
    (``why_unavailable``)."""
    if not _state:
        try:
            _state["lib"] = _build()
        except (RuntimeError, OSError, subprocess.SubprocessError) as err:
            _state["why"] = str(err)
    return _state.get("lib")


def available() -> bool:
    """Whether the native kernel is built (or builds now) and loads on this machine."""
    return library() is not None


def why_unavailable() -> str | None:
    """Why the native kernel is not available here, or None when it is."""
    library()
    return _state.get("why")


def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``x`` [..., K] @ ``weight`` [O, K]ᵀ is one the kernel computes: float32 on a CPU, at most
    ``MAX_ROWS`` rows (``LARGE_ROWS`` for a weight of ``LARGE_WEIGHTS`` or more), K a multiple of 8, a contiguous
    weight and bias. (Gradients are the caller's to refuse.) Written for speed: a decoding pass makes hundreds of
    these calls, and each microsecond here is one of them."""
    k = x.shape[-1]
    rows = MAX_ROWS if weight.numel() < LARGE_WEIGHTS else LARGE_ROWS
    return (x.dtype is torch.float32 and weight.dtype is torch.float32 and x.is_cpu and weight.is_cpu
            and k % 8 == 0 and x.numel() <= rows * k and weight.shape[1] == k and weight.is_contiguous()
            and (bias is None or (bias.dtype is torch.float32 and bias.is_contiguous())))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the C kernel, for calls ``takes`` accepts: x [..., K] → [..., O]."""
    kernel = _state.get("fn") or _function()
    k, out_features = x.shape[-1], weight.shape[0]
    if not x.is_contiguous():
        x = x.contiguous()  # [..., K] with adjacent rows, as the kernel reads them
    y = torch.empty(*x.shape[:-1], out_features)  # [..., O] (float32 on the CPU, as x; a third of new_empty's cost)
    kernel(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(), x.numel() // k, k,
           out_features, torch.get_num_threads())
    return y


def _function():
    lib = library()
    if lib is None:
        raise RuntimeError(f"the native kernel is not available: {why_unavailable()}")
    _state["fn"] = lib.skinny_linear
    return _state["fn"]


#: output rows per panel of a packed weight (``PANEL`` in treespec/packed_linear.c)
PANEL = 16


def packed_available() -> bool:
    """Whether the packed kernel is built here: the native library builds and the CPU has AVX-512."""
    if "packed_built" not in _state:
        lib = library()
        _state["packed_built"] = lib is not None and bool(lib.packed_linear_built())
    return _state["packed_built"]


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight [O, K] → its panels [⌈O / 16⌉, K, 16] for ``packed_linear`` (zero rows past O)."""
    out_features, k = weight.shape
    panels = -(-out_features // PANEL)
    padded = weight.detach().new_zeros(panels * PANEL, k)
    padded[:out_features] = weight.detach()
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()  # [P, K, 16]


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``packed = pack(weight)``: x [..., K] float32 on the CPU → [..., O]."""
    return _packed_call("packed", x, packed, bias, out_features)


def packed_gated(x: torch.Tensor, packed_gate: torch.Tensor, packed_up: torch.Tensor,
                 out_features: int) -> torch.Tensor:
    """A gated MLP's hidden rows ``silu(x · gateᵀ) · (x · upᵀ)`` in one call, for ``packed_gate = pack(gate)`` and
    ``packed_up = pack(up)`` (no biases): x [..., K] float32 on the CPU → [..., O]. Each thread computes a panel's
    gate and up products and multiplies them in registers, so neither is written out and read back."""
    return _packed_call("gated", x, packed_gate, packed_up, out_features)


def _packed_call(entry: str, x: torch.Tensor, packed: torch.Tensor, third: torch.Tensor | None,
                 out_features: int) -> torch.Tensor:
    """One call of the packed library's ``entry``: (x, panels, ``third`` (a bias, or the up product's panels), y, rows,
    width, outputs, threads)."""
    kernel = _state.get(entry) or _packed_function(entry)
    k = x.shape[-1]
    if not x.is_contiguous():
        x = x.contiguous()
    y = torch.empty(*x.shape[:-1], out_features)  # [..., O]
    if y.numel() == 0:
        return y
    if kernel(x.data_ptr(), packed.data_ptr(), 0 if third is None else third.data_ptr(), y.data_ptr(),
              x.numel() // k, k, out_features, torch.get_num_threads()):
        raise RuntimeError("the packed kernel could not allocate its copy of the input rows (out of memory)")
    return y


def _packed_function(entry: str = "packed"):
    if not packed_available():
        raise RuntimeError(f"the packed kernel is not available: {why_unavailable() or 'this CPU has no AVX-512'}")
    _state[entry] = getattr(_state["lib"], {"packed": "packed_linear", "gated": "packed_gated"}[entry])
    return _state[entry]
