"""Anchors of the block drafters' training windows (DFlash, heads/dflash/objective.py; PARD,
heads/draft_model/pard_objective.py): a block anchored at position a of a window is scored on the tokens after a,
so a is drawn among the positions whose next token is trained on (the loss mask; in a packed batch, in a's own
conversation), and a >= 1 (a root always has context, as decoding's first root follows the prompt). The draw
uses torch's global generator unless one is given: the training loop reseeds it from (seed, step, micro-batch),
so a resumed run draws the same anchors."""

from __future__ import annotations

import torch


def anchor_positions(input_ids: torch.Tensor, loss_mask: torch.Tensor | None,
                     segments: torch.Tensor | None) -> torch.Tensor:
    """BoolTensor [b, S]: the positions a block may be anchored at (module docstring)."""
    b, s = input_ids.shape
    ok = torch.zeros(b, s, dtype=torch.bool, device=input_ids.device)
    if s < 3:
        return ok
    ok[:, 1 : s - 1] = True if loss_mask is None else loss_mask[:, 2:s].bool()
    if segments is not None:
        ok[:, 1 : s - 1] &= segments[:, 1 : s - 1] == segments[:, 2:s]
    return ok


def sample_anchors(allowed: torch.Tensor, count: int, generator: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``count`` anchors per row, uniformly without replacement among ``allowed`` [b, S] → (anchors [b, m]
    in increasing order, real [b, m]: False where a row had fewer to give (those anchors point at position 1))."""
    m = max(1, min(int(count), allowed.shape[1]))
    scores = torch.rand(allowed.shape, generator=generator).to(allowed.device).masked_fill(~allowed, -1.0)
    values, anchors = scores.topk(m, dim=1)
    anchors, order = anchors.sort(dim=1)
    real = values.gather(1, order) >= 0
    return anchors.masked_fill(~real, 1), real
