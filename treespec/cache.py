"""Keep exactly prefix + accepted path in a transformers KV cache after a verification pass.

A verification pass appends all N tree tokens to the cache, but only the root and the accepted path
belong to the sequence. Compacting them down to contiguous positions (and dropping the rest) leaves
the cache exactly as if the accepted tokens had been decoded one by one, so the next step is an
ordinary continuation (research.md: transformers 5.x DynamicCache, per layer ``.keys/.values`` of
shape [b, kv_heads, seq, head_dim]).
"""

from __future__ import annotations

import torch


def keep_tree_path(cache, past_len: int, keep: torch.Tensor) -> None:
    """Keep the cache entries ``past_len + keep`` (tree-node offsets, increasing, root = 0) and drop
    everything after them, in place. keep: LongTensor [k]."""
    k = keep.numel()
    contiguous = bool((keep == torch.arange(k, device=keep.device)).all()) if k else True
    for layer in cache.layers:
        if type(layer).__name__ != "DynamicLayer":
            raise NotImplementedError(
                f"cache layer type {type(layer).__name__} (sliding-window, quantised or static caches) cannot be "
                "compacted yet; treespec supports full-attention models with a DynamicCache"
            )
        if not layer.is_initialized:
            continue
        if not contiguous:  # a chain prefix (the common case) is already in place
            src = (past_len + keep).to(layer.keys.device)
            # [b, h, seq, d]: gather the accepted rows, then write them right after the prefix
            layer.keys[:, :, past_len : past_len + k] = layer.keys.index_select(2, src)
            layer.values[:, :, past_len : past_len + k] = layer.values.index_select(2, src)
        layer.keys = layer.keys[:, :, : past_len + k]
        layer.values = layer.values[:, :, : past_len + k]
