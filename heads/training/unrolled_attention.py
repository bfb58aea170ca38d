"""Attention for an unrolled training step (heads/training/unroll.py) at the cost of one causal pass.

Unrolled step i >= 1 of EAGLE-3's training-time test lets root r's query see the step-0 keys t <= r (the committed
context) and, of each step m in 1..i, root r's own key (its chain). As one dense masked attention over the keys of
steps 0..i in cache order that is [n − i, Σ_{m<=i} (n − m)] scores, (i + 1) times a causal pass, though each query
sees at most n + i keys: steps 0..6 of the published TTT length cost 28 causal passes instead of 7 (its share of a
CPU training step: results/notes/2026-12-04-eagle3-training-throughput.md).

Here the two parts run apart and merge exactly, as FlashAttention merges blocks (Dao 2023, online softmax): the
context through PyTorch's fused CPU attention (``_scaled_dot_product_flash_attention_for_cpu``, which returns its
log-sum-exp), the chain as [q, i] dot products; the output is both parts reweighted by their share of the joint
normaliser. The backward hands the fused kernel the joint output and log-sum-exp: it recomputes each context
probability from them, so its gradients are the joint softmax's, and the chain's are a few einsums.

``unrolled`` passes an ``UnrollMask`` as the attention mask and selects this function (registered with
transformers' attention interface as ``treespec_unrolled``) where it applies: CPU tensors under SDPA (either kind).
Elsewhere, and for any other mask, the dense path runs: decoding never comes here.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from treespec.gqa_attention import NAME as GQA_SDPA

NAME = "treespec_unrolled"
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@dataclass
class UnrollMask:
    """What unrolled step ``step`` attends to: the context mask [b or 1, 1, q, n] (additive float) over the n
    step-0 keys; of the cache's later keys, each query's own chain (module docstring)."""

    context: torch.Tensor
    n: int
    step: int


class _Merged(torch.autograd.Function):
    """softmax over [context keys ‖ own chain keys] of q; tensors [b, h, q, d], chain ones [b, h, q, i, d]."""

    @staticmethod
    def forward(ctx, q, k, v, k_chain, v_chain, mask, scale):
        out_c, lse_c = _flash(q, k, v, 0.0, False, attn_mask=mask, scale=scale)  # [b, h, q, d], [b, h, q]
        s_chain = torch.einsum("bhqd,bhqid->bhqi", q.float(), k_chain.float()) * scale  # [b, h, q, i]
        lse = torch.logaddexp(lse_c, s_chain.logsumexp(-1))  # the joint normaliser's log
        p_chain = (s_chain - lse[..., None]).exp()
        out = ((lse_c - lse).exp()[..., None] * out_c.float()
               + torch.einsum("bhqi,bhqid->bhqd", p_chain, v_chain.float())).to(q.dtype)
        ctx.save_for_backward(q, k, v, k_chain, v_chain, mask, out, lse, p_chain)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, k_chain, v_chain, mask, out, lse, p_chain = ctx.saved_tensors
        d_out = d_out.contiguous().to(q.dtype)
        # the joint probabilities of the context keys, recomputed by the kernel from the joint lse; its D = dO·out
        dq, dk, dv = _flash_backward(d_out, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=ctx.scale)
        g, o = d_out.float(), out.float()
        dv_chain = p_chain[..., None] * g[:, :, :, None, :]  # [b, h, q, i, d]
        d_s = p_chain * (torch.einsum("bhqd,bhqid->bhqi", g, v_chain.float()) - (g * o).sum(-1, keepdim=True))
        dq = dq.float() + ctx.scale * torch.einsum("bhqi,bhqid->bhqd", d_s, k_chain.float())
        dk_chain = ctx.scale * d_s[..., None] * q.float()[:, :, :, None, :]
        return (dq.to(q.dtype), dk, dv, dk_chain.to(k_chain.dtype), dv_chain.to(v_chain.dtype), None, None)


def _repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, h_kv, ...] → [b, h_kv · groups, ...] (grouped-query attention's shared keys, differentiably)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def unrolled_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature: query [b, h, q, d], key/value [b, h_kv, k, d] (the cache's keys
    of steps 0..i in order) → ([b, q, h, d], None). Any mask but an ``UnrollMask`` goes to SDPA."""
    if not isinstance(attention_mask, UnrollMask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    n, i, q_len = attention_mask.n, attention_mask.step, query.shape[2]
    groups = query.shape[1] // key.shape[1]
    starts = [sum(n - m for m in range(step)) for step in range(1, i + 1)]  # where step m's keys begin
    k_chain = torch.stack([key[:, :, a : a + q_len] for a in starts], dim=3)  # [b, h_kv, q, i, d]
    v_chain = torch.stack([value[:, :, a : a + q_len] for a in starts], dim=3)
    k_ctx, v_ctx = key[:, :, :n], value[:, :, :n]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    mask = attention_mask.context.to(query.dtype)
    out = _Merged.apply(query.contiguous(), _repeat_heads(k_ctx, groups).contiguous(),
                        _repeat_heads(v_ctx, groups).contiguous(), _repeat_heads(k_chain, groups),
                        _repeat_heads(v_chain, groups), mask, float(scale))
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, unrolled_attention)


def applies(config, device) -> bool:
    """Whether ``unrolled`` uses this attention: CPU tensors and a layer under SDPA (transformers' or treespec's
    in-place GQA one, treespec/gqa_attention.py); eager keeps its own maths."""
    return torch.device(device).type == "cpu" and getattr(config, "_attn_implementation", None) in ("sdpa", GQA_SDPA)


@contextlib.contextmanager
def selected(config):
    """``config``'s attention is this function's while the block runs (and SDPA's again after)."""
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before
