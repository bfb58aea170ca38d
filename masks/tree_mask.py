"""Tree attention as a plain 4D mask + position ids, for stock transformers models.

One target pass verifies every branch of a token tree (SpecInfer, Miao et al. 2024; Medusa, Cai et al.
2024): the N = n + 1 tree tokens (root + candidates, numbered as in ``treespec.tree``) are appended
after the ``past_len`` cached tokens, and each tree token may attend to the whole past, itself and
its ancestors only, so its logits equal those of decoding its root-to-node path one token at a time.
Its position id is ``past_len + depth``, the position it would have in that sequential decode.

Why a FLOAT ADDITIVE mask (0.0 allowed, ``finfo(dtype).min`` blocked) and never a bool one: transformers
5.x passes a 4D ``attention_mask`` through as-is, and with ``attn_implementation="eager"`` it is *added*
to the attention scores; a bool mask then adds 0/1 instead of blocking, giving silently wrong logits
(sdpa would accept either). The float form is correct for both eager and sdpa.

Axis letters in shape comments: b batch, h heads, q query tokens (N for a whole tree), t tree key
positions (the new tokens' keys), p past (cached) positions, k = p + t all key positions.
"""

from __future__ import annotations

import torch

from treespec.tree import Tree

# attention implementations that take a float additive 4D mask (a drafter's expansion passes build one)
DENSE_MASK_ATTENTION = ("eager", "sdpa")
# ... and those a target's tree pass can take (flex_attention with a BlockMask, masks/flex.py)
TREE_MASK_ATTENTION = (*DENSE_MASK_ATTENTION, "flex_attention")


def ancestor_mask(allowed: torch.Tensor, past_len: int, *, dtype=torch.float32, device=None) -> torch.Tensor:
    """Float additive mask [1, 1, q, past_len + t] from a bool relation among the new tokens.

    ``allowed`` [q, t]: True where query token q may see new token t (itself / its ancestors). Every
    query also sees all ``past_len`` cached positions. The general form, for callers that feed only
    part of a tree (e.g. a drafter expanding one depth at a time); see ``tree_attention_mask``.
    """
    allowed = allowed.to(device=device, dtype=torch.bool)  # [q, t]
    past = torch.ones(allowed.shape[0], past_len, dtype=torch.bool, device=allowed.device)  # [q, p]
    allowed = torch.cat([past, allowed], dim=1)  # [q, k]
    mask = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype, device=allowed.device)  # [q, k]
    return mask.masked_fill(allowed, 0.0)[None, None]  # [b=1, h=1, q, k]


def tree_allowed(tree: Tree, past_len: int, device=None) -> torch.Tensor:
    """BoolTensor [N, past_len + N]: True where tree token i may attend (past, itself, its ancestors)."""
    past = torch.ones(tree.num_nodes, past_len, dtype=torch.bool, device=device)  # [q, p]
    return torch.cat([past, tree.ancestors.to(device)], dim=1)  # [q, k]


def tree_attention_mask(tree: Tree, past_len: int, *, dtype=torch.float32, device=None) -> torch.Tensor:
    """Float additive mask [1, 1, N, past_len + N]: 0.0 where allowed, ``torch.finfo(dtype).min`` elsewhere.

    ``dtype`` should be the model's compute dtype (the mask is added to its attention scores).
    """
    return ancestor_mask(tree.ancestors, past_len, dtype=dtype, device=device)


def tree_position_ids(tree: Tree, past_len: int, device=None) -> torch.Tensor:
    """LongTensor [1, N]: past_len + depth, each node's position in a sequential decode of its path."""
    return (past_len + tree.depths).to(device)[None]  # [b=1, q]

