"""The attention inputs of a verification pass: the glue between a Tree, the target's cache and masks/.

A pass feeds the N tree tokens (root + candidates) after the ``past_len`` cached ones; each attends to the
past, itself and its ancestors (``Tree.ancestors``), at position past_len + depth (``Tree.depths``), the one
it would have in a sequential decode of its path (masks/relation.py). masks/ builds the masks from those
tensors; this module decides which masks a pass takes:

- a chain on eager or sdpa takes none: the model's own causal mask and positions are the tree's, and the
  model builds them for every kind of layer from the cache (``get_mask_sizes``);
- a target whose layers all attend fully takes one mask from parts kept across the run's steps
  (``masks.tree_mask_builder``: one ``cat`` per step for the dense mask, no ``create_block_mask`` per
  step for flex_attention, which is why a chain under flex takes it too);
- a target with sliding-window layers takes one mask per kind of layer (``cache.attention_masks``);
- a batch whose rows hold different slots (left padding, ragged acceptance: treespec/rows.py) or verify
  trees of their own takes one mask per row, [b, 1, N, slots + N], and per-row positions.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from treespec.cache import PreallocatedLayer, attention_masks
from treespec.drafter import Proposals
from treespec.masks import tree_mask_builder, visible
from treespec.rows import RowSlots
from treespec.tree import Tree


def tree_allowed(tree: Tree, past_len: int, *, start: int = 0, window: int | None = None, device=None) -> torch.Tensor:
    """BoolTensor [N, (past_len − start) + N]: which keys tree token i may attend to (the past, itself, its
    ancestors; inside its window with ``window``, for a layer whose first cached key is at ``start``)."""
    return visible(tree.ancestors, past_len, start=start, window=window, positions=past_len + tree.depths,
                   device=device)


def tree_position_ids(tree: Tree, past_len: int, device=None) -> torch.Tensor:
    """LongTensor [1, N]: past_len + depth, each node's position in a sequential decode of its path."""
    return (past_len + tree.depths).to(device)[None]  # [b=1, q]


def tree_masks(cache, tree: Tree, past_len: int, *, attn_implementation: str = "sdpa", dtype=torch.float32,
               device=None):
    """``cache.attention_masks`` for a whole tree after ``past_len`` cached tokens (nodes at past_len + depth):
    one mask per kind of layer of ``cache``, each built from scratch."""
    return attention_masks(cache, tree.ancestors, past_len, past_len + tree.depths,
                           attn_implementation=attn_implementation, dtype=dtype, device=device)


class TreeAttention:
    """The attention inputs of one decoding run's verification passes over ``target`` with ``cache`` (a
    TreeCache, whose layer types are fixed at construction), with the mask parts kept across steps."""

    def __init__(self, target, cache):
        self.cache = cache
        self.attn_implementation = target.config._attn_implementation
        self.dtype, self.device = target.dtype, target.device
        # under flex_attention the model would run create_block_mask for a chain's causal mask every step
        self.chain_builds_own_mask = self.attn_implementation != "flex_attention"
        self.full_attention = all(type(layer) in (DynamicLayer, PreallocatedLayer) for layer in cache.layers)
        self.kept = tree_mask_builder(self.attn_implementation, dtype=self.dtype, device=self.device)

    def __call__(self, proposals: Proposals, slots: RowSlots) -> dict:
        """The forward's keyword arguments for a pass over each row's root and candidates after the slots
        ``slots`` describes: {"attention_mask": [b or 1, 1, N, k] or a BlockMask (or one per layer type),
        "position_ids": [b or 1, N]}, or none for a chain the model masks itself."""
        tree = proposals.tree
        if tree is None or slots.ragged:
            allowed, depths = stacked_relation(proposals)
            return {"attention_mask": slots.mask(allowed, attn_implementation=self.attn_implementation,
                                                 dtype=self.dtype),
                    "position_ids": slots.positions(depths)}
        return self.shared(tree, slots.length)

    def shared(self, tree: Tree, past_len: int) -> dict:
        """The keyword arguments for ``tree``'s N tokens after ``past_len`` cached ones, every row alike."""
        if tree.is_chain and self.chain_builds_own_mask:
            return {}
        if self.full_attention:
            mask = self.kept(tree.ancestors, past_len)
        else:
            mask = tree_masks(self.cache, tree, past_len, attn_implementation=self.attn_implementation,
                              dtype=self.dtype, device=self.device)
        return {"attention_mask": mask, "position_ids": tree_position_ids(tree, past_len, self.device)}


def stacked_relation(proposals: Proposals) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ancestor matrix and depths, padded to the largest tree: (BoolTensor [b or 1, N, N], LongTensor
    [b or 1, N]); a padding node sees itself only, at depth 0 (none of a row's real nodes sees it)."""
    tree = proposals.tree
    if tree is not None:
        return tree.ancestors[None], tree.depths[None]
    n = proposals.num_nodes
    allowed = torch.eye(n, dtype=torch.bool).repeat(len(proposals.trees), 1, 1)  # [b, N, N]
    depths = torch.zeros(len(proposals.trees), n, dtype=torch.long)  # [b, N]
    for b, row in enumerate(proposals.trees):
        allowed[b, : row.num_nodes, : row.num_nodes] = row.ancestors
        depths[b, : row.num_nodes] = row.depths
    return allowed, depths
