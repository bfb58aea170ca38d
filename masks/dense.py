"""Tree attention as a float additive 4D mask, for ``attn_implementation`` "eager" and "sdpa", and cascade attention's
tree block (treespec/cascade.py).

Why a FLOAT ADDITIVE mask (0.0 allowed, ``finfo(dtype).min`` blocked) and never a bool one: transformers
5.x passes a 4D ``attention_mask`` through as-is, and with ``attn_implementation="eager"`` it is *added*
to the attention scores; a bool mask then adds 0/1 instead of blocking, giving silently wrong logits
(sdpa would accept either). The float form is correct for both eager and sdpa. ``dtype`` should be the
model's compute dtype (the mask is added to its attention scores).

Axis letters as in ``masks.relation``: b batch, h heads, q query tokens, t new keys, k all keys.
"""

from __future__ import annotations

import torch

from .relation import visible


def additive(seen: torch.Tensor, *, dtype=torch.float32) -> torch.Tensor:
    """Bool relation [q, k] or [b, q, k] → float additive mask [1, 1, q, k] or [b, 1, q, k] (0.0 where seen,
    ``finfo(dtype).min`` elsewhere)."""
    mask = torch.full(seen.shape, torch.finfo(dtype).min, dtype=dtype, device=seen.device).masked_fill(seen, 0.0)
    return mask[None, None] if seen.dim() == 2 else mask[:, None]  # [b, h=1, q, k]


def ancestor_mask(allowed: torch.Tensor, past_len: int, *, dtype=torch.float32, device=None, start: int = 0,
                  window: int | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Float additive mask [1, 1, q, (past_len − start) + t] of ``visible``'s relation: ``allowed`` [q, t] says
    which new tokens each query sees (itself, its ancestors; ``allowed.tril()`` of ones for a causal run), and
    every query also sees the cached positions (those inside its window, with ``window``).

    The dense building block for callers that feed part of a tree or a causal run (a drafter expanding one
    depth at a time, a training-time unroll)."""
    seen = visible(allowed, past_len, start=start, window=window, positions=positions, device=device)
    return additive(seen, dtype=dtype)


class DenseTreeMasks:
    """The additive tree masks of one decoding run's steps, on full-attention layers (start 0, no window).

    A tree's own block [N, N] is built once per ancestor matrix (a static tree hands over the same tensor
    every step) and the cached columns are a view of a zero buffer, so a step's mask is one ``cat`` instead
    of the half dozen small tensor ops that build it from scratch."""

    def __init__(self, *, dtype=torch.float32, device=None):
        self.dtype, self.device = dtype, device
        self._ancestors: torch.Tensor | None = None  # the ancestor matrix the kept block was built from
        self._block = torch.empty(0, 0)  # [N, N] additive: 0.0 on itself and its ancestors
        self._zeros = torch.zeros(0, 0, dtype=dtype, device=device)  # [≥ N, ≥ past_len]

    def __call__(self, ancestors: torch.Tensor, past_len: int) -> torch.Tensor:
        """ancestors: BoolTensor [N, N] → float additive mask [1, 1, N, past_len + N], equal to
        ``ancestor_mask(ancestors, past_len)``."""
        if ancestors is not self._ancestors:
            self._ancestors, self._block = ancestors, additive(ancestors.to(self.device), dtype=self.dtype)[0, 0]
        n = ancestors.shape[0]
        if self._zeros.shape[0] < n or self._zeros.shape[1] < past_len:  # grows by doubling, like the cache
            self._zeros = torch.zeros(max(n, self._zeros.shape[0]), max(256, 2 * past_len), dtype=self.dtype,
                                      device=self.device)
        return torch.cat([self._zeros[:n, :past_len], self._block], dim=1)[None, None]  # [b=1, h=1, q, k]


# -- cascade attention ---------------------------------------------------------------------------------------------
# Cascade attention (treespec/cascade.py) runs the tree queries over the cached keys without a mask (a flash kernel)
# and over the tree's own keys under the ancestor mask, then merges the two by their log-sum-exps. A pass needs only
# the [N, N] block of the additive mask, never its [N, past] zero columns; a batch whose rows hold different cache
# slots (left padding, the holes ragged acceptance leaves) also needs, per row, where its valid cached keys are: the
# kernel reads each row's keys from the front up to its length, so they are gathered there first.
class CascadeTreeMasks:
    """The tree block masks of one decoding run's steps: ``builder(ancestors [N, N], past_len)`` → the float
    additive mask [1, 1, N, N] (0.0 on itself and its ancestors), built once per ancestor matrix (a static tree
    hands over the same tensor every step). ``past_len`` is not needed: every query sees every cached key."""

    def __init__(self, *, dtype=torch.float32, device=None):
        self.dtype, self.device = dtype, device
        self._ancestors: torch.Tensor | None = None
        self._block = torch.empty(0, 0)

    def __call__(self, ancestors: torch.Tensor, past_len: int) -> torch.Tensor:
        if ancestors is not self._ancestors:
            self._ancestors, self._block = ancestors, additive(ancestors.to(self.device), dtype=self.dtype)
        return self._block  # [b=1, h=1, q, t]


def prefix_order(valid: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's valid cached slots first: (order LongTensor [b, k], lengths IntTensor [b]), k = max(counts): row
    r's valid slots (``valid`` [b, s], True where the slot holds a token of the row) in increasing order in
    ``order[r, :counts[r]]``, anything after; ``counts`` (on the host: no read of the device) are the rows' valid
    slot counts. A stable sort on the device, so a step makes no host read for it."""
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices[:, : max(counts)]  # [b, k]
    return order, torch.tensor(counts, dtype=torch.int32, device=valid.device)
