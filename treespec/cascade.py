"""Cascade attention: tree passes through flash-attn, registered with transformers so stock models take it by name.

flash-attn takes no arbitrary mask, so a tree pass (each node sees the cached prefix, itself and its ancestors)
cannot run in it directly. Split the keys instead, as SGLang verifies EAGLE trees on FA3:

    prefix   the N tree queries over the S cached keys, every query sees every key: no mask, the flash kernel,
             which also returns each query's log-sum-exp                                       → o₁, lse₁
    block    the N queries over the tree's own N keys under the ancestor mask (N is a few dozen: dense, in
             torch, float32)                                                                   → o₂, lse₂
    merge    out = (o₁·e^lse₁ + o₂·e^lse₂) / (e^lse₁ + e^lse₂), computed from m = max(lse₁, lse₂) (``merge``)

which is the softmax over all S + N keys, exactly (up to rounding). The cost over the prefix is a flash pass; the
mask is [N, N] and never [N, S + N].

Register once (``import treespec`` does), then load a model with

    attn_implementation="treespec_cascade"        the flash kernel (CUDA, fp16/bf16; the ``flash`` extra)
    attn_implementation="treespec_cascade_torch"  the same algorithm with the pure-torch kernel (any device)

What each forward gets, and does (treespec/visibility.py builds the masks; a mask function returning None or the
2D padding mask, transformers' flash one, serves the model's own mask creation):

- no mask (a prefill, or a chain over a cache every row fills alike): the kernel, causal, over all keys;
- a 2D padding mask [b, K] (the prefill of a left-padded batch): torch's sdpa with causal ∧ padding (flash-attn
  would need the rows unpadded; one pass per generate call);
- a 4D mask [b or 1, 1, N, N] (a tree pass over a cache every row fills alike): prefix by the kernel unmasked,
  block by ``masked_attention`` under this mask, merged;
- a 4D mask [b, 1, N, S + N] with ``treespec_prefix=(order [b, S'], lengths [b])`` (a batch whose rows hold
  different cache slots: left padding, the holes ragged acceptance leaves): each row's valid cached keys gathered
  to the front by ``order``, the kernel over them up to ``lengths`` (right padding), then block and merge as above;
- any other 4D mask [b, 1, N, K]: ``masked_attention`` over all keys (correct for any mask, not fast).

Refused, with the reason: dropout > 0, sliding windows, logit soft-capping, attention sinks, non-causal modules.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from treespec.attention_kernels import FLASH_MISSING, KERNELS, flash_available, masked_attention

try:  # transformers' mask function for flash-attn: None when nothing is padded, else the 2D padding mask
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
except ImportError:  # pragma: no cover - every supported release has both
    AttentionMaskInterface = flash_attention_mask = None

# attn_implementation name → the kernel its prefix and causal passes run in
CASCADE_ATTENTION = {"treespec_cascade": "flash", "treespec_cascade_torch": "torch"}
PREFIX_KWARG = "treespec_prefix"  # (order [b, S'], lengths [b]): a ragged batch's valid cached keys


def merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor):
    """Two attentions of the same queries over disjoint key sets → the attention over their union.

    o₁, o₂ [b, s, h, d]; lse₁, lse₂ [b, h, s] (float32). A non-finite lse₁ (the query saw none of those keys:
    −inf from the torch kernel, +inf from flash-attn) weighs 0. Returns (out [b, s, h, d] float32, lse [b, h, s])."""
    lse1 = torch.where(torch.isfinite(lse1), lse1, float("-inf"))
    m = torch.maximum(lse1, lse2)
    m = torch.where(torch.isfinite(m), m, 0.0)  # neither part saw a key: both weights 0, out 0
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)  # [b, h, s], each ≤ 1 and one of them = 1
    total = w1 + w2
    out = (o1.float() * w1.transpose(1, 2)[..., None] + o2.float() * w2.transpose(1, 2)[..., None]) \
        / total.clamp_min(torch.finfo(torch.float32).tiny).transpose(1, 2)[..., None]
    return out, m + torch.log(total)


def check_supported(module, dropout: float, sliding_window, softcap, s_aux, is_causal) -> None:
    """What cascade attention cannot compute, refused naming the model's feature."""
    name = type(module).__name__
    if dropout:
        raise ValueError(f"treespec cascade attention runs no dropout ({name} asked for {dropout}): call model.eval()")
    if sliding_window is not None:
        raise ValueError(f"treespec cascade attention has no sliding windows ({name} has a window of {sliding_window}):"
                         " load this model with attn_implementation='sdpa'")
    if softcap is not None:
        raise ValueError(f"treespec cascade attention has no logit soft-capping ({name} caps at {softcap}): load "
                         "this model with attn_implementation='sdpa' or 'eager'")
    if s_aux is not None:
        raise ValueError(f"treespec cascade attention has no attention sinks ({name} has them): load this model "
                         "with attn_implementation='sdpa' or 'eager'")
    if is_causal is False or getattr(module, "is_causal", True) is False:
        raise ValueError(f"treespec cascade attention is for causal decoders; {name} attends bidirectionally")


def cascade_attention(kernel_name: str):
    """The attention function (transformers' ``AttentionInterface`` signature) running ``KERNELS[kernel_name]``
    (looked up at each call, so a test can count the kernel's calls)."""
    if kernel_name not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel_name!r}; expected one of {sorted(KERNELS)}")

    def attention(module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0,
                  sliding_window=None, softcap=None, s_aux=None, is_causal=None, **kwargs):
        """query [b, h, n, d], key and value [b, kv, K, d] (the cache and the n new tokens, K = S + n) →
        (out [b, n, h, d], None)."""
        check_supported(module, dropout, sliding_window, softcap, s_aux, is_causal)
        kernel = KERNELS[kernel_name]
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [b, n, h, d], [b, K, kv, d]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        n, keys = q.shape[1], k.shape[1]
        if attention_mask is None:
            out, _ = kernel(q, k, v, True, scale)
        elif attention_mask.dim() == 2:
            out = padded_causal(query, key, value, attention_mask, scale)
        elif attention_mask.dim() != 4:
            raise ValueError(f"treespec cascade attention takes no mask, a 2D padding mask or a 4D mask, got shape "
                             f"{tuple(attention_mask.shape)}")
        elif attention_mask.shape[-1] == n:  # the tree block alone: every query sees every cached key
            out = tree_pass(kernel, q, k, v, attention_mask, scale)
        elif attention_mask.shape[-1] == keys and kwargs.get(PREFIX_KWARG) is not None:
            out = tree_pass(kernel, q, k, v, attention_mask[..., keys - n :], scale, kwargs[PREFIX_KWARG])
        elif attention_mask.shape[-1] == keys:  # a mask of another kind: right for any mask, dense
            out, _ = masked_attention(q, k, v, attention_mask, scale)
        else:
            raise ValueError(f"treespec cascade attention: a 4D mask over {attention_mask.shape[-1]} keys fits neither "
                             f"the {n} new keys nor all {keys}")
        return out.to(query.dtype).contiguous(), None

    attention.__name__ = f"cascade_attention_{kernel_name}"
    return attention


def tree_pass(kernel, q, k, v, block: torch.Tensor, scale: float, prefix=None) -> torch.Tensor:
    """q [b, n, h, d] over k, v [b, S + n, kv, d]: the cached keys by ``kernel`` without a mask (with ``prefix`` =
    (order [b, S'], lengths [b]): each row's valid keys gathered first, up to its length), the last n keys under
    ``block`` [b or 1, 1, n, n], merged → out [b, n, h, d] float32."""
    cached = k.shape[1] - q.shape[1]
    o2, lse2 = masked_attention(q, k[:, cached:], v[:, cached:], block, scale)
    if cached == 0:
        return o2
    k1, v1, lengths = k[:, :cached], v[:, :cached], None
    if prefix is not None:
        order, lengths = prefix  # order [b, S'] slot indices, lengths [b]
        index = order.to(k.device)[:, :, None, None].expand(-1, -1, k.shape[2], k.shape[3])
        k1, v1 = k1.gather(1, index), v1.gather(1, index)
    o1, lse1 = kernel(q, k1, v1, False, scale, lengths) if lengths is not None else kernel(q, k1, v1, False, scale)
    return merge(o1, lse1, o2, lse2)[0]


def padded_causal(query, key, value, padding: torch.Tensor, scale: float) -> torch.Tensor:
    """A left-padded batch's prefill: query [b, h, n, d] over key, value [b, kv, K, d], each row seeing the keys
    ``padding`` [b, K] marks (True / 1) up to its own position, and itself (a padding query then sees one key: no
    NaN reaches the cache's invalid slots) → out [b, n, h, d]. torch's sdpa, grouped heads (GQA)."""
    n, keys = query.shape[2], key.shape[2]
    i = torch.arange(n, device=query.device)[:, None] + (keys - n)
    j = torch.arange(keys, device=query.device)[None]
    seen = ((j <= i)[None] & padding.bool()[:, None, :]) | (j == i)[None]  # [b, n, K]
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # key heads repeated (sdpa's enable_gqa needs torch 2.5; this pass runs once per call)
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=seen[:, None], scale=scale)
    return out.transpose(1, 2)


def check_cascade_target(config, device: torch.device) -> None:
    """At generate's door: a target loaded with a cascade implementation can run it here."""
    impl = getattr(config, "_attn_implementation", None)
    if impl not in CASCADE_ATTENTION:
        return
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if getattr(text, "attn_logit_softcapping", None):
        raise ValueError(f"{impl}: {text.model_type} soft-caps its attention logits "
                         f"({text.attn_logit_softcapping}), which cascade attention does not: use 'sdpa' or 'eager'")
    if CASCADE_ATTENTION[impl] == "flash":
        if not flash_available():
            raise ValueError(f"{impl}: {FLASH_MISSING}")
        if device.type != "cuda":
            raise ValueError(f"{impl} runs flash-attn, which needs CUDA; the target is on {device.type}: use "
                             "attn_implementation='treespec_cascade_torch' there")


def register() -> None:
    """Make the cascade implementations loadable by name (idempotent): the attention functions, and the mask
    function the model's own mask creation calls (transformers' flash one: None, or the 2D padding mask)."""
    for name, kernel_name in CASCADE_ATTENTION.items():
        AttentionInterface.register(name, cascade_attention(kernel_name))
        if AttentionMaskInterface is not None:
            AttentionMaskInterface.register(name, flash_attention_mask)


register()
