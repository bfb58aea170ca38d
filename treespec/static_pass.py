"""Compiled, static passes: ``generate(..., compile=True)`` runs the target's tree pass (and a drafter's depth step,
heads/drafting/expansion.py) as a ``torch.compile``d graph with ``fullgraph=True`` and static shapes, compiled once per
shape (rows, tree tokens, cache capacity) and never again after that warm-up.

**What kept a graph from being static.** A forward over transformers' cache reads the cache's length as a
Python int (a ``DynamicLayer`` concatenates, so its keys are [b, h, held, d] with ``held`` growing every step;
``PreallocatedLayer`` hands out views ``buffer[:, :, :held]``), builds its mask over ``held + n`` keys and
takes its positions from ``get_seq_length()``. Dynamo specialises on every such int and guards on the cache
object's attributes, so every step is a new graph; with ``dynamic=True`` it keeps recompiling on the guards of
the cache object until the recompile limit (docs/design.md, "Tried and not shipped"). Here nothing the graph sees
changes shape or value from step to step except tensor contents:

* the cache the model is handed is a ``StaticKV``: each layer's whole preallocated buffer (capacity S, zeros
  where nothing is held: treespec/cache.py), whose ``update`` writes the n new entries at the slots ``write``
  [n], a tensor (``index_copy_``), and returns the whole buffers [b, h, S, d];
* the mask is always explicit, [b, 1, n, S]: the pass's own mask (treespec/visibility.py, [b or 1, 1, n,
  held + n]) copied into a kept buffer whose columns from held + n on are blocked; positions are always explicit,
  [b, n], copied into a kept buffer too;
* the model's own code (or heads/drafting/lean.py's layer loop) runs unchanged: a 4D mask is taken as given,
positions are
  given, so no model code reads the cache's length.

Attention then spans all S slots every pass (the blocked ones weigh exactly 0), which is what static shapes cost;
the capacity is sized once from the prompt, the token budget and the tree, rounded up to a power of two so that
runs of similar lengths share graphs (a batch whose ragged acceptance outgrows it doubles it: one more
compilation). In its last steps a run verifies the whole tree rather than one cut to the tokens left (generate's
``step_tree_of``), so each tree is one shape. Between passes the ``TreeCache`` is what it always is (the layers'
views are set to the held entries after each pass), so the compaction to the accepted path, the drafter's eager
passes over committed tokens and finished rows leaving the batch run as before, on the same buffers.

On a GPU ``compile=True`` means ``mode="reduce-overhead"`` (CUDA graphs, as gpt-fast and the serving engines run
their decode steps): the buffers the graph writes or reads in place are marked static addresses, and the outputs
are cloned (a CUDA graph's outputs are overwritten by its next replay). On a CPU it is inductor's default mode.
``compile={"backend": ..., "mode": ...}`` passes those to ``torch.compile`` instead (``backend="eager"`` traces and
guards exactly as inductor does without generating code: what the tests count compilations with).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

import torch

from treespec.compat import cache_arg
from treespec.drafter import stack_features
from treespec.gqa_attention import NAME as GQA_SDPA
from treespec.layer_types import is_hybrid, sliding_window

#: attention implementations a static pass runs (the float additive mask of treespec/visibility.py)
STATIC_ATTENTION = ("sdpa", "eager", GQA_SDPA)
#: the torch.compile arguments ``generate(compile={...})`` may set (fullgraph and static shapes are fixed)
COMPILE_KEYS = ("backend", "mode", "options")
#: dynamo's limit on the graphs one function keeps (torch's default is 8): one per shape of rows, tree tokens and
#: capacity; a tree run's truncated last steps and a batch's finishing rows each add one
RECOMPILE_LIMIT = 64


def compile_options(compile, target) -> dict | None:
    """``generate``'s ``compile`` argument → torch.compile's keyword arguments, or None for eager passes: True is
    CUDA graphs on a GPU (``mode="reduce-overhead"``), inductor's default elsewhere; a dict is taken as given.
    A target whose passes cannot be static is refused, named."""
    if compile is None or compile is False:
        return None
    if isinstance(compile, Mapping):
        unknown = sorted(set(compile) - set(COMPILE_KEYS))
        if unknown:
            raise ValueError(f"compile={dict(compile)!r}: unknown key(s) {unknown}; it takes torch.compile's "
                             f"{', '.join(COMPILE_KEYS)} (fullgraph=True and static shapes are fixed)")
        options = dict(compile)
    elif compile is True:
        options = {"mode": "reduce-overhead"} if target.device.type == "cuda" else {}
    else:
        raise ValueError(f"compile must be True, False or a dict of torch.compile's {', '.join(COMPILE_KEYS)}, got "
                         f"{compile!r}")
    why = static_refusal(target)
    if why:
        raise ValueError(f"compile=True cannot run {target.config.model_type}'s passes as static graphs: {why}; "
                         "call generate without compile")
    return options


def static_refusal(model) -> str | None:
    """Why ``model``'s cached passes cannot be static graphs here, or None: they need every layer to attend fully
    over a preallocated cache and an attention that takes a float 4D mask."""
    if is_hybrid(model.config):
        return "its recurrent layers are verified path by path (treespec/recurrent.py), not by one masked pass"
    window = sliding_window(model.config)
    if window is not None:
        return f"its sliding-window layers (window {window}) keep a cache of their own length"
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in STATIC_ATTENTION:
        return f"attention {impl!r} does not take the float 4D mask a static pass builds (use 'sdpa' or 'eager')"
    return None


def static_capacity(needed: int) -> int:
    """The slots a static pass's cache holds for ``needed``: the next power of two (at least 256), so that runs of
    similar lengths share their graphs (at most twice the slots attended over)."""
    return max(256, 1 << (needed - 1).bit_length())


@contextlib.contextmanager
def compiled_steps(drafter, options: dict | None, capacity: int):
    """A drafter's depth steps compiled for one generate() call (``Drafter.compile_steps``), eager again after it
    (its calls outside generate, such as timing its depth, run as they always did)."""
    if drafter is None or options is None:
        yield
        return
    drafter.compile_steps(options, capacity)
    try:
        yield
    finally:
        drafter.compile_steps(None, 0)


class StaticKV:
    """The cache a static pass hands the model: per layer its whole buffers, ``(kv,)`` [2, b, h, S, d] or (keys,
    values); ``update`` writes the new entries at slots ``write`` [n] and returns every slot's keys and values."""

    def __init__(self, buffers: list[tuple[torch.Tensor, ...]], write: torch.Tensor):
        self.buffers, self.write = buffers, write

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key_states [b, h, n, d], value_states [b, h, n, d_v] → (keys [b, h, S, d], values [b, h, S, d_v])."""
        buffers = self.buffers[layer_idx]
        if len(buffers) == 1:
            kv = buffers[0]
            kv.index_copy_(3, self.write, torch.stack([key_states, value_states]))
            return kv[0], kv[1]
        keys, values = buffers
        keys.index_copy_(2, self.write, key_states)
        values.index_copy_(2, self.write, value_states)
        return keys, values


class StaticPass:
    """``body(*leading, cache, attention_mask, position_ids, *inputs)`` compiled with fullgraph=True and static
    shapes, called as ``pass_(cache, attention_mask, position_ids, *inputs)`` over a ``TreeCache`` of
    ``PreallocatedLayer``s (module docstring). ``capacity``: the slots every layer's buffer holds (at least).
    ``shapes`` lists the (rows, new tokens, capacity) keys it has run, in order of first use."""

    def __init__(self, body: Callable, options: dict, *leading, capacity: int = 0):
        self.leading, self.capacity = leading, capacity
        self.cudagraphs = options.get("mode") in ("reduce-overhead", "max-autotune")
        self.fn = torch.compile(body, fullgraph=True, dynamic=False, **options)
        self.shapes: list[tuple[int, int, int]] = []
        self._staged: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._widths: dict[tuple[int, int, int], int] = {}  # mask columns each buffer has open (0.0) at most

    def __call__(self, cache, attention_mask: torch.Tensor, position_ids: torch.Tensor, *inputs):
        """attention_mask: float [b or 1, 1, n, held + n] (additive); position_ids [b or 1, n]; inputs: the body's
        tensors, the first one [b, n, ...]. The cache's layers hold ``held`` entries before and ``held + n`` after."""
        layers = cache.layers
        held, (batch, n) = layers[0].keys.shape[-2], inputs[0].shape[:2]
        if attention_mask.shape[-1] != held + n or attention_mask.shape[-2] != n:
            raise ValueError(f"a static pass over {n} tokens after {held} cached ones takes a mask [.., {n}, "
                             f"{held + n}], got {tuple(attention_mask.shape)}")
        if held + n > self.capacity:  # a batch's holes outgrew it: twice as many slots (one more compilation)
            self.capacity = 2 * (held + n)
        buffers = [layer.static_buffers(self.capacity) for layer in layers]  # reallocated only on a new capacity
        key = (batch, n, self.capacity)
        mask, positions, write = self._stage(key, attention_mask, position_ids, held, buffers)
        if key not in self.shapes:  # dynamo compiles here: room for every shape of this run and the ones before
            self.shapes.append(key)
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                out = self.fn(*self.leading, StaticKV(buffers, write), mask, positions, *inputs)
        else:
            out = self.fn(*self.leading, StaticKV(buffers, write), mask, positions, *inputs)
        for layer in layers:
            layer.hold(held + n)
        if self.cudagraphs:  # the next replay overwrites a CUDA graph's outputs
            out = tuple(None if t is None else t.clone() for t in out) if isinstance(out, tuple) else out.clone()
        return out

    def _stage(self, key, attention_mask, position_ids, held: int, buffers):
        """The pass's mask, positions and write slots in this shape's kept buffers (written in place)."""
        batch, n, capacity = key
        if key not in self._staged:
            device = attention_mask.device
            self._staged[key] = (torch.full((batch, 1, n, capacity), torch.finfo(attention_mask.dtype).min,
                                            dtype=attention_mask.dtype, device=device),
                                 torch.zeros(batch, n, dtype=torch.long, device=device),
                                 torch.zeros(n, dtype=torch.long, device=device))
            self._widths[key] = 0
        mask, positions, write = self._staged[key]
        width = held + n
        mask[..., :width].copy_(attention_mask)  # broadcast over rows when one mask serves them all
        if self._widths[key] > width:  # columns an earlier, longer pass opened are blocked again
            mask[..., width : self._widths[key]] = torch.finfo(mask.dtype).min
        self._widths[key] = width
        positions.copy_(position_ids)
        torch.arange(held, width, out=write)
        if self.cudagraphs:  # a CUDA graph reads and writes these in place rather than copying them each replay
            for t in (mask, positions, write, *(b for layer in buffers for b in layer)):
                torch._dynamo.mark_static_address(t)
        return mask, positions, write


def target_body(target, feature_layers: tuple[int, ...], cache: StaticKV, attention_mask: torch.Tensor,
                position_ids: torch.Tensor, input_ids: torch.Tensor):
    """The target's tree pass as a static graph (``StaticPass(target_body, options, target, feature_layers)``):
    input_ids [b, n] → (logits [b, n, V], the drafter's features [b, n, L·h] or None)."""
    out = target(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                 output_hidden_states=bool(feature_layers), **cache_arg(cache))
    return out.logits, stack_features(out.hidden_states, feature_layers) if feature_layers else None
