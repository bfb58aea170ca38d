"""Tree attention as a FlexAttention ``BlockMask``, for ``attn_implementation="flex_attention"``.

Same relation as ``masks.tree_mask`` (each tree token sees the whole past, itself and its ancestors;
SpecInfer, Miao et al. 2024), expressed as a ``mask_mod`` so FlexAttention (PyTorch 2.5+) can skip
fully-masked blocks on GPU, where flash_attention_2 cannot take a tree mask at all. The float mask of
``masks.tree_mask`` stays the portable default (eager / sdpa, CPU); use this one with flex on GPU.

Axis letters: q tree (query) tokens = N = n + 1, k key positions = past_len + N.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from treespec.tree import Tree

from .tree_mask import tree_allowed


def tree_mask_mod(tree: Tree, past_len: int, device=None):
    """The FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` of the tree relation.

    A bare lookup in the dense allowed table [q, k] (``tree_allowed``), with no index arithmetic.
    Why: with torch 2.13, mask_mods that combine a gather with arithmetic on the indices ("kv < past_len
    or ancestors[q, kv - past_len]", pre-order interval tests, even clamping the indices) hit an inductor
    C++ codegen error (CppCompileError) when transformers compiled flex_attention on CPU; the bare
    lookup compiles and matches sdpa.
    """
    allowed = tree_allowed(tree, past_len, device)  # [q, k]

    def mask_mod(b, h, q_idx, kv_idx):
        # No clamping needed: flex's GPU kernels bound padded indices themselves (get_bounded_indices).
        return allowed[q_idx, kv_idx]

    return mask_mod


def tree_block_mask(tree: Tree, past_len: int, device=None) -> BlockMask:
    """A ``BlockMask`` over q = N tree tokens and k = past_len + N key positions (batch and heads broadcast).

    On CPU ``create_block_mask`` takes ~1 s; build one per (tree, past_len) and reuse it when possible.
    """
    device = torch.device("cpu") if device is None else torch.device(device)
    n = tree.num_nodes
    return create_block_mask(
        tree_mask_mod(tree, past_len, device), B=None, H=None, Q_LEN=n, KV_LEN=past_len + n, device=device
    )
