"""The kernel a model's linear layers run on a CPU: torch's (MKL, through ``F.linear``) or oneDNN's.

Decoding a small model on a CPU is a stream of few-token matrix products against weights read from memory once
per pass. torch's CPU wheel sends ``F.linear`` to MKL, which on AMD CPUs reads a large projection well below the
memory's bandwidth and erratically at 2-4 tokens; oneDNN, which torch also ships, picks its kernels by the CPU's
own features (AVX-512 where there is one) and read the same weights faster at every size measured
(docs/results.md, "A tree pass on CPU"; ``scripts/cpu_kernels.py`` measures a CPU).

``use_linear_kernel(model, "onednn")`` gives every ``nn.Linear`` of ``model`` a forward through oneDNN's
``mkldnn::_linear_pointwise`` (the op torch's own CPU compiler fuses linear layers into), in place: no module is
replaced and no model file is forked, as attention kernels are chosen by ``attn_implementation``. A call that
needs gradients, a tensor off the CPU or a dtype other than float32 takes ``F.linear`` as before, so training
and GPUs are untouched. ``"torch"`` puts the modules' own forward back. ``"auto"`` is oneDNN's where torch
has it, for layers of at least ``AUTO_MIN_WEIGHTS`` weights: a oneDNN call has a fixed cost above ``F.linear``'s,
several times a tiny layer's whole time and nothing beside a memory-bound read of a large one. Every layer of the
reference target and SmolLM2 is above it; a tiny test model's are below.
``treespec.reference.load_model`` applies ``DEFAULT`` ("auto"; ``linear_kernel="torch"`` there switches it off).

Results differ from MKL's in the last bits (summation order), as any two BLAS do; greedy decoding stays equal
to transformers' on the same loaded model, since both then run the same kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

KERNELS = ("auto", "onednn", "torch")
DEFAULT = "auto"  # the loader's (module docstring)
# "auto" keeps torch's kernel below this many weights (256 x 256): where the two kernels' times per token met
# (results/linear_kernels/*.json, products_ms; docs/usage.md, "CPU kernels for few-token passes")
AUTO_MIN_WEIGHTS = 1 << 16


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's linear op (CPU builds since torch 2.0 do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _onednn_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward through oneDNN where that applies (module docstring), else ``F.linear``."""
    weight = self.weight
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if (x.device.type != "cpu" or weight.device.type != "cpu" or x.dtype != torch.float32
            or weight.dtype != torch.float32 or needs_grad):
        return F.linear(x, weight, self.bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, self.bias, "none", [], "")


def check_kernel(kernel) -> None:
    """Refuse a ``linear_kernel`` that is none of ``KERNELS`` (the loader calls it before any weight is read)."""
    if kernel not in KERNELS:
        raise ValueError(f"linear_kernel must be one of {KERNELS}, got {kernel!r}")


def use_linear_kernel(model: nn.Module, kernel: str = DEFAULT) -> int:
    """Run every ``nn.Linear`` in ``model`` through ``kernel`` (``KERNELS``); returns how many modules it set.
    "auto" is "onednn" where this torch has it for layers of at least ``AUTO_MIN_WEIGHTS`` weights, else "torch";
    "onednn" on a torch without it is an error naming the way back ("torch")."""
    check_kernel(kernel)
    if not isinstance(model, nn.Module):
        raise TypeError(f"use_linear_kernel sets a torch module's linear layers, got {type(model).__name__}")
    min_weights = 0
    if kernel == "auto":
        kernel, min_weights = ("onednn", AUTO_MIN_WEIGHTS) if onednn_available() else ("torch", 0)
    if kernel == "onednn" and not onednn_available():
        raise ValueError("linear_kernel='onednn' needs a torch built with oneDNN (torch.backends.mkldnn); this one "
                         "has none: use linear_kernel='torch'")
    count = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        if kernel == "onednn" and module.weight.numel() >= min_weights:
            module.forward = _onednn_forward.__get__(module)  # an instance attribute: the class stays stock
        else:
            module.__dict__.pop("forward", None)
        count += 1
    return count


def linear_kernel_of(model: nn.Module) -> str | None:
    """The kernel ``model``'s linear layers run ("onednn", "torch"), "mixed", or None where it has none."""
    kinds = {"onednn" if getattr(m.__dict__.get("forward"), "__func__", None) is _onednn_forward else "torch"
             for m in model.modules() if isinstance(m, nn.Linear)}
    return None if not kinds else kinds.pop() if len(kinds) == 1 else "mixed"
