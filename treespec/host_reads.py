"""Counting host reads: every call that brings a tensor's values to the host (``tolist``, ``item``, ``int(t)``,
``bool(t)``, ``.cpu()``, ``nonzero``, boolean-mask indexing, ...). On an accelerator each one waits until the
device's queue drains, so a decoding step should make one: the accepted tokens (docs/design.md, "Host reads per
step"). This module counts them on any machine, the CPU included, so a test can hold the number down.

On a CPU every tensor is on the host, so "would this read wait for a device?" is answered by provenance: a
tensor is *on the device* when it derives from the models' parameters and buffers, from the caller's inputs, or
from a factory or ``.to`` given a device; results of any op with such an input are on the device too, and
``.cpu()`` brings one back (that call is the read). Tensors built from host data (a tree's parents, a list of
kept slots) are host tensors: reading them costs no wait. ``HostReads`` counts both kinds:

    with HostReads(target, drafter) as reads:
        generate(target, ids, drafter=drafter, max_new_tokens=48)
    reads.device     # reads of tensors on the device: waits on an accelerator
    reads.all        # every read, host tensors included (the engine's host bookkeeping)
    reads.uploads    # host data copied to the device (torch.tensor(..., device=d), .to(d)): in PyTorch a
    #                  blocking copy from pageable memory waits for the queue too, unless pinned + non_blocking
    reads.sites      # Counter of (file:line, call) of the device reads: where they come from
    reads.ops        # with HostReads(..., ops=True): Counter of torch calls by the file making them (the engine's
    #                  own tensor work per step, beside the models': each is a kernel launch on an accelerator)

``.numpy()`` is counted in ``all`` but never as a device read: it fails on an accelerator's tensor, so code that
runs there only takes it on host tensors (``treespec.sampling.argmax``'s CPU path keeps its result beside the
logits, so what it returns stays a device tensor).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from treespec.drafter import Drafter

_MARK = "_treespec_on_device"
_T = torch.Tensor
# value reads: each hands a tensor's contents (or a value-dependent shape) to the host
_READS = {_T.tolist, _T.item, _T.__bool__, _T.__int__, _T.__float__, _T.__index__, _T.cpu, _T.nonzero, torch.nonzero,
          _T.argwhere, torch.argwhere, _T.masked_select, torch.masked_select, _T.unique, torch.unique,
          torch.unique_consecutive, torch.equal, _T.equal, _T.numpy, _T.__contains__}
_FACTORIES_WITH_DATA = {torch.tensor, torch.as_tensor}
_HERE = str(Path(__file__).resolve())
_TORCH = str(Path(torch.__file__).resolve().parent)


def on_device(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _MARK, False)


def _mark(values) -> None:
    for t in tree_leaves(values):
        if isinstance(t, torch.Tensor):
            try:
                setattr(t, _MARK, True)
            except (AttributeError, RuntimeError):  # some tensor subclasses take no attributes
                pass


def _bool_index(args) -> bool:
    """Boolean-mask indexing (x[mask], x[mask] = v): the result's size, or the write's, depends on the mask."""
    index = args[1] if len(args) > 1 else None
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in tree_leaves(index))


def _device_arg(func, args, kwargs) -> bool:
    """Whether the call names a device for its result (a factory's device=, .to(device), .cuda())."""
    if kwargs.get("device") is not None:
        return True
    if func in (_T.to, _T.cuda):
        return func is _T.cuda or any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args[1:])
    return False


class HostReads(TorchFunctionMode):
    """A TorchFunctionMode counting host reads (see the module's docstring); ``modules`` (the target, a drafter or
    anything holding nn.Modules in its attributes) and ``inputs`` are what lives on the device at the start."""

    def __init__(self, *modules, inputs=(), ops: bool = False):
        super().__init__()
        self.device = 0
        self.all = 0
        self.uploads = 0
        self.sites: Counter = Counter()
        self.ops: Counter | None = Counter() if ops else None
        self._roots = [t for m in modules for t in _tensors_of(m)] + [t for t in tree_leaves(inputs)
                                                                        if isinstance(t, torch.Tensor)]

    def __enter__(self):
        _mark(self._roots)
        return super().__enter__()

    def __exit__(self, *exc):
        for t in self._roots:
            if getattr(t, _MARK, False):
                delattr(t, _MARK)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.ops is not None and getattr(func, "__name__", "") != "__get__":  # attribute reads aside
            self.ops[_caller().split(":")[0]] += 1
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        from_device = any(on_device(t) for t in tensors)
        read = func in _READS or (func in (_T.__getitem__, _T.__setitem__) and _bool_index(args))
        if read:
            self.all += 1
            if from_device and func is not _T.numpy:
                self.device += 1
                self.sites[(_caller(), getattr(func, "__name__", str(func)))] += 1
        result = func(*args, **kwargs)
        if func is _T.cpu:  # a host copy: reading it later waits for nothing (on a CPU, a new object for it)
            return result.view_as(result) if result is args[0] else result
        to_device = _device_arg(func, args, kwargs)
        if to_device and not from_device and (func in _FACTORIES_WITH_DATA or func in (_T.to, _T.cuda)):
            self.uploads += 1
            if result is args[0]:  # already there (on a CPU): the host tensor stays a host tensor, its copy is not
                result = result.view_as(result)
        if from_device or to_device:
            _mark(result)
            if func is _T.__setitem__ or getattr(func, "__name__", "").endswith("_"):  # written in place
                _mark(args[0])
        return result


def _tensors_of(obj) -> list[torch.Tensor]:
    """The parameters and buffers of ``obj`` if it is an nn.Module, else of the nn.Modules among its attributes
    (one level down, in lists too: a drafter's model, heads and projections), and of the drafters among them (a
    Combined's)."""
    if isinstance(obj, torch.nn.Module):
        return [*obj.parameters(), *obj.buffers()]
    values = vars(obj).values() if hasattr(obj, "__dict__") else ()
    found = [m for v in values for m in (v if isinstance(v, (list, tuple)) else [v])]
    modules = [m for m in found if isinstance(m, torch.nn.Module)]
    inner = [t for d in found if isinstance(d, Drafter) and d is not obj for t in _tensors_of(d)]
    return [t for m in modules for t in (*m.parameters(), *m.buffers())] + inner


def _caller() -> str:
    """file:line of the innermost frame outside torch and this module."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name != _HERE and not name.startswith(_TORCH):
            return f"{Path(name).name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def reads_per_step(target, input_ids, *, drafter=None, max_new_tokens: int = 48, ops: bool = False,
                   **options) -> dict:
    """Host reads per decoding step of ``generate(target, input_ids, drafter=drafter, ...)``: the reads of a run of
    ``max_new_tokens`` less those of a run of one token (prefill, retiring, outputs: no step), over the run's
    verification passes → {"device", "all", "uploads": per step; "passes"; "sites": the device reads' call sites;
    with ``ops``, "ops": torch calls per step by the file making them}."""
    from treespec.generate import decode

    counts = []
    for new_tokens in (1, max_new_tokens):
        with HostReads(target, drafter, inputs=input_ids, ops=ops) as reads:
            out = decode(target, input_ids, drafter=drafter, max_new_tokens=new_tokens, **options)
        counts.append(reads)
    once, run = counts
    passes = max(out.passes, 1)
    found = {"device": (run.device - once.device) / passes, "all": (run.all - once.all) / passes,
             "uploads": (run.uploads - once.uploads) / passes, "passes": out.passes, "sites": run.sites - once.sites}
    if ops:
        found["ops"] = {name: (n - once.ops[name]) / passes for name, n in run.ops.items() if n > once.ops[name]}
    return found
