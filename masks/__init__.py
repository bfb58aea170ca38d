"""Tree attention masks, built from plain tensors: a float additive 4D mask (eager, sdpa) and a FlexAttention
BlockMask (flex_attention, GPU), for full-attention and sliding-window layers. A leaf: imports nothing of
treespec (the core turns a Tree and its cache into ancestor matrices, positions and lengths).

    visible(allowed, past_len, start=, window=, positions=)  the bool relation [q, k]     (masks.relation)
    ancestor_mask(allowed, past_len, ...)                     its additive mask           (masks.dense)
    mask_for(attn_implementation, allowed, past_len, ...)     the mask a model takes, any layer
    rows_mask_for(attn_implementation, cached, allowed, ...)  the same per row of a batch, full attention
    tree_mask_builder(attn_implementation, dtype=, device=)   one run's masks, parts kept across steps
"""

import torch

from .dense import DenseTreeMasks, additive, ancestor_mask
from .flex import FlexTreeMasks, block_mask
from .relation import visible, visible_rows

# attention implementations that take a float additive 4D mask (a drafter's expansion passes build one)
DENSE_MASK_ATTENTION = ("eager", "sdpa")
# ... and those a target's tree pass can take (flex_attention with a BlockMask, masks/flex.py)
TREE_MASK_ATTENTION = (*DENSE_MASK_ATTENTION, "flex_attention")

__all__ = ["DENSE_MASK_ATTENTION", "TREE_MASK_ATTENTION", "ancestor_mask", "mask_for", "rows_mask_for",
           "tree_mask_builder", "visible", "visible_rows"]


def _check_attention(attn_implementation: str) -> None:
    if attn_implementation not in TREE_MASK_ATTENTION:
        raise ValueError(f"attention implementation {attn_implementation!r} cannot take a tree mask; use one of "
                         f"{TREE_MASK_ATTENTION}")


def mask_for(attn_implementation: str, allowed: torch.Tensor, past_len: int, *, positions=None, start: int = 0,
             window: int | None = None, dtype=torch.float32, device=None):
    """The mask a model with ``attn_implementation`` takes for new tokens related by ``allowed`` [q, t] after
    the cached positions ``start .. past_len − 1`` (see ``visible``): a FlexAttention BlockMask for
    flex_attention, the float additive mask [1, 1, q, past_len − start + t] for eager and sdpa."""
    _check_attention(attn_implementation)
    seen = visible(allowed, past_len, start=start, window=window, positions=positions, device=device)
    if attn_implementation == "flex_attention":
        return block_mask(seen, device)
    return additive(seen, dtype=dtype)


def rows_mask_for(attn_implementation: str, cached: torch.Tensor | None, allowed: torch.Tensor, past_len: int, *,
                  dtype=torch.float32, device=None):
    """The mask a model with ``attn_implementation`` takes for a batch whose rows hold different cached slots
    (``visible_rows``: ``cached`` [b, past_len] or None for all, ``allowed`` [b or 1, q, t]): a BlockMask over b
    rows for flex_attention, the float additive mask [b, 1, q, past_len + t] for eager and sdpa."""
    _check_attention(attn_implementation)
    seen = visible_rows(cached, allowed, past_len, device=device)
    if attn_implementation == "flex_attention":
        return block_mask(seen, device)
    return additive(seen, dtype=dtype)


def tree_mask_builder(attn_implementation: str, *, dtype=torch.float32, device=None) -> DenseTreeMasks | FlexTreeMasks:
    """The tree masks of one decoding run on full-attention layers, called as ``builder(ancestors [N, N],
    past_len)`` each step and equal to ``mask_for(attn_implementation, ancestors, past_len)``, from parts kept
    across steps: ``FlexTreeMasks`` for flex_attention, ``DenseTreeMasks`` for eager and sdpa."""
    _check_attention(attn_implementation)
    if attn_implementation == "flex_attention":
        return FlexTreeMasks(device=device)
    return DenseTreeMasks(dtype=dtype, device=device)
