"""Anchors of the block drafters' training windows (DFlash, heads/dflash/objective.py; PARD,
heads/draft_model/pard_objective.py): a block anchored at position a of a window is scored on the tokens after a,
so a is drawn among the positions whose next token is trained on (the loss mask; in a packed batch, in a's own
conversation), and a >= 1 (a root always has context, as decoding's first root follows the prompt). The draw
uses torch's global generator unless one is given: the training loop reseeds it from (seed, step, micro-batch),
so a resumed run draws the same anchors.

**Anchors where prompt lookup misses** (``lookup_misses``). As prompt lookup's fallback in a Combined drafter
(heads/combined/drafter.py, ``mode="fallback"``) a block drafter is asked only on the steps where prompt lookup
finds no earlier occurrence of the last n committed tokens (n >= its ``min_ngram``): text the sequence has not
shown yet. A block trained on every position spends most of its anchors on repetitive text it is never asked
about there; anchored only where the shortest n-gram misses, its training matches the steps it serves."""

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


def lookup_misses(input_ids: torch.Tensor, min_ngram: int, segments: torch.Tensor | None = None) -> torch.Tensor:
    """BoolTensor [b, S]: True at the positions a whose n-gram x_{a−n+1} .. x_a (n = ``min_ngram``) occurs nowhere
    earlier in the window (ending at some j < a; in a packed batch, in a's conversation), where prompt lookup with
    that shortest n-gram finds no continuation (module docstring); positions with fewer than n tokens before
    them miss too. A longer n-gram's match contains the shortest's, so n = ``min_ngram`` decides."""
    n = int(min_ngram)
    if n < 1:
        raise ValueError(f"lookup_misses needs min_ngram >= 1, got {min_ngram!r}")
    b, s = input_ids.shape
    miss = torch.ones(b, s, dtype=torch.bool, device=input_ids.device)
    if s < n:
        return miss
    grams = input_ids.unfold(1, n, 1)  # [b, S − n + 1, n]: the n-gram ending at position i + n − 1
    same = (grams[:, :, None] == grams[:, None]).all(-1)  # [b, g, g]
    earlier = torch.ones(same.shape[1:], dtype=torch.bool, device=input_ids.device).tril(-1)
    same &= earlier
    if segments is not None:  # an n-gram across a conversation's start, or in another conversation, is no match
        ends = segments[:, n - 1 :]
        whole = (segments.unfold(1, n, 1) == ends[:, :, None]).all(-1)  # [b, g]
        same &= (ends[:, :, None] == ends[:, None]) & whole[:, :, None] & whole[:, None]
    miss[:, n - 1 :] = ~same.any(-1)
    return miss
