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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

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
    # with a mask, transformers' sdpa is not causal either (is_causal = q > 1 and mask is None and ...)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)  # [b, h, q, d]
    return out.transpose(1, 2).contiguous(), None


def additive_once(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True: seen) as the additive one SDPA makes of it (0 / −inf, ``dtype``), made once per pass: every
    layer of a pass gets the same mask object, and SDPA converted it again in each (a ``where`` per layer in the
    profile of a 16-token SmolLM2 pass). The last conversion is kept, keyed by the mask object, its in-place version
    and the dtype."""
    global _last_additive
    held = _last_additive  # one read: another thread may replace it meanwhile
    if held is None or held[0] is not mask or held[1] != (mask._version, dtype):
        converted = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        held = _last_additive = (mask, (mask._version, dtype), converted)
    return held[2]


_last_additive: tuple | None = None  # (bool mask, (its version, dtype), additive mask)


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
