"""Tree attention masks: a float additive 4D mask (eager/sdpa) and a FlexAttention BlockMask (GPU).
Imports nothing of treespec but its Tree."""

import torch

from treespec.tree import Tree

from .flex import tree_block_mask, tree_mask_mod
from .tree_mask import (
    DENSE_MASK_ATTENTION,
    TREE_MASK_ATTENTION,
    ancestor_mask,
    tree_allowed,
    tree_attention_mask,
    tree_position_ids,
)

__all__ = [
    "DENSE_MASK_ATTENTION",
    "TREE_MASK_ATTENTION",
    "ancestor_mask",
    "tree_allowed",
    "tree_attention_mask",
    "tree_block_mask",
    "tree_mask_for",
    "tree_mask_mod",
    "tree_position_ids",
]


def tree_mask_for(attn_implementation: str, tree: Tree, past_len: int, *, dtype=torch.float32, device=None):
    """The mask a model with ``attn_implementation`` takes for ``tree``: a FlexAttention BlockMask for
    flex_attention, the float additive mask for eager and sdpa."""
    if attn_implementation == "flex_attention":
        return tree_block_mask(tree, past_len, device=device)
    if attn_implementation not in DENSE_MASK_ATTENTION:
        raise ValueError(f"attention implementation {attn_implementation!r} cannot take a tree mask; use one of "
                         f"{TREE_MASK_ATTENTION}")
    return tree_attention_mask(tree, past_len, dtype=dtype, device=device)
