"""SDPA that reads grouped key/value heads in place under a mask: ``attn_implementation="treespec_sdpa"``.

transformers' "sdpa" runs grouped-query attention (GQA: fewer key/value heads than query heads) through
``scaled_dot_product_attention(enable_gqa=True)`` only when there is no mask, and packs a single query onto the
key/value heads; a pass over several tokens WITH a mask (every tree pass, and every draft-then-verify chain) first
copies each layer's whole cached keys and values once per query head (``repeat_kv``). On CPUs torch's flash kernel
takes ``enable_gqa`` together with a mask and reads the shared heads in place, with the same result (equal bits in
``tests/core/test_gqa_attention.py``). On SmolLM2-135M (9 query heads, 3 key/value heads) that copy was among the
largest costs a few-token pass adds over a one-token one (docs/results.md, "A tree pass on CPU"), and it grows with
the cache.

Registered with transformers' attention and mask interfaces under ``NAME`` on import, as cascade attention is
(treespec/cascade.py). A bool mask (transformers' own, for a chain of new tokens) is turned into SDPA's additive one
once per pass rather than inside every layer's SDPA (``additive_once``). Every case it does not improve (no mask, no
grouping, a GPU, a position bias, a softcap, a single query, which transformers already packs onto the key/value
heads without a copy) goes to transformers' own ``sdpa_attention_forward`` unchanged.
``treespec.reference.load_model`` loads a GQA model on it by default on a CPU (an explicit
``attn_implementation="sdpa"`` there keeps transformers' own).

On a CPU with AVX-512, a float32 pass over 2-``NATIVE_QUERIES`` new tokens goes to treespec's own kernel
(treespec/few_query_attention.c, built with the native linear kernels: treespec/native_linear.py). torch's flash kernel
tiles for long queries, which a tree pass's few do not fill. The native one puts one query row per lane, so a key's
scores for 16 rows are one register and the softmax needs no horizontal sums; it reads each grouped key/value head once
per 16 rows. Not the same bits as torch's (another order of sums, its own exp): agreement within float32 rounding and
greedy equality are tested (tests/core/test_few_query_attention.py), and what it saves is in
results/few_query_attention/. Off per model: ``use_native_attention(model, False)``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from treespec import native_linear

NAME = "treespec_sdpa"


def sdpa_gqa_in_place(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' attention-function contract: query [b, h, q, d], key/value [b, kv, t, d], attention_mask
    [b or 1, 1 or h, q, t] (bool or additive float) or None → (out [b, q, h, d], None)."""
    groups = getattr(module, "num_key_value_groups", 1)
    if (groups == 1 or attention_mask is None or query.shape[2] == 1 or query.device.type != "cpu"
            or key.shape[-1] != value.shape[-1]
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
            or kwargs.get("output_attentions", False)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if attention_mask.dtype == torch.bool:
        attention_mask = additive_once(attention_mask, query.dtype)
    if dropout == 0.0 and native_takes(module, query, key, value, attention_mask):
        return native_attention(query, key, value, attention_mask, scaling), None
    # with a mask, transformers' sdpa is not causal either (is_causal = q > 1 and mask is None and ...)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)  # [b, h, q, d]
    return out.transpose(1, 2).contiguous(), None


def additive_once(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True: seen) as the additive one SDPA makes of it (0 / −inf, ``dtype``), made once per pass: every
    layer of a pass gets the same mask object, and SDPA converted it again in each (a ``where`` per layer in the
    profile of a 16-token SmolLM2 pass)."""
    return _once(_additive, mask, dtype,
                 lambda: torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf")))


def _once(held: list, mask: torch.Tensor, variant, make) -> torch.Tensor:
    """``make()``'s tensor for ``mask``, made once per pass: the last two are kept (a pass's full and sliding-window
    layers get different masks), keyed by the mask object, its in-place version and ``variant``."""
    key = (mask._version, variant)
    for mask_held, key_held, made in tuple(held):  # a copy: another thread may change the list meanwhile
        if mask_held is mask and key_held == key:
            return made
    made = make()
    held[:] = [(mask, key, made), *held[:1]]
    return made


_additive: list = []  # [(bool mask, (its version, dtype), additive mask)]
_transposed: list = []  # [(additive mask, (its version, None), [b, t, q])]

#: the most new tokens per row the native few-query kernel takes; longer passes (a prefill) go to torch's flash kernel,
#: which tiles for them
NATIVE_QUERIES = 64
#: whether a model's attention layers use it where it builds: ``use_native_attention`` sets it per layer
NATIVE_DEFAULT = True


@functools.cache
def native_available() -> bool:
    """Whether the native few-query kernel (treespec/few_query_attention.c) is built here (AVX-512)."""
    lib = native_linear.library()
    return lib is not None and bool(lib.few_query_attention_built())


def use_native_attention(model, enabled: bool = True) -> None:
    """Switch the native few-query kernel on or off for ``model``'s attention layers (on by default where it builds);
    off, ``treespec_sdpa`` runs torch's flash kernel with ``enable_gqa``."""
    for module in model.modules():
        if hasattr(module, "num_key_value_groups"):
            module.treespec_native_attention = enabled


def native_takes(module, query, key, value, mask) -> bool:
    """Whether the native kernel computes this call: float32 rows on an AVX-512 build, 2-``NATIVE_QUERIES`` queries,
    a head size of 16, 32, 64, 128 or 256, unit strides along it, a mask shared by the heads, and no gradient to
    carry (the kernel has no backward: training goes to torch's)."""
    dim = query.shape[-1]
    return (getattr(module, "treespec_native_attention", NATIVE_DEFAULT) and query.dtype is torch.float32
            and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))
            and key.dtype is torch.float32 and value.dtype is torch.float32 and mask.dtype is torch.float32
            and 1 < query.shape[2] <= NATIVE_QUERIES and dim in (16, 32, 64, 128, 256) and value.shape[-1] == dim
            and query.stride(-1) == key.stride(-1) == value.stride(-1) == 1 and mask.dim() == 4
            and mask.shape[0] in (1, query.shape[0]) and mask.shape[1] == 1 and mask.shape[2] == query.shape[2]
            and mask.shape[3] == key.shape[2]
            and query.shape[1] % key.shape[1] == 0 and native_available())


def native_attention(query, key, value, mask, scaling) -> torch.Tensor:
    """The native kernel: query [b, h, q, d], key/value [b, kv, t, d], additive mask [b or 1, 1, q, t] → out [b, q, h,
    d]."""
    batch, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    mask_t = transposed_once(mask)  # [b or 1, t, q]
    out = torch.empty(batch, queries, heads, dim)
    scale = dim ** -0.5 if scaling is None else scaling
    code = native_linear.library().few_query_attention(
        query.data_ptr(), *query.stride()[:3], key.data_ptr(), *key.stride()[:3], value.data_ptr(), *value.stride()[:3],
        mask_t.data_ptr(), mask_t.stride(0) if mask_t.shape[0] > 1 else 0, out.data_ptr(), batch, heads, kv_heads,
        queries, keys, dim, scale, torch.get_num_threads())
    if code:
        raise RuntimeError("the native attention kernel could not allocate its buffers (out of memory)")
    return out


def transposed_once(mask: torch.Tensor) -> torch.Tensor:
    """An additive mask [b, 1, q, t] as the native kernel reads it, [b, t, q] contiguous, made once per pass."""
    return _once(_transposed, mask, None, lambda: mask[:, 0].transpose(1, 2).contiguous())


def wanted(model) -> bool:
    """Whether ``model`` (on its current device) gains from ``NAME``: grouped heads, on a CPU, loaded on "sdpa"."""
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    device = next(model.parameters()).device
    return (getattr(config, "_attn_implementation", None) == "sdpa" and device.type == "cpu"
            and isinstance(heads, int) and isinstance(kv, int) and kv < heads)


def use_in_place_gqa(model) -> bool:
    """Switch ``model`` to ``NAME`` where ``wanted``; returns whether it did."""
    if not wanted(model):
        return False
    model.set_attn_implementation(NAME)
    return True


def _register() -> None:
    AttentionInterface.register(NAME, sdpa_gqa_in_place)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks "sdpa" gets


_register()
