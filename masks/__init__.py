"""Tree attention masks: a float additive 4D mask (eager/sdpa) and a FlexAttention BlockMask (GPU)."""

from .flex import tree_block_mask, tree_mask_mod
from .tree_mask import ancestor_mask, tree_allowed, tree_attention_mask, tree_position_ids

__all__ = [
    "ancestor_mask",
    "tree_allowed",
    "tree_attention_mask",
    "tree_block_mask",
    "tree_mask_mod",
    "tree_position_ids",
]
