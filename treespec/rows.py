"""A batch's rows: what the loop keeps per row (``BatchRows``), and their slots on one cache axis (``RowSlots``).

``BatchRows`` is the one owner of the rows still decoding (treespec/generate.py): each row's committed tokens on
the device, its host bookkeeping (``Row``: prompt, length, end, root, features held), the target's hidden states
at its last committed tokens and the target cache's ``RowSlots``. A step reads it (``committed``, ``feature``,
``roots``), ``commit``s each row's walk into it, and ``retire`` drops finished rows from all of it at once
(``select``), so no list of it can fall out of step with another.

The slot layout is in treespec/cache.py's docstring ("A batch of rows"). A ``RowSlots`` describes the slots its
cache holds between passes (committed tokens, left padding, holes) and selects and compacts that cache with
them; a pass's own new slots are described by the pass (a tree's ancestor relation) until ``keep`` compacts what
each row keeps of them. The target's cache and a drafter's own cache (heads/drafting/expansion.py) each have one.

While no slot of any row is invalid (one row; rows of one length that kept alike) the layout is *dense*:
every row's position is the slot count, the model's own causal mask is right for chains, and a tree's mask
broadcasts over the rows. The first invalid slot makes it *ragged*: positions then come per row and every
pass takes an explicit [b, 1, q, slots + t] mask, which treespec/visibility.py builds over the slots
(``slots_mask``: what a query may see has one owner; this module keeps the bookkeeping).

Axis letters: b rows, s slots held, q queries, t new slots, k kept slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange, repeat

from treespec.cache import keep_row_paths, select_rows
from treespec.drafter import Committed
from treespec.walker_batch import Walked


class RowSlots:
    """The slot axis of ``cache`` shared by ``batch`` rows (on ``device``); ``keep`` and ``select`` move the cache's
    entries with the slots (no cache: the bookkeeping alone)."""

    def __init__(self, batch: int, device=None, cache=None):
        self.batch = batch
        self.device = device
        self.cache = cache
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

    def keep(self, keeps: list[list[int]]) -> None:
        """A pass appended slots after the held ones; row b keeps those at offsets ``keeps[b]`` (increasing)
        and the cache is compacted to them (``keep_row_paths``); a row keeping fewer than the most leaves holes."""
        width = keep_row_paths(self.cache, self.length, keeps)
        self.append(width, [len(keep) for keep in keeps])

    def select(self, rows: torch.Tensor) -> None:
        """Keep the batch rows ``rows`` [b'] (LongTensor on the host, in that order), of the cache too."""
        if self.cache is not None:
            select_rows(self.cache, rows)
        picked = rows.tolist()
        self.batch, self.counts = len(picked), [self.counts[i] for i in picked]
        if self._valid is not None:
            self._valid = self._valid.index_select(0, rows.to(self._valid.device))


@dataclass(slots=True)
class Row:
    """One decoding row's host bookkeeping (what the loop knows without reading the device)."""

    prompt: int  # the prompt it decodes: its index in the batch as given
    length: int  # tokens committed, prompt included; its root is the last
    end: int     # prompt + max_new_tokens: no token of the row is committed at or after it
    root: int    # its root token, on the host (the eos test; on the device: BatchRows.tokens)
    fed: int     # its entries of BatchRows.features (the root's feature is the last)


class BatchRows:
    """The rows still decoding, in order (module docstring): ``rows`` (``Row`` each), ``tokens`` [b, L] (row b's
    committed tokens, its prompt without padding then generated ones, in its first ``rows[b].length`` entries),
    ``features`` [b, k, L·h] or None (the target's hidden states at the last tokens each row committed, its first
    ``rows[b].fed``), ``slots`` (the target cache's, which they select and compact). A finished row's tokens move
    to ``done``; ``accept_lengths`` and ``passes`` count the verification passes."""

    def __init__(self, prompts: torch.Tensor, lengths: list[int], roots: torch.Tensor, max_new_tokens: int,
                 slots: RowSlots, features: torch.Tensor | None, history: int | None = None):
        """After the prefill: the prompts [b, P] (left-padded: row b's last ``lengths[b]`` entries), each row's first
        root [b] (on the device) and the prompts' features [b, P, L·h], whose last one produced it. ``history``
        (the deepest tree + 1): keep every committed token's features too, in ``history`` [b, L, L·h] (row b's first
        ``rows[b].length − 1``: each of its tokens before its root), for a drafter that starts again mid-generation
        (treespec/generate.py, ``resume_drafter``); None: keep only the last ones."""
        batch, width = prompts.shape
        device = prompts.device
        self.tokens = torch.zeros(batch, max(lengths) + max_new_tokens, dtype=torch.long, device=device)  # [b, L]
        self.tokens[:, : max(lengths)] = right_aligned(prompts, lengths)
        self.tokens[torch.arange(batch, device=device), torch.tensor(lengths, device=device)] = roots.to(device)
        self.rows = [Row(b, n + 1, n + max_new_tokens, root, width)
                     for b, (n, root) in enumerate(zip(lengths, roots.tolist(), strict=True))]
        self.features, self.slots = features, slots
        self.history = None
        if history is not None and features is not None:
            self.history = features.new_zeros(batch, self.tokens.shape[1] + history, features.shape[-1])
            self.history[:, : max(lengths)] = right_aligned(features, lengths)
        self.accept_lengths: list[list[int]] = [[] for _ in range(batch)]  # per prompt: tokens committed per pass
        self.done: dict[int, torch.Tensor] = {}  # prompt → its committed tokens, once finished
        self.passes = 0  # batched verification passes

    def __len__(self) -> int:
        return len(self.rows)

    # -- what a step reads ----------------------------------------------------------------------------------------
    @property
    def committed(self) -> Committed:
        """The drafter's view of the rows: their committed tokens, each row's root last."""
        return Committed(self.tokens, [row.length for row in self.rows])

    @property
    def feature(self) -> torch.Tensor | None:
        """[b, L·h]: the target's hidden state that produced each root (a feature drafter's input)."""
        return None if self.features is None else gather_last(self.features, [row.fed for row in self.rows])

    def roots(self) -> torch.Tensor:
        """LongTensor [b, 1]: each row's root, from its committed tokens on the device."""
        first = self.rows[0].length
        if all(row.length == first for row in self.rows):
            return self.tokens[:, first - 1 : first]
        return self.tokens.gather(1, torch.tensor([row.length for row in self.rows], device=self.tokens.device
                                                  )[:, None] - 1)

    def headroom(self) -> int:
        """The most tokens a row may still commit after its root."""
        return max(row.end - row.length for row in self.rows)

    # -- what a step changes --------------------------------------------------------------------------------------
    def commit(self, walked: Walked, features: torch.Tensor | None, eos: frozenset[int]) -> list[list[int]]:
        """Append each row's accepted path's tokens and its next token, up to its end and its first eos (``walked``:
        read on the host, copied from the device), and keep the hidden states (``features`` [b, N, L·h]) of each
        row's root and accepted nodes → the tree-node offsets each row's cache keeps, root first (the caller
        compacts the target's cache to them: treespec/target_passes.py)."""
        keeps, starts = [], []
        for b, (row, accepted) in enumerate(zip(self.rows, walked.rows, strict=True)):
            keeps.append([0, *accepted.path])
            starts.append(row.length - 1)  # the root's position: its feature and its accepted nodes' follow
            new = until_eos(accepted.tokens, eos)[: row.end - row.length]
            self.tokens[b, row.length : row.length + len(new)] = walked.tokens[b, : len(new)]  # device to device
            row.length += len(new)
            row.root, row.fed = new[-1], len(keeps[-1])
            self.accept_lengths[row.prompt].append(len(new))
        self.features = kept_entries(features, keeps)  # [b, 1 + k_max, L·h]: each row's root's, then its accepted
        if self.history is not None:  # each row's entries from its root's position on, one scatter for the batch;
            # a shorter row's repeated tail lands at or past its new root, which no prefill reads and later commits
            # overwrite
            width, device = self.features.shape[1], self.features.device
            at = torch.tensor(starts, device=device)[:, None] + torch.arange(width, device=device)[None]  # [b, w]
            self.history.scatter_(1, repeat(at, "b w -> b w f", f=self.features.shape[-1]), self.features)
        self.passes += 1
        return keeps

    def retire(self, eos: frozenset[int]) -> torch.Tensor | None:
        """Rows whose root is an eos or that reached their end leave the batch, their tokens to ``done`` → the rows
        kept (a LongTensor on the host, for a drafter's ``keep_rows``), or None when none finished or none is left."""
        finished = [b for b, row in enumerate(self.rows) if row.root in eos or row.length >= row.end]
        if not finished:
            return None
        for b in finished:
            self.done[self.rows[b].prompt] = self.tokens[b, : self.rows[b].length]
        keep = [b for b in range(len(self.rows)) if b not in finished]
        if not keep:
            self.rows = []
            return None
        rows = torch.tensor(keep)  # on the host: who reads it (the slots, a drafter's row lists) waits for nothing
        self.select(rows)
        return rows

    def select(self, rows: torch.Tensor) -> None:
        """Keep the rows ``rows`` [b'] (LongTensor on the host, in that order): their bookkeeping, tokens, features,
        slots and the target's cache."""
        self.slots.select(rows)
        self.tokens = self.tokens.index_select(0, rows.to(self.tokens.device))
        if self.features is not None:
            self.features = self.features.index_select(0, rows.to(self.features.device))
        if self.history is not None:
            self.history = self.history.index_select(0, rows.to(self.history.device))
        self.rows = [self.rows[b] for b in rows.tolist()]


def right_aligned(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """x [b, P, ...] with row b's entries in its last ``lengths[b]`` positions (left padding) → [b, max(lengths),
    ...] with them first (right padding, whatever follows)."""
    width, padded = max(lengths), x.shape[1]
    if all(n == padded for n in lengths):
        return x
    start = torch.tensor([padded - n for n in lengths], device=x.device)[:, None]  # [b, 1]
    index = (start + torch.arange(width, device=x.device)[None]).clamp(max=padded - 1)  # [b, w]
    return gather_positions(x, index)


def left_aligned(x: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """x [b, n, ...] with row b's entries first, ``lengths[b]`` of them (right padding) → ([b, max(lengths), ...] with
    them last, left-padded with row b's first entry; BoolTensor [b, max(lengths)], True on them): the layout
    a prefill takes."""
    width = max(lengths)
    pad = torch.tensor([width - n for n in lengths], device=x.device)[:, None]  # [b, 1]
    offsets = torch.arange(width, device=x.device)[None]  # [1, w]
    index = (offsets - pad).clamp(min=0)  # [b, w]
    return gather_positions(x, index), offsets >= pad


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


def until_eos(tokens: list[int], eos: frozenset[int]) -> list[int]:
    """``tokens`` up to and including the first end-of-sequence token."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


def kept_entries(features: torch.Tensor | None, keeps: list[list[int]]) -> torch.Tensor | None:
    """features [b, N, L·h] → each row's entries at its tree nodes ``keeps[b]``, first [b, max len, L·h] (a shorter
    row's tail repeats its last): a view when every row keeps a chain prefix, else a gather."""
    if features is None:
        return None
    width = max(len(keep) for keep in keeps)
    if all(keep == list(range(len(keep))) for keep in keeps):
        return features[:, :width]
    if all(keep == keeps[0] for keep in keeps[1:]):
        return features[:, torch.tensor(keeps[0], device=features.device)]
    index = torch.tensor([keep + keep[-1:] * (width - len(keep)) for keep in keeps], device=features.device)
    return gather_positions(features, index)
