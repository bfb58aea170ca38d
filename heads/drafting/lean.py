"""Lean drafting: a drafter's per-depth step without the per-call work of transformers' base models.

A one-layer drafter's arithmetic is small; what a draft depth costs on a CPU is mostly what the stock
base model does around it on every call (mask construction, rotary cos/sin, position bookkeeping, output
containers) and a vocabulary projection whose weight layout suits large batches. ``python
scripts/speed_checks.py`` measures both paths on the shipped reference models.

* ``LeanDecoder`` runs a stock decoder stack's own layers and final norm (no forked model code) the way a
  draft step needs them: rotary cos/sin are rows of a table the model's own rotary embedding computed once,
  and the attention mask is the one the caller built (treespec/visibility.py: ``attention_masks`` for tree
  nodes, ``causal_mask`` for several committed tokens, none for a single query, which sees the whole cache). Only
  for architectures whose base-model forward does nothing else to the hidden states (``LEAN_MODEL_TYPES``,
  each checked equal to the plain forward in tests/heads/test_lean.py), whose layers all attend fully and whose
  rotary frequencies do not depend on the sequence length (not "dynamic" or "longrope" scaling, which a table
  over every position would change); any other model runs through its plain forward (``lean_decoder``
  returns None).
* ``LeanProjection``: a vocabulary projection for the few rows of a draft depth or block on CPUs, where MKL's
  gemm against nn.Linear's [V, h] layout is slow and erratic over 1-16 rows. With oneDNN (float32, as torch's CPU
  builds have) it runs on the copy of the weight the target's layer already holds (treespec/linear_kernels.py,
  ``few_row_linear``: packed for the packed kernel, else reordered into oneDNN's blocked layout; shared with the
  target's layer, remade when the weight changes); oneDNN's read both reference targets' heads faster than MKL on a
  transposed copy at every row count measured
  (docs/results.md, "Parallel drafting"; ``scripts/speed_checks.py`` times a block's head). Without
  oneDNN the weight is a transposed snapshot ([h, V], contiguous), which MKL's gemm reads faster than [V, h] for
  a row or two. Its results differ from nn.Linear's in the last bits (summation order), which can reorder
  near-tied draft candidates; verification keeps the output exact either way.

Both are behind the drafters' ``lean`` switch (default on); ``lean=False`` is the plain path.
"""

from __future__ import annotations

import inspect
import weakref

import torch
from torch import nn

from treespec.compat import cache_arg
from treespec.linear_kernels import few_row_linear, onednn_available
from treespec.static_pass import StaticKV
from treespec.visibility import causal_mask

# model_type of the base models whose forward is embeddings → layers → final norm and nothing else (Gemma
# scales its embeddings, GPT-2 adds learned positions: they take the plain path)
LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# rotary scalings whose frequencies follow the longest position seen (transformers' dynamic_rope_update)
SEQUENCE_DEPENDENT_ROPE = ("dynamic", "longrope")


class LeanDecoder:
    """A stock transformers decoder stack (``.layers``, ``.norm``, ``.rotary_emb``) called layer by layer.

    lean(x [b, n, h], cache, past_len, position_ids [b or 1, n], attention_mask (float [b or 1, 1, n, past_len + n]))
    → the final-norm hidden states [b, n, h], as ``decoder(inputs_embeds=x, ...)`` would return them."""

    def __init__(self, decoder: nn.Module):
        self.decoder = decoder
        self._cos = self._sin = None  # [1, P, d] rotary tables, grown on demand

    def _rotary(self, position_ids: torch.Tensor, x: torch.Tensor, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables at ``position_ids``, from a table of at least ``needed`` positions (a bound the caller
        knows on the host: reading the largest position would wait for the device)."""
        if self._cos is None or self._cos.shape[1] < needed or self._cos.dtype != x.dtype or \
                self._cos.device != x.device:
            size = max(needed, 2 * (0 if self._cos is None else self._cos.shape[1]), 256)
            positions = torch.arange(size, device=x.device)[None]
            # the model's own rotary embedding over every position at once: the same values it computes per call
            self._cos, self._sin = self.decoder.rotary_emb(x, positions)
        if position_ids.shape[0] > 1:  # a batch whose rows have positions of their own: [b, n, d]
            return self._cos[0][position_ids], self._sin[0][position_ids]
        index = position_ids[0]
        return self._cos[:, index], self._sin[:, index]

    def __call__(self, x: torch.Tensor, cache, past_len: int | None, position_ids: torch.Tensor | None = None,
                 attention_mask=None) -> torch.Tensor:
        """x [b, n, h] after ``past_len`` cached entries → hidden states [b, n, h]. Without ``position_ids`` the
        n inputs are committed tokens: at the positions after the cache, causal (one query sees it all); with them
        ``past_len`` is not read."""
        n = x.shape[1]
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + n, device=x.device)[None]
            attention_mask = None if n == 1 else causal_mask(n, past_len, dtype=x.dtype, device=x.device)
        if isinstance(cache, StaticKV):
            # a compiled static pass (treespec/static_pass.py): a few fused ops in its graph, where a table would be
            # an input whose size the graph is guarded on
            position_embeddings = self.decoder.rotary_emb(x, position_ids)
        else:
            # a token's position never exceeds its cache slot (positions count a row's valid slots, plus the depth
            # of a tree node, whose ancestors hold slots before it): below the entries cached + n
            position_embeddings = self._rotary(position_ids, x, cache.get_seq_length() + n)
        for layer in self.decoder.layers:
            out = layer(x, attention_mask=attention_mask, position_ids=position_ids, **cache_arg(cache), use_cache=True,
                        position_embeddings=position_embeddings)
            x = out[0] if isinstance(out, tuple) else out
        return self.decoder.norm(x)


def lean_decoder(decoder: nn.Module, config) -> LeanDecoder | None:
    """A LeanDecoder for ``decoder`` (a base model built from ``config``), or None where the lean path is not
    known to equal the plain forward: other architectures, sliding-window layers, layers without
    ``position_embeddings``."""
    if getattr(config, "model_type", None) not in LEAN_MODEL_TYPES:
        return None
    layer_types = getattr(config, "layer_types", None)
    all_full = all(t == "full_attention" for t in layer_types) if layer_types else \
        getattr(config, "sliding_window", None) is None
    if not all_full:
        return None
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) in SEQUENCE_DEPENDENT_ROPE:
        return None
    layers = getattr(decoder, "layers", None)
    if not layers or not all(hasattr(decoder, a) for a in ("norm", "rotary_emb")):
        return None
    if "position_embeddings" not in inspect.signature(layers[0].forward).parameters:
        return None
    return LeanDecoder(decoder)


class LeanProjection(nn.Module):
    """x [..., h] @ weight.T (+ bias) → [..., V] through oneDNN's blocked layout on CPUs that have it, else a
    transposed copy on CPUs (module docstring); on other devices the plain ``F.linear``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, source: nn.Module | None = None):
        """source: the layer ``weight`` belongs to, whose reordered copy a few-row target layer already holds."""
        super().__init__()
        weight = weight.detach()  # shares the weight's storage and version counter: no copy
        cpu = weight.device.type == "cpu"
        self.blocked = cpu and weight.dtype == torch.float32 and onednn_available()
        self.transposed = cpu and not self.blocked
        self.register_buffer("weight", weight.t().contiguous() if self.transposed else weight, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)
        # a weak reference: not a submodule, and a deep copy of the projection does not copy the layer
        self._source = None if source is None else weakref.ref(source)

    @classmethod
    def of(cls, linear: nn.Module) -> LeanProjection:
        return cls(linear.weight, getattr(linear, "bias", None), source=linear)

    def _holder(self) -> nn.Module:
        """The source layer while it still holds this weight (its reordered copy is shared), else this module."""
        source = None if self._source is None else self._source()
        same = source is not None and getattr(source, "weight", None) is not None and \
            source.weight.data_ptr() == self.weight.data_ptr()
        return source if same else self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocked and x.dtype == torch.float32 and x.device.type == "cpu" and not x.requires_grad and \
                not torch.compiler.is_compiling():  # a compiled static pass holds F.linear, not the opaque copy
            return few_row_linear(self._holder(), x, self.bias)  # [..., V]
        if not self.transposed:
            return nn.functional.linear(x, self.weight, self.bias)
        y = x @ self.weight  # [..., V]
        return y if self.bias is None else y + self.bias
