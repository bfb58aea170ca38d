"""A batch's rows on one cache slot axis: which slots hold a row's tokens, and its positions.

The design is in treespec/cache.py's docstring ("A batch of rows"). A ``RowSlots`` describes the slots a
cache holds between passes (committed tokens, left padding, holes); a pass's own new slots are described by
the pass (a tree's ancestor relation) until ``keep`` compacts what each row keeps of them. The target's
cache and a drafter's own cache (heads/drafting/expansion.py) each have one.

While no slot of any row is invalid (one row; rows of one length that kept alike) the layout is *dense*:
every row's position is the slot count, the model's own causal mask is right for chains, and a tree's mask
broadcasts over the rows. The first invalid slot makes it *ragged*: positions then come per row and every
pass takes an explicit [b, 1, q, slots + t] mask, which treespec/visibility.py builds over the slots
(``slots_mask``: what a query may see has one owner; this module keeps the bookkeeping).

Axis letters: b rows, s slots held, q queries, t new slots, k kept slots.
"""

from __future__ import annotations

import torch
from einops import rearrange, repeat

from treespec.cache import keep_row_paths, select_rows


class RowSlots:
    """The slot axis of one cache shared by ``batch`` rows (on ``device``)."""

    def __init__(self, batch: int, device=None):
        self.batch = batch
        self.device = device
        self.length = 0                        # slots held, every row alike
        self.counts = [0] * batch              # each row's valid slots: its tokens in the cache, its next position
        self._valid: torch.Tensor | None = None  # BoolTensor [b, ≥ length] once ragged; None while dense

    @property
    def ragged(self) -> bool:
        """Whether some slot of some row is invalid (padding or a hole)."""
        return self._valid is not None

    @property
    def valid(self) -> torch.Tensor | None:
        """BoolTensor [b, s]: which held slots hold a token of the row; None while dense (all of them)."""
        return None if self._valid is None else self._valid[:, : self.length]

    def _reserve(self, width: int) -> None:
        """Make room for ``width`` more slots of validity (ragged layouts), doubling like the caches."""
        needed = self.length + width
        if self._valid is None:
            self._valid = torch.ones(self.batch, max(256, 2 * needed), dtype=torch.bool, device=self.device)
        elif self._valid.shape[1] < needed:
            grown = torch.zeros(self.batch, 2 * needed, dtype=torch.bool, device=self.device)
            grown[:, : self.length] = self._valid[:, : self.length]
            self._valid = grown

    def append(self, width: int, counts: list[int] | None = None) -> None:
        """``width`` new slots: row b's first ``counts[b]`` valid, the rest holes (None: all valid)."""
        if counts is not None and any(c != width for c in counts):
            self._reserve(width)
            self._valid[:, self.length : self.length + width] = \
                torch.arange(width, device=self.device)[None] < torch.tensor(counts, device=self.device)[:, None]
        else:
            counts = [width] * self.batch
            if self._valid is not None:
                self._reserve(width)
                self._valid[:, self.length : self.length + width] = True
        self.counts = [n + c for n, c in zip(self.counts, counts, strict=True)]
        self.length += width

    def append_prompts(self, attention_mask: torch.Tensor | None, width: int) -> None:
        """A prefill's ``width`` slots: the prompts as ``attention_mask`` [b, width] says (left padding; None:
        no padding)."""
        if attention_mask is None:
            self.append(width)
            return
        self._reserve(width)
        self._valid[:, self.length : self.length + width] = attention_mask.bool()
        self.counts = [n + c for n, c in zip(self.counts, attention_mask.sum(-1).tolist(), strict=True)]
        self.length += width

    def positions(self, offsets: torch.Tensor) -> torch.Tensor:
        """LongTensor [b or 1, n]: each row's next position (its valid slots) + ``offsets`` [n] or [b, n]."""
        offsets = offsets.to(self.device)
        if not self.ragged:
            return self.length + (offsets if offsets.dim() == 2 else offsets[None])
        return torch.tensor(self.counts, device=self.device)[:, None] + offsets

    def keep(self, cache, keeps: list[list[int]]) -> None:
        """A pass appended slots after the held ones; row b keeps those at offsets ``keeps[b]`` (increasing)
        and ``cache`` is compacted to them (``keep_row_paths``); a row keeping fewer than the most leaves holes."""
        width = keep_row_paths(cache, self.length, keeps)
        self.append(width, [len(keep) for keep in keeps])

    def select(self, rows: torch.Tensor, cache=None) -> None:
        """Keep the batch rows ``rows`` [b'] (LongTensor, in that order), of ``cache`` too when given."""
        if cache is not None:
            select_rows(cache, rows)
        picked = rows.tolist()
        self.batch, self.counts = len(picked), [self.counts[i] for i in picked]
        if self._valid is not None:
            self._valid = self._valid.index_select(0, rows.to(self._valid.device))


def right_aligned(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """x [b, P, ...] with row b's entries in its last ``lengths[b]`` positions (left padding) → [b, max(lengths),
    ...] with them first (right padding, whatever follows)."""
    width, padded = max(lengths), x.shape[1]
    if all(n == padded for n in lengths):
        return x
    start = torch.tensor([padded - n for n in lengths], device=x.device)[:, None]  # [b, 1]
    index = (start + torch.arange(width, device=x.device)[None]).clamp(max=padded - 1)  # [b, w]
    return gather_positions(x, index)


def gather_positions(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [b, n, ...] at each row's positions ``index`` [b, k] → [b, k, ...]."""
    rest = x.shape[2:]
    flat = rearrange(x, "b n ... -> b n (...)") if rest else x[..., None]
    picked = flat.gather(1, repeat(index.to(x.device), "b k -> b k f", f=flat.shape[-1]))
    return picked.reshape(*index.shape, *rest)


def gather_last(x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """x [b, n, ...] → [b, ...]: row b's entry ``counts[b] − 1`` (the last of its right-padded entries)."""
    if all(c == x.shape[1] for c in counts):
        return x[:, -1]
    return gather_positions(x, torch.tensor(counts, device=x.device)[:, None] - 1)[:, 0]
