"""Tree attention masks: a float additive 4D mask (eager/sdpa) and a FlexAttention BlockMask (GPU), for
full-attention and sliding-window layers. Imports nothing of treespec but its Tree."""

import torch

from treespec.tree import Tree

from .flex import FullAttentionTreeBlockMask, block_mask, tree_block_mask, tree_mask_mod
from .tree_mask import (
    DENSE_MASK_ATTENTION,
    TREE_MASK_ATTENTION,
    FullAttentionTreeMask,
    additive,
    ancestor_mask,
    tree_allowed,
    tree_attention_mask,
    tree_position_ids,
    visible,
)

__all__ = [
    "DENSE_MASK_ATTENTION",
    "TREE_MASK_ATTENTION",
    "FullAttentionTreeBlockMask",
    "FullAttentionTreeMask",
    "additive",
    "ancestor_mask",
    "block_mask",
    "full_attention_tree_mask",
    "mask_for",
    "tree_allowed",
    "tree_attention_mask",
    "tree_block_mask",
    "tree_mask_for",
    "tree_mask_mod",
    "tree_position_ids",
    "visible",
]


def full_attention_tree_mask(attn_implementation: str, *, dtype=torch.float32, device=None):
    """The per-run tree-mask builder of ``attn_implementation`` for full-attention layers (parts kept across
    steps): ``FullAttentionTreeBlockMask`` for flex_attention, ``FullAttentionTreeMask`` for eager and sdpa."""
    if attn_implementation == "flex_attention":
        return FullAttentionTreeBlockMask(device=device)
    return FullAttentionTreeMask(dtype=dtype, device=device)


def mask_for(attn_implementation: str, allowed: torch.Tensor, past_len: int, *, positions=None, start: int = 0,
             window: int | None = None, dtype=torch.float32, device=None):
    """The mask a model with ``attn_implementation`` takes for new tokens related by ``allowed`` [q, t] after
    the cached positions ``start .. past_len − 1`` (see ``visible``): a FlexAttention BlockMask for
    flex_attention, the float additive mask [1, 1, q, past_len − start + t] for eager and sdpa."""
    if attn_implementation not in TREE_MASK_ATTENTION:
        raise ValueError(f"attention implementation {attn_implementation!r} cannot take a tree mask; use one of "
                         f"{TREE_MASK_ATTENTION}")
    seen = visible(allowed, past_len, start=start, window=window, positions=positions, device=device)
    if attn_implementation == "flex_attention":
        return block_mask(seen, device)
    return additive(seen, dtype=dtype)


def tree_mask_for(attn_implementation: str, tree: Tree, past_len: int, *, dtype=torch.float32, device=None,
                  start: int = 0, window: int | None = None):
    """``mask_for`` a whole tree after ``past_len`` cached tokens (nodes at positions past_len + depth)."""
    return mask_for(attn_implementation, tree.ancestors, past_len, positions=past_len + tree.depths, start=start,
                    window=window, dtype=dtype, device=device)
