"""The attention kernels cascade attention (treespec/cascade.py) calls: one interface, two implementations.

    kernel(q, k, v, causal, softmax_scale, key_lengths=None) -> (out, lse)

    q            [b, s, h, d]     queries (flash-attn's layout: sequence before heads)
    k, v         [b, t, kv, d]    keys and values; kv divides h (GQA: query head i reads key head i // (h / kv))
    causal       bool             query i sees keys 0 .. t − s + i (aligned to the bottom right, as flash-attn ≥ 2.1)
    key_lengths  [b] int or None  row r sees only its first key_lengths[r] keys (right padding); None: all t
    out          [b, s, h, d]     in q's dtype
    lse          [b, h, s]        float32: log Σ_j exp(scale · q·k_j) over the keys the query sees, −inf (the torch
                                  kernel) or +inf (flash-attn) for a query that sees none

The log-sum-exp is what lets two partial attentions over disjoint key sets be merged exactly (``cascade.merge``).

- ``flash_kernel``: flash-attn 2 (the optional extra ``pip install 'treespec[flash]'``), imported on first use.
  ``flash_attn_func(..., return_attn_probs=True)`` returns (out, softmax_lse [b, h, s], S_dmask); with
  ``key_lengths`` it is ``flash_attn_with_kvcache(q, k, v, cache_seqlens=..., return_softmax_lse=True)``, which
  reads the keys in place up to each row's length. CUDA, fp16/bf16 only.
- ``torch_kernel``: the same contract in plain torch, in float32, on any device: the stand-in the CPU tests run,
  and a fallback on a GPU without flash-attn (it materialises the [s, t] scores, so it is slow on long caches).

``masked_attention`` is the dense piece cascade attention runs beside the kernel: attention under an explicit
mask over a few keys (the tree block), also with its log-sum-exp.
"""

from __future__ import annotations

import importlib

import torch
from einops import rearrange

FLASH_MISSING = ("flash-attn is not installed (or does not import): install it with `pip install 'treespec[flash]'` "
                 "(flash-attn 2 needs CUDA and a matching torch; `pip install flash-attn --no-build-isolation`), or "
                 "load the target with attn_implementation='treespec_cascade_torch' (the pure-torch kernel)")


def _grouped_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """q [b, s, h, d], k [b, t, kv, d] → float32 scores [b, kv, g, s, t], g = h / kv query heads per key head."""
    heads, kv = q.shape[2], k.shape[2]
    if heads % kv:
        raise ValueError(f"{heads} query heads cannot share {kv} key/value heads (GQA needs kv to divide h)")
    qf = rearrange(q.float(), "b s (kv g) d -> b kv g s d", kv=kv)
    return torch.einsum("bkgsd,btkd->bkgst", qf, k.float()) * scale


def _softmax_out(scores: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores [b, kv, g, s, t] (−inf where a key is not seen), v [b, t, kv, d] → (out [b, s, h, d] in ``dtype``,
    lse [b, h, s] float32). A query that sees no key gets out 0 and lse −inf, never NaN."""
    lse = torch.logsumexp(scores, dim=-1)  # [b, kv, g, s]
    finite = torch.isfinite(lse)
    p = torch.exp(scores - torch.where(finite, lse, 0.0)[..., None])  # exp(−inf) = 0 where nothing is seen
    out = torch.einsum("bkgst,btkd->bskgd", p, v.float())
    return (rearrange(out, "b s kv g d -> b s (kv g) d").to(dtype),
            rearrange(torch.where(finite, lse, float("-inf")), "b kv g s -> b (kv g) s"))


def torch_kernel(q, k, v, causal: bool, softmax_scale: float, key_lengths: torch.Tensor | None = None):
    """The kernel contract (module docstring) in plain torch: float32 scores, any device."""
    s, t = q.shape[1], k.shape[1]
    scores = _grouped_scores(q, k, softmax_scale)  # [b, kv, g, s, t]
    keys = torch.arange(t, device=q.device)
    seen = torch.ones(1, s, t, dtype=torch.bool, device=q.device)  # [b or 1, s, t]
    if causal:
        seen = seen & (keys[None, :] <= (t - s) + torch.arange(s, device=q.device)[:, None])[None]
    if key_lengths is not None:
        seen = seen & (keys[None, None, :] < key_lengths.to(q.device)[:, None, None])
    scores = scores.masked_fill(~seen[:, None, None], float("-inf"))
    return _softmax_out(scores, v, q.dtype)


def masked_attention(q, k, v, mask: torch.Tensor, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [b, s, h, d] over k, v [b, t, kv, d] under ``mask`` [b or 1, 1 or h, s, t], float additive (0
    seen, a large negative value or −inf not) or bool (True seen) → (out [b, s, h, d] in q's dtype, lse [b, h, s]
    float32). An entry at or below half its dtype's ``finfo.min`` (treespec's masks put ``finfo.min`` there) or −inf
    counts as not seen."""
    kv, heads = k.shape[2], q.shape[2]
    seen = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    scores = _grouped_scores(q, k, softmax_scale)  # [b, kv, g, s, t]
    if mask.dtype != torch.bool:  # a finite additive bias (ALiBi-like) would count; treespec's are 0 or finfo.min
        bias = torch.where(seen, mask.float(), 0.0)
        scores = scores + rearrange(bias.expand(-1, heads, -1, -1), "b (kv g) s t -> b kv g s t", kv=kv)
    seen = rearrange(seen.expand(-1, heads, -1, -1), "b (kv g) s t -> b kv g s t", kv=kv)
    return _softmax_out(scores.masked_fill(~seen, float("-inf")), v, q.dtype)


def _flash():
    try:
        return importlib.import_module("flash_attn")
    except Exception as err:  # ImportError, or an undefined symbol of a flash-attn built for another torch
        raise ImportError(f"{FLASH_MISSING} ({type(err).__name__}: {err})") from err


def flash_available() -> bool:
    """Whether flash-attn imports (without raising)."""
    try:
        _flash()
    except ImportError:
        return False
    return True


def flash_kernel(q, k, v, causal: bool, softmax_scale: float, key_lengths: torch.Tensor | None = None):
    """The kernel contract (module docstring) by flash-attn 2's CUDA kernels."""
    fa = _flash()
    if key_lengths is None:
        out, lse, _ = fa.flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=softmax_scale, causal=causal,
                                         return_attn_probs=True)
    else:  # keys read in place, each row up to its length (k, v must be contiguous in the head dimension)
        out, lse = fa.flash_attn_with_kvcache(q, k.contiguous(), v.contiguous(),
                                              cache_seqlens=key_lengths.to(device=q.device, dtype=torch.int32),
                                              softmax_scale=softmax_scale, causal=causal, return_softmax_lse=True)
    return out, lse[..., : q.shape[1]].float()  # [b, h, s] (older releases padded the query axis)


KERNELS = {"flash": flash_kernel, "torch": torch_kernel}
