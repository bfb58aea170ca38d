"""Tree attention masks, built from plain tensors: a float additive 4D mask (eager, sdpa) and a FlexAttention
BlockMask (flex_attention, GPU), for full-attention and sliding-window layers. A leaf: imports nothing of
treespec. The core's treespec/visibility.py is its one caller: it turns a Tree, a batch's row slots and a cache
into ancestor matrices, positions and lengths, and chooses between the dense and the flex mask.

    visible(allowed, past_len, start=, window=, positions=)  the bool relation [q, k]     (masks.relation)
    visible_rows(cached, allowed, past_len)                   the same per row of a batch, full attention
    additive(seen), ancestor_mask(allowed, past_len, ...)     the float additive mask     (masks.dense)
    block_mask(seen)                                          the FlexAttention BlockMask (masks.flex)
    DenseTreeMasks, FlexTreeMasks                             one run's masks, parts kept across steps
    CascadeTreeMasks, prefix_order                            cascade attention's block, a ragged batch's keys

Where this sits in the house: docs/design.md, "Module map".
"""

from .dense import CascadeTreeMasks, DenseTreeMasks, additive, ancestor_mask, prefix_order
from .flex import FlexTreeMasks, block_mask
from .relation import visible, visible_rows

__all__ = ["CascadeTreeMasks", "DenseTreeMasks", "FlexTreeMasks", "additive", "ancestor_mask", "block_mask",
           "prefix_order", "visible", "visible_rows"]
