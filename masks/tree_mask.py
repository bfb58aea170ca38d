"""Tree attention as a plain 4D mask + position ids, for stock transformers models.

One target pass verifies every branch of a token tree (SpecInfer, Miao et al. 2024; Medusa, Cai et al.
2024): the N = n + 1 tree tokens (root + candidates, numbered as in ``treespec.tree``) are appended
after the ``past_len`` cached tokens, and each tree token may attend to the whole past, itself and
its ancestors only, so its logits equal those of decoding its root-to-node path one token at a time.
Its position id is ``past_len + depth``, the position it would have in that sequential decode.

Sliding-window layers (Mistral, Gemma-2/3, gpt-oss, ...) see less: a query at position p sees only keys at
positions > p − window (transformers' rule, ``masking_utils.sliding_window_overlay``), counted by *sequential*
positions, so a tree node at past_len + depth sees its ancestors and the last window − 1 − depth cached
tokens, exactly what it would see in a sequential decode of its path. Such a layer's cache may also have
dropped its oldest entries (treespec/cache.py): ``start`` is the position of the first cached key, and
the mask has past_len − start cached columns.

Why a FLOAT ADDITIVE mask (0.0 allowed, ``finfo(dtype).min`` blocked) and never a bool one: transformers
5.x passes a 4D ``attention_mask`` through as-is, and with ``attn_implementation="eager"`` it is *added*
to the attention scores; a bool mask then adds 0/1 instead of blocking, giving silently wrong logits
(sdpa would accept either). The float form is correct for both eager and sdpa.

Axis letters in shape comments: b batch, h heads, q query tokens (N for a whole tree), t new key
positions (the new tokens' keys), p cached positions (past_len − start), k = p + t all key positions.
"""

from __future__ import annotations

import torch

from treespec.tree import Tree

# attention implementations that take a float additive 4D mask (a drafter's expansion passes build one)
DENSE_MASK_ATTENTION = ("eager", "sdpa")
# ... and those a target's tree pass can take (flex_attention with a BlockMask, masks/flex.py)
TREE_MASK_ATTENTION = (*DENSE_MASK_ATTENTION, "flex_attention")


def visible(allowed: torch.Tensor, past_len: int, *, start: int = 0, window: int | None = None,
            positions: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """BoolTensor [q, (past_len − start) + t]: which keys each query may attend to.

    Keys are the cached positions ``start .. past_len − 1`` (a layer that dropped older entries holds none
    before ``start``), then the t new tokens, of which ``allowed`` [q, t] says which each query sees (itself,
    its ancestors); the queries are the last q new tokens. With ``window`` (a sliding-window layer) a query
    sees only keys at positions > its own − window; ``positions`` [t] are the new tokens' positions
    (default past_len, past_len + 1, ...: a causal continuation).
    """
    allowed = allowed.to(device=device, dtype=torch.bool)  # [q, t]
    q, t = allowed.shape
    cached = torch.ones(q, past_len - start, dtype=torch.bool, device=allowed.device)  # [q, p]
    seen = torch.cat([cached, allowed], dim=1)  # [q, k]
    if window is None:
        return seen
    if positions is None:
        positions = past_len + torch.arange(t)
    positions = positions.to(allowed.device)
    keys = torch.cat([torch.arange(start, past_len, device=allowed.device), positions])  # [k]
    queries = positions[t - q :]  # [q]
    return seen & (keys[None, :] > queries[:, None] - window)


def additive(seen: torch.Tensor, *, dtype=torch.float32) -> torch.Tensor:
    """Bool relation [q, k] → float additive mask [1, 1, q, k] (0.0 where seen, ``finfo(dtype).min`` elsewhere)."""
    mask = torch.full(seen.shape, torch.finfo(dtype).min, dtype=dtype, device=seen.device)  # [q, k]
    return mask.masked_fill(seen, 0.0)[None, None]  # [b=1, h=1, q, k]


def ancestor_mask(allowed: torch.Tensor, past_len: int, *, dtype=torch.float32, device=None, start: int = 0,
                  window: int | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Float additive mask [1, 1, q, (past_len − start) + t] from a bool relation among the new tokens.

    ``allowed`` [q, t]: True where query token q may see new token t (itself / its ancestors). Every
    query also sees the cached positions (those inside its window, with ``window``; see ``visible``). The
    general form, for callers that feed only part of a tree (e.g. a drafter expanding one depth at a
    time); see ``tree_attention_mask``.
    """
    seen = visible(allowed, past_len, start=start, window=window, positions=positions, device=device)
    return additive(seen, dtype=dtype)


def tree_allowed(tree: Tree, past_len: int, device=None, *, start: int = 0, window: int | None = None) -> torch.Tensor:
    """BoolTensor [N, (past_len − start) + N]: True where tree token i may attend (past, itself, its ancestors;
    inside its window with ``window``)."""
    return visible(tree.ancestors, past_len, start=start, window=window, positions=past_len + tree.depths,
                   device=device)


def tree_attention_mask(tree: Tree, past_len: int, *, dtype=torch.float32, device=None, start: int = 0,
                        window: int | None = None) -> torch.Tensor:
    """Float additive mask [1, 1, N, (past_len − start) + N]: 0.0 where allowed, ``torch.finfo(dtype).min``
    elsewhere (``tree_allowed``).

    ``dtype`` should be the model's compute dtype (the mask is added to its attention scores).
    """
    return additive(tree_allowed(tree, past_len, device, start=start, window=window), dtype=dtype)


class FullAttentionTreeMask:
    """``tree_attention_mask`` for the steps of one decoding run, on full-attention layers (start 0, no
    window): a tree's own block [N, N] is built once per tree (a static tree is the same object every step)
    and the cached columns are a view of a zero buffer, so a step's mask is one ``cat`` instead of the half
    dozen small tensor ops that build it from scratch (~80 µs of engine time per step on a CPU)."""

    def __init__(self, *, dtype=torch.float32, device=None):
        self.dtype, self.device = dtype, device
        self._tree: Tree | None = None
        self._block = torch.empty(0, 0)  # [N, N] additive: 0.0 on itself and its ancestors
        self._zeros = torch.zeros(0, 0, dtype=dtype, device=device)  # [≥ N, ≥ past_len]

    def __call__(self, tree: Tree, past_len: int) -> torch.Tensor:
        """Float additive mask [1, 1, N, past_len + N], equal to ``tree_attention_mask(tree, past_len)``."""
        if tree is not self._tree:
            self._tree, self._block = tree, additive(tree.ancestors.to(self.device), dtype=self.dtype)[0, 0]
        n = tree.num_nodes
        if self._zeros.shape[0] < n or self._zeros.shape[1] < past_len:  # grows by doubling, like the cache
            self._zeros = torch.zeros(max(n, self._zeros.shape[0]), max(256, 2 * past_len), dtype=self.dtype,
                                      device=self.device)
        return torch.cat([self._zeros[:n, :past_len], self._block], dim=1)[None, None]  # [b=1, h=1, q, k]


def tree_position_ids(tree: Tree, past_len: int, device=None) -> torch.Tensor:
    """LongTensor [1, N]: past_len + depth, each node's position in a sequential decode of its path."""
    return (past_len + tree.depths).to(device)[None]  # [b=1, q]
