"""Tree attention as a FlexAttention ``BlockMask``, for ``attn_implementation="flex_attention"``.

Same relation as ``masks.tree_mask`` (each tree token sees the past, itself and its ancestors, inside its
window on a sliding-window layer; SpecInfer, Miao et al. 2024), expressed as a ``mask_mod`` so
FlexAttention (PyTorch 2.5+) can skip fully-masked blocks on GPU, where flash_attention_2 cannot take a
tree mask at all. The float mask of ``masks.tree_mask`` stays the portable default (eager / sdpa, CPU);
use this one with flex on GPU.

Axis letters: q tree (query) tokens = N = n + 1, k key positions = past_len − start + N.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from treespec.tree import Tree

from .tree_mask import tree_allowed


def tree_mask_mod(tree: Tree, past_len: int, device=None, *, start: int = 0, window: int | None = None):
    """The FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` of the tree relation.

    A bare lookup in the dense allowed table [q, k] (``tree_allowed``), with no index arithmetic.
    Why: with torch 2.13, mask_mods that combine a gather with arithmetic on the indices ("kv < past_len
    or ancestors[q, kv - past_len]", pre-order interval tests, even clamping the indices) hit an inductor
    C++ codegen error (CppCompileError) when transformers compiled flex_attention on CPU; the bare
    lookup compiles and matches sdpa.
    """
    return mask_mod_of(tree_allowed(tree, past_len, device, start=start, window=window))


def mask_mod_of(allowed: torch.Tensor):
    """The ``mask_mod`` of a bool relation ``allowed`` [q, k] (``masks.tree_mask.visible``): a bare lookup."""

    def mask_mod(b, h, q_idx, kv_idx):
        # No clamping needed: flex's GPU kernels bound padded indices themselves (get_bounded_indices).
        return allowed[q_idx, kv_idx]

    return mask_mod


def tree_block_mask(tree: Tree, past_len: int, device=None, *, start: int = 0,
                    window: int | None = None) -> BlockMask:
    """A ``BlockMask`` over q = N tree tokens and k = past_len − start + N key positions (batch and heads
    broadcast); ``start`` and ``window`` as in ``masks.tree_mask.visible``.

    On CPU ``create_block_mask`` takes ~1 s; build one per (tree, past_len) and reuse it when possible.
    """
    device = torch.device("cpu") if device is None else torch.device(device)
    return block_mask(tree_allowed(tree, past_len, device, start=start, window=window), device)


def block_mask(allowed: torch.Tensor, device=None) -> BlockMask:
    """A ``BlockMask`` of a bool relation ``allowed`` [q, k] (batch and heads broadcast)."""
    device = allowed.device if device is None else torch.device(device)
    q, k = allowed.shape
    return create_block_mask(mask_mod_of(allowed.to(device)), B=None, H=None, Q_LEN=q, KV_LEN=k, device=device)
