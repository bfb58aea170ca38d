"""What a query may see: the one owner of the attention masks (and tree positions) of every pass treespec makes.

A pass feeds new tokens after what a cache holds, and each new token may see some of the cached keys and some
of the new ones. Four things decide which, and this module puts them together; every other module asks it for
masks and none calls masks/ itself (tests/test_layering.py enforces it):

- tree ancestry: each of a tree pass's N tokens (root + candidates) sees the past, itself and its ancestors
  (``Tree.ancestors``), at position past_len + depth (``Tree.depths``), the one it would have in a sequential
  decode of its path (masks/relation.py);
- a batch's row slots (treespec/rows.py keeps them: left padding and the holes ragged acceptance leaves are
  invalid slots of a row): a row sees only its valid slots (``slots_mask``);
- sliding windows: a sliding layer sees only the keys inside its window, counted by sequential position, from
  its first cached entry (treespec/cache.py), so a cache with sliding layers takes one mask per kind of layer
  (``attention_masks``);
- the attention implementation: a float additive mask for eager and sdpa, a FlexAttention BlockMask for
  flex_attention (``mask_for``, ``rows_mask_for``, ``tree_mask_builder``), and for cascade attention
  (treespec/cascade.py) the tree's [N, N] block alone, or for a ragged batch the full mask with each row's valid
  cached keys in order (``treespec_prefix``). A drafter's own passes and the
  training-time unrolls take the float mask always (``dense_mask``, ``causal_mask``;
  heads/checkpoints/layer_config.py holds
  drafters to ``DENSE_MASK_ATTENTION``).

masks/ builds the tensors (a leaf: plain tensors in, masks out); this module decides which masks a pass takes.
A decoding run's verification passes (``TreeAttention``):

- a chain on eager or sdpa takes none: the model's own causal mask and positions are the tree's, and the
  model builds them for every kind of layer from the cache (``get_mask_sizes``);
- a target whose layers all attend fully takes one mask from parts kept across the run's steps
  (``tree_mask_builder``: one ``cat`` per step for the dense mask, no ``create_block_mask`` per step for
  flex_attention, which is why a chain under flex takes it too);
- a target with sliding-window layers takes one mask per kind of layer (``attention_masks``);
- a batch whose rows hold different slots (left padding, ragged acceptance: treespec/rows.py) or verify
  trees of their own takes one mask per row, [b, 1, N, slots + N], and per-row positions.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from treespec.cache import PreallocatedLayer, check_layer
from treespec.cascade import CASCADE_ATTENTION, PREFIX_KWARG
from treespec.drafter import Proposals
from treespec.gqa_attention import NAME as GQA_SDPA
from treespec.masks import (
    CascadeTreeMasks,
    DenseTreeMasks,
    FlexTreeMasks,
    additive,
    ancestor_mask,
    block_mask,
    prefix_order,
    visible,
    visible_rows,
)
from treespec.rows import RowSlots
from treespec.tree import Tree

# attention implementations that take a float additive 4D mask (a drafter's expansion passes build one)
DENSE_MASK_ATTENTION = ("eager", "sdpa", GQA_SDPA)
# ... and those a target's tree pass can take (flex_attention with a BlockMask, masks/flex.py; cascade attention
# with the tree's block, masks/dense.py, or a float additive mask)
TREE_MASK_ATTENTION = (*DENSE_MASK_ATTENTION, "flex_attention", *CASCADE_ATTENTION)


# -- the choice between dense and flex masks ----------------------------------------------------------------
def _check_attention(attn_implementation: str) -> None:
    if attn_implementation not in TREE_MASK_ATTENTION:
        raise ValueError(f"attention implementation {attn_implementation!r} cannot take a tree mask; use one of "
                         f"{TREE_MASK_ATTENTION}")


def mask_for(attn_implementation: str, allowed: torch.Tensor, past_len: int, *, positions=None, start: int = 0,
             window: int | None = None, dtype=torch.float32, device=None):
    """The mask a model with ``attn_implementation`` takes for new tokens related by ``allowed`` [q, t] after
    the cached positions ``start .. past_len − 1`` (see ``masks.visible``): a FlexAttention BlockMask for
    flex_attention, the float additive mask [1, 1, q, past_len − start + t] for eager and sdpa."""
    _check_attention(attn_implementation)
    seen = visible(allowed, past_len, start=start, window=window, positions=positions, device=device)
    if attn_implementation == "flex_attention":
        return block_mask(seen, device)
    return additive(seen, dtype=dtype)


def rows_mask_for(attn_implementation: str, cached: torch.Tensor | None, allowed: torch.Tensor, past_len: int, *,
                  dtype=torch.float32, device=None):
    """The mask a model with ``attn_implementation`` takes for a batch whose rows hold different cached slots
    (``masks.visible_rows``: ``cached`` [b, past_len] or None for all, ``allowed`` [b or 1, q, t]): a BlockMask
    over b rows for flex_attention, the float additive mask [b, 1, q, past_len + t] for eager and sdpa."""
    _check_attention(attn_implementation)
    seen = visible_rows(cached, allowed, past_len, device=device)
    if attn_implementation == "flex_attention":
        return block_mask(seen, device)
    return additive(seen, dtype=dtype)


def tree_mask_builder(attn_implementation: str, *, dtype=torch.float32, device=None):
    """The tree masks of one decoding run on full-attention layers, called as ``builder(ancestors [N, N],
    past_len)`` each step and equal to ``mask_for(attn_implementation, ancestors, past_len)``, from parts kept
    across steps: ``FlexTreeMasks`` for flex_attention, ``DenseTreeMasks`` for eager and sdpa;
    ``CascadeTreeMasks`` (the [N, N] block alone: the cached keys need none) for cascade attention."""
    _check_attention(attn_implementation)
    if attn_implementation == "flex_attention":
        return FlexTreeMasks(device=device)
    if attn_implementation in CASCADE_ATTENTION:
        return CascadeTreeMasks(dtype=dtype, device=device)
    return DenseTreeMasks(dtype=dtype, device=device)


def dense_mask(allowed: torch.Tensor, past_len: int, *, dtype=torch.float32, device=None) -> torch.Tensor:
    """Float additive mask [1, 1, q, past_len + t] (eager, sdpa): new tokens related by ``allowed`` [q, t] after
    ``past_len`` cached positions, every one of which each query sees. For the passes that feed part of a tree
    or a causal run over a drafter's own layers (heads/training/unroll.py: a training-time unroll)."""
    return ancestor_mask(allowed, past_len, dtype=dtype, device=device)


def relation_mask(seen: torch.Tensor, *, dtype=torch.float32) -> torch.Tensor:
    """Float additive mask [1, 1, q, k] or [b, 1, q, k] of a bool relation ``seen`` [q, k] or [b, q, k] over all the
    keys a pass attends (no cache columns added): a training pass over packed conversations (heads/training/segments.py,
    heads/training/unroll.py), each row with its own relation."""
    return additive(seen, dtype=dtype)


def causal_mask(n: int, past_len: int, *, dtype=torch.float32, device=None) -> torch.Tensor:
    """Float additive mask [1, 1, n, past_len + n]: new token q sees the cache and new tokens up to itself."""
    return dense_mask(torch.ones(n, n, dtype=torch.bool, device=device).tril(), past_len, dtype=dtype, device=device)


# -- sliding windows: one mask per kind of layer --------------------------------------------------------------
def attention_masks(cache, allowed: torch.Tensor, past_len: int, positions: torch.Tensor, *,
                    attn_implementation: str = "sdpa", dtype=torch.float32, device=None):
    """The ``attention_mask`` a forward over new tokens takes, given what each layer of ``cache`` holds.

    ``allowed`` [q, t]: which new tokens each query sees (itself, its ancestors), the queries being the last
    q of them; ``positions`` [t]: the new tokens' sequential positions; the cache holds positions up to
    ``past_len − 1``. One mask (``mask_for``) per kind of layer: a single mask when every layer is
    alike, else a dict keyed by layer type (a ``TreeCache`` knows its model's ``config.layer_types``).
    """
    for layer in cache.layers:
        check_layer(layer)
    # (window, first cached position) of each layer; a cache whose layers are created lazily has none before
    # its first forward
    kinds = [(getattr(layer, "sliding_window", None), getattr(layer, "start", 0)) for layer in cache.layers]
    masks = {kind: mask_for(attn_implementation, allowed, past_len, positions=positions, start=kind[1], window=kind[0],
                            dtype=dtype, device=device) for kind in dict.fromkeys(kinds or [(None, 0)])}
    if len(masks) == 1:
        return next(iter(masks.values()))
    by_type = {}
    for layer_type, kind in zip(cache.layer_types, kinds, strict=True):
        if by_type.setdefault(layer_type, kind) != kind:  # one mask per type must fit every layer of that type
            raise RuntimeError(f"{layer_type!r} layers hold different windows or positions: {by_type[layer_type]} "
                               f"and {kind} (window, first cached position)")
    return {layer_type: masks[kind] for layer_type, kind in by_type.items()}


# -- a batch's row slots ----------------------------------------------------------------------------------------
def slots_mask(slots: RowSlots, allowed: torch.Tensor, *, attn_implementation: str = "sdpa", dtype=torch.float32):
    """The mask of a pass over new slots after those ``slots`` holds, related by ``allowed`` [b or 1, q, t] (which
    new slots each query sees), the queries being the last q of them: each row sees its valid held slots, then
    what ``allowed`` says; [b, 1, q, s + t] (a BlockMask under flex_attention)."""
    return rows_mask_for(attn_implementation, slots.valid, allowed, slots.length, dtype=dtype, device=slots.device)


def causal_rows(counts: list[int], width: int, device=None) -> torch.Tensor:
    """BoolTensor [b, width, width]: row b feeds ``counts[b]`` tokens right-padded to ``width``; each sees itself
    and the row's tokens before it, and no padding slot (a padding query sees itself, so its row is not empty)."""
    i = torch.arange(width, device=device)
    fed = i[None] < torch.tensor(counts, device=device)[:, None]  # [b, t]
    return (i[None, :, None] >= i[None, None, :]) & fed[:, None, :] | torch.eye(width, dtype=torch.bool,
                                                                               device=device)[None]


# -- tree ancestry: a decoding run's verification passes ---------------------------------------------------------
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
    """``attention_masks`` for a whole tree after ``past_len`` cached tokens (nodes at past_len + depth):
    one mask per kind of layer of ``cache``, each built from scratch."""
    return attention_masks(cache, tree.ancestors, past_len, past_len + tree.depths,
                           attn_implementation=attn_implementation, dtype=dtype, device=device)


class TreeAttention:
    """The attention inputs of one decoding run's verification passes over ``target`` with ``cache`` (a
    TreeCache, whose layer types are fixed at construction), with the mask parts kept across steps."""

    def __init__(self, target, cache, *, explicit: bool = False):
        """explicit: every pass takes its mask and positions, chains too (a static pass: treespec/static_pass.py)."""
        self.cache = cache
        self.attn_implementation = target.config._attn_implementation
        self.dtype, self.device = target.dtype, target.device
        # under flex_attention the model would run create_block_mask for a chain's causal mask every step
        self.chain_builds_own_mask = self.attn_implementation != "flex_attention" and not explicit
        self.full_attention = all(type(layer) in (DynamicLayer, PreallocatedLayer) for layer in cache.layers)
        self.kept = tree_mask_builder(self.attn_implementation, dtype=self.dtype, device=self.device)

    def __call__(self, proposals: Proposals, slots: RowSlots) -> dict:
        """The forward's keyword arguments for a pass over each row's root and candidates after the slots
        ``slots`` describes: {"attention_mask": [b or 1, 1, N, k] or a BlockMask (or one per layer type),
        "position_ids": [b or 1, N]}, or none for a chain the model masks itself."""
        tree = proposals.tree
        if tree is None or slots.ragged:
            allowed, depths = stacked_relation(proposals)
            kwargs = {"position_ids": slots.positions(depths)}
            if self.attn_implementation in CASCADE_ATTENTION and not slots.ragged:
                # every row sees every cached key: the tree blocks alone, [b, 1, N, N]
                kwargs["attention_mask"] = additive(allowed.to(slots.device), dtype=self.dtype)
                return kwargs
            kwargs["attention_mask"] = slots_mask(slots, allowed, attn_implementation=self.attn_implementation,
                                                  dtype=self.dtype)
            if self.attn_implementation in CASCADE_ATTENTION:  # the kernel reads each row's valid cached keys
                kwargs[PREFIX_KWARG] = prefix_order(slots.valid, slots.counts)
            return kwargs
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
