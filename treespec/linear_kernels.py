"""The kernel a model's linear layers run on a CPU: torch's (MKL, through ``F.linear``), oneDNN's, the few-row
kernel built from both, or the native kernel compiled on this machine.

Decoding a small model on a CPU is a stream of few-token matrix products against weights read from memory once
per pass. torch's CPU wheel sends ``F.linear`` to MKL, which on AMD CPUs reads a large projection well below the
memory's bandwidth and erratically at 2-4 tokens; oneDNN, which torch also ships, picks its kernels by the CPU's
own features (AVX-512 where there is one) and read the same weights faster at every size measured
(docs/results.md, "A tree pass on CPU"; ``scripts/cpu_kernels.py`` measures a CPU).

``use_linear_kernel(model, "onednn")`` gives every ``nn.Linear`` of ``model`` a forward through oneDNN's
``mkldnn::_linear_pointwise`` (the op torch's own CPU compiler fuses linear layers into), in place: no module is
replaced and no model file is forked, as attention kernels are chosen by ``attn_implementation``. A call that
needs gradients, a tensor off the CPU or a dtype other than float32 takes ``F.linear`` as before, so training
and GPUs are untouched. ``"torch"`` puts the modules' own forward back.

``"fewrow"`` takes, by the number of rows in a call, the path that reads the weights fastest on a CPU (measured per
shape and row count: docs/results.md, "A tree pass on CPU"). oneDNN's plain kernel reads a large weight well below
the memory's bandwidth, and slower still at 2-8 rows than at one. MKL's gemm with the weight as the long side,
``W @ xᵀ`` ([out, in] × [in, n]), reads it near the bandwidth for one or two rows (one row is sent as two: MKL's
one-row path is its slow gemv), and oneDNN's kernel on a weight reordered once into its blocked layout
(``mkldnn._reorder_linear_weight``) from 3 rows on. So a layer keeps a reordered copy beside its weight, **twice the
linear layers' memory**, re-made when the weight changes (its version counter), and takes the first path up to
``MKL_ROWS`` rows, the second above.

``"native"`` sends calls of up to 16 float32 rows whose width is a multiple of 8 to treespec's own AVX2 kernel
(treespec/native_linear.py: compiled on first use, each weight row streamed once against up to six input rows held in
registers, at a fixed cost per call near ``F.linear``'s), and every other call down the few-row path (prefill, more
rows, other widths: the reordered copy stays); what it does to SmolLM2's passes: docs/results.md, "A tree pass on
CPU".

``"packed"`` (AVX-512 CPUs) sends every float32 call, whatever its rows and width, to treespec's packed kernel
(treespec/native_linear.py, treespec/packed_linear.c): the layer keeps its weight packed once into panels of 16
output rows beside it (**twice the linear layers' memory**, as the reordered copy, which it never makes), and up to 16
rows multiply each panel while it streams from memory. On SmolLM2 it made one-token and 16-token passes cheaper than
any other kernel here (docs/results.md, "A tree pass on CPU"). A gated MLP whose gate and up products run it
(``fusable_mlp``) gets a forward that computes both and the SiLU in one call (``_gated_mlp_forward``): the module's
forward is replaced in place as a linear layer's is, and put back with any other kernel.

``"auto"`` is ``"packed"`` where it builds (and torch has oneDNN), else ``"native"`` where it builds, else
``"fewrow"`` where torch has oneDNN, for layers of at least ``AUTO_MIN_WEIGHTS`` weights: a oneDNN or ctypes call
has a fixed cost above ``F.linear``'s, several times a tiny layer's whole time and nothing beside a memory-bound
read of a large one. Every layer of the reference target and SmolLM2 is above it; a tiny test model's are below.
``treespec.reference.load_model`` applies ``DEFAULT`` ("auto"; ``linear_kernel="torch"`` there switches it off,
``"native"`` or ``"fewrow"`` leave the packed kernel out, ``"onednn"`` keeps the plain oneDNN kernel and the
memory). Inside a compiled graph (``compile=True``) the packed, few-row and native kernels are oneDNN's plain one:
a held copy, its version check and a ctypes call are not something a graph can hold.

Results differ from MKL's in the last bits (summation order), as any two BLAS do; greedy decoding stays equal
to transformers' on the same loaded model, since both then run the same kernel.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn
from transformers import activations as transformers_activations

from treespec import native_linear

KERNELS = ("auto", "packed", "native", "fewrow", "onednn", "torch")
DEFAULT = "auto"  # the loader's (module docstring)
# "auto" keeps torch's kernel below this many weights (256 x 256): where the two kernels' times per token met
# (results/linear_kernels/*.json, products_ms; docs/usage.md, "CPU kernels for few-token passes")
AUTO_MIN_WEIGHTS = 1 << 16
# "auto" keeps layers above this many weights (64 MB: a vocabulary projection) on "fewrow", not "native": MKL streamed
# SmolLM2's 49,152 x 576 head faster at one row and oneDNN at 16 (results/linear_kernels/2026-12-04-native/); every
# other layer measured was as fast or faster native
AUTO_NATIVE_MAX_WEIGHTS = 1 << 24
#: "fewrow" sends products over at most this many rows through MKL's gemm as W @ xᵀ, more through reordered oneDNN
MKL_ROWS = 2


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's linear op (CPU builds since torch 2.0 do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _takes_f_linear(layer: nn.Linear, x: torch.Tensor) -> bool:
    """Whether a call stays on ``F.linear``: it needs gradients, or a tensor is off the CPU or not float32."""
    weight = layer.weight
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return (x.device.type != "cpu" or weight.device.type != "cpu" or x.dtype != torch.float32
            or weight.dtype != torch.float32 or needs_grad)


def _onednn_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward through oneDNN where that applies (module docstring), else ``F.linear``."""
    if _takes_f_linear(self, x):
        return F.linear(x, self.weight, self.bias)
    return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def _fewrow_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward through the few-row kernel (module docstring), else ``F.linear``."""
    # F.linear where that applies, and inside a compiled static pass (treespec/static_pass.py) oneDNN's plain op,
    # which a graph can hold
    if _takes_f_linear(self, x) or torch.compiler.is_compiling():
        return _onednn_forward(self, x)
    weight = self.weight
    rows = x.numel() // x.shape[-1]
    if rows <= MKL_ROWS:
        flat = x.reshape(rows, x.shape[-1]).contiguous()  # [n, in]: rows whose features are adjacent, as MKL wants
        if rows == 1:  # MKL's one-row product is its slow gemv: two rows stream the weight at full speed
            flat = torch.cat([flat, flat])
        # [out, n] → [n, out], made contiguous: a transposed output fed on (the MLP's gate into its down projection)
        # sent the next product down MKL's slow path
        out = torch.mm(weight, flat.T).T[:rows].contiguous()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], weight.shape[0])
    return blocked_linear(x, reordered_weight(self), self.bias)


def _native_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward through the native kernel for the calls it takes (module docstring), else the few-row
    kernel's path."""
    # gradients first: the cheapest test, and training never reaches the kernel
    weight, bias = self.weight, self.bias
    if torch.is_grad_enabled() or not native_linear.takes(x, weight, bias) or torch.compiler.is_compiling():
        return _fewrow_forward(self, x)
    return native_linear.linear(x, weight, bias)


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward through the packed kernel (module docstring), else oneDNN's or ``F.linear``."""
    bias = self.bias
    if _takes_f_linear(self, x) or torch.compiler.is_compiling() or (bias is not None and bias.dtype != torch.float32):
        return _onednn_forward(self, x)
    return native_linear.packed_linear(x, packed_weight(self), self.weight.shape[0],
                                       None if bias is None else bias.contiguous())


def _gated_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A gated MLP's forward (``down_proj(silu(gate_proj(x)) * up_proj(x))``, ``fusable_mlp``) with the gate and up
    products and the SiLU in one packed call (``native_linear.packed_gated``): the two products' outputs are never
    written out and read back, and two element-wise ops and a call go (what that saves: docs/results.md, "A tree
    pass on CPU"). Any call the packed kernel would not take runs the module's own forward."""
    gate, up = self.gate_proj, self.up_proj
    if (_takes_f_linear(gate, x) or _takes_f_linear(up, x) or torch.compiler.is_compiling()
            or not (_forward_of(gate) is _packed_forward is _forward_of(up))):  # one moved to another kernel since
        return type(self).forward(self, x)
    hidden = native_linear.packed_gated(x, packed_weight(gate), packed_weight(up), gate.weight.shape[0])
    return self.down_proj(hidden)


# SiLU modules: torch's, and transformers' own ("silu" in ACT2FN; older releases gave nn.SiLU)
SILU = (nn.SiLU, *(cls for cls in [getattr(transformers_activations, "SiLUActivation", None)] if cls is not None))


def fusable_mlp(module: nn.Module) -> bool:
    """Whether ``module`` is a gated MLP the packed kernel can fuse: bias-free ``gate_proj`` and ``up_proj`` of one
    shape, a ``down_proj``, and SiLU as ``act_fn`` (Llama's, Mistral's, Qwen's, OLMo's MLPs and their drafters')."""
    gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
    down, act = getattr(module, "down_proj", None), getattr(module, "act_fn", None)
    return (isinstance(gate, nn.Linear) and isinstance(up, nn.Linear) and isinstance(down, nn.Linear)
            and isinstance(act, SILU) and gate.bias is None and up.bias is None
            and gate.weight.shape == up.weight.shape)


def reorder_weight(weight: torch.Tensor) -> torch.Tensor:
    """A float32 CPU weight [out, in] in oneDNN's blocked layout (an opaque tensor for ``blocked_linear``)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 8)


def blocked_linear(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] through a ``reorder_weight`` weight → [..., out], as ``F.linear`` (float32, CPU, no gradients)."""
    return torch.ops.mkldnn._linear_pointwise(x, blocked, bias, "none", [], "")


def reordered_weight(layer: nn.Module) -> torch.Tensor:
    """The ``weight`` of ``layer`` (an nn.Linear, or any module holding a float32 CPU ``weight`` [out, in]) in oneDNN's
    blocked layout, made on first use and again whenever the weight was replaced or changed in place
    (``load_state_dict`` copies into it: its version counter moves). Held beside the layer, not in it: an opaque
    oneDNN tensor cannot be deep-copied or saved, and a copy of the layer makes its own on first use."""
    return _held_copy(layer, _REORDERED, reorder_weight)


def packed_weight(layer: nn.Module) -> torch.Tensor:
    """The ``weight`` of ``layer`` packed for the packed kernel ([⌈out / 16⌉, in, 16]: ``native_linear.pack``), held
    and remade as ``reordered_weight``'s copy is."""
    return _held_copy(layer, _PACKED, native_linear.pack)


def few_row_linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] (float32, CPU, no gradients) through ``layer``'s weight on the copy it already holds, packed or
    reordered; where it holds none, the packed kernel where built, else oneDNN's blocked one (a drafter's vocabulary
    projection sharing a target's head: heads/drafting/lean.py)."""
    if layer in _PACKED or (layer not in _REORDERED and native_linear.packed_available()):
        return native_linear.packed_linear(x, packed_weight(layer), layer.weight.shape[0], bias)
    return blocked_linear(x, reordered_weight(layer), bias)


def _held_copy(layer: nn.Module, held_copies: weakref.WeakKeyDictionary, make) -> torch.Tensor:
    weight = layer.weight
    held = held_copies.get(layer)
    if held is None or held[0] is not weight or held[1] != weight._version:
        with torch.no_grad():
            held = (weight, weight._version, make(weight))
        held_copies[layer] = held
    return held[2]


#: each few-row layer's (or lean projection's) reordered weight, and each packed layer's packed one: (the weight it
#: was made from, its version then, the copy)
_REORDERED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_kernel(kernel) -> None:
    """Refuse a ``linear_kernel`` that is none of ``KERNELS`` (the loader calls it before any weight is read)."""
    if kernel not in KERNELS:
        raise ValueError(f"linear_kernel must be one of {KERNELS}, got {kernel!r}")


def use_linear_kernel(model: nn.Module, kernel: str = DEFAULT) -> int:
    """Run every ``nn.Linear`` in ``model`` through ``kernel`` (``KERNELS``); returns how many modules it set.
    "auto" is "packed" where it builds, else "native" where it builds, else "fewrow", where this torch has oneDNN, for
    layers of at least ``AUTO_MIN_WEIGHTS`` weights ("native": above ``AUTO_NATIVE_MAX_WEIGHTS``, "fewrow"), else
    "torch"; a oneDNN kernel on a torch without one, or "packed" or "native" where it does not build, is an error
    naming the way back."""
    check_kernel(kernel)
    if not isinstance(model, nn.Module):
        raise TypeError(f"use_linear_kernel sets a torch module's linear layers, got {type(model).__name__}")
    min_weights, max_native = 0, None
    if kernel == "auto":
        kernel, min_weights = ((auto_kernel(), AUTO_MIN_WEIGHTS) if onednn_available() else ("torch", 0))
        max_native = AUTO_NATIVE_MAX_WEIGHTS
    if kernel in FORWARDS and not onednn_available():
        raise ValueError(f"linear_kernel={kernel!r} needs a torch built with oneDNN (torch.backends.mkldnn); this "
                         "one has none: use linear_kernel='torch'")
    if kernel == "native" and not native_linear.available():
        raise ValueError(f"linear_kernel='native' is not available here: {native_linear.why_unavailable()}; use "
                         "linear_kernel='fewrow'")
    if kernel == "packed" and not native_linear.packed_available():
        why = native_linear.why_unavailable() or "this CPU has no AVX-512"
        raise ValueError(f"linear_kernel='packed' is not available here: {why}; use linear_kernel='native' or 'fewrow'")
    count = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        size = module.weight.numel()
        own = kernel if kernel in FORWARDS and size >= min_weights else "torch"
        if own == "native" and max_native is not None and size > max_native:
            own = "fewrow"
        # a held copy frees its memory, kept by the kernels that use it (checked against the weight)
        if own not in ("fewrow", "native"):
            _REORDERED.pop(module, None)
        if own != "packed":
            _PACKED.pop(module, None)
        if own in FORWARDS:
            module.forward = FORWARDS[own].__get__(module)  # an instance attribute: the class stays stock
        else:
            module.__dict__.pop("forward", None)
        count += 1
    for module in model.modules():  # gated MLPs whose gate and up products went to the packed kernel
        if fusable_mlp(module) and _forward_of(module.gate_proj) is _packed_forward is _forward_of(module.up_proj):
            module.forward = _gated_mlp_forward.__get__(module)
        elif _forward_of(module) is _gated_mlp_forward:
            module.__dict__.pop("forward", None)
    return count


def _forward_of(module: nn.Module):
    """The kernel forward set on ``module`` (its function), or None where it runs its class's."""
    return getattr(module.__dict__.get("forward"), "__func__", None)


def auto_kernel() -> str:
    """What "auto" gives a large layer on this machine with oneDNN: "packed", "native" or "fewrow"."""
    return "packed" if native_linear.packed_available() else "native" if native_linear.available() else "fewrow"


def follow_target_kernel(module, target) -> None:
    """Give a drafter ``module`` loaded for ``target`` the linear kernel ``target`` runs ("auto" where the target's
    layers are mixed, as "auto" leaves them); nothing where the target runs torch's own or ``module`` is no torch
    module. A draft depth is the same few-row products as a tree pass (what that saves: docs/usage.md, "CPU
    kernels")."""
    kernel = linear_kernel_of(target) if isinstance(target, nn.Module) else None
    if isinstance(module, nn.Module) and kernel not in (None, "torch"):
        use_linear_kernel(module, "auto" if kernel == "mixed" else kernel)


def path_changes(model) -> set[int]:
    """The row counts after which some linear layer of ``model`` changes path (the few-row kernel after ``MKL_ROWS``,
    the native one after its ``MAX_ROWS`` or ``LARGE_ROWS``): a pass's cost can jump there, so a cost curve measures
    both sides of each rather than interpolating across (treespec/planning/autotree.py, ``measure_cost_curve``)."""
    rows = set()
    for module in model.modules() if isinstance(model, nn.Module) else ():
        forward = _forward_of(module) if isinstance(module, nn.Linear) else None
        if forward is _fewrow_forward:
            rows.add(MKL_ROWS)
        elif forward is _packed_forward:
            rows.add(native_linear.PANEL)  # a 17th row starts a second group over each panel
        elif forward is _native_forward:
            rows.add(native_linear.MAX_ROWS if module.weight.numel() < native_linear.LARGE_WEIGHTS
                     else native_linear.LARGE_ROWS)
    return rows


def linear_kernel_of(model: nn.Module) -> str | None:
    """The kernel ``model``'s linear layers run ("native", "fewrow", "onednn", "torch"), "mixed", or None where it has
    none."""
    by_forward = {f: name for name, f in FORWARDS.items()}
    kinds = {by_forward.get(_forward_of(m), "torch")
             for m in model.modules() if isinstance(m, nn.Linear)}
    return None if not kinds else kinds.pop() if len(kinds) == 1 else "mixed"


# the kernels that replace a layer's forward
FORWARDS = {"packed": _packed_forward, "native": _native_forward, "fewrow": _fewrow_forward, "onednn": _onednn_forward}
