"""The masks of cascade attention (treespec/cascade.py): a tree pass's block mask alone, and a ragged batch's
cached keys in order.

Cascade attention runs the tree queries over the cached keys without a mask (a flash kernel) and over the tree's
own keys under the ancestor mask, then merges the two by their log-sum-exps. So a pass needs only the [N, N] block
of the additive mask, never its [N, past] zero columns; a batch whose rows hold different cache slots (left
padding, the holes ragged acceptance leaves) also needs, per row, where its valid cached keys are: the kernel
reads each row's keys from the front up to its length, so they are gathered there first.

Axis letters: b rows, q = t = N tree tokens, s slots held, k kept keys (the most any row holds).
"""

from __future__ import annotations

import torch

from .dense import additive


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
    """Each row's valid cached slots first: (order LongTensor [b, k], lengths IntTensor [b]) with k = max(counts),
    row r's valid slots (``valid`` [b, s], True where the slot holds a token of the row) in increasing order in
    ``order[r, :counts[r]]`` and anything after; ``counts`` [b] (on the host: no read of the device) are the rows'
    valid slot counts. A stable sort on the device, so a step makes no host read for it."""
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices[:, : max(counts)]  # [b, k]
    return order, torch.tensor(counts, dtype=torch.int32, device=valid.device)
