"""What generate() returns: the sequences shaped as transformers' generate returns them, and per row what
speculation did (acceptance lengths, τ, new tokens); one prompt keeps the single-sequence fields."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from treespec.dynamic_tree import DynamicTree
from treespec.tree import Tree


@dataclass
class RowResult:
    """One row of a batch."""

    prompt_length: int                                       # the row's prompt tokens, padding excluded
    new_tokens: int                                          # tokens it generated (up to its eos or the budget)
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per verification pass it took part in

    @property
    def mean_accept_length(self) -> float:
        """The row's τ: mean tokens committed per verification pass, bonus token included."""
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))


class TimedRun:
    """What a timed generation derives from its ``new_tokens``, ``wall_time``, ``target_time`` and ``draft_time``
    (GenerationResult here, a comparison's stored treespec.planning.bench.Measured)."""

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else float("nan")

    @property
    def overhead_time(self) -> float:
        """Seconds spent outside target and drafter calls: masks, walking, cache compaction, glue."""
        return self.wall_time - self.target_time - self.draft_time


@dataclass
class GenerationResult(TimedRun):
    sequences: torch.Tensor                          # LongTensor [b, P + T], as transformers' generate (see below)
    prompt_length: int                               # P: the prompts' columns (left padding included)
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per verification pass (see below)
    wall_time: float = 0.0                           # seconds, prefill included
    target_time: float = 0.0                         # seconds inside target forwards (with an observer)
    draft_time: float = 0.0                          # seconds inside drafter calls (with an observer)
    update_time: float = 0.0                         # of which updating it from verified passes (an index)
    walk_time: float = 0.0                           # seconds in the walker, part of overhead_time (observer)
    rows: list[RowResult] = field(default_factory=list)  # per row, in the prompts' order
    passes: int | None = None                        # batched verification passes (None: len(accept_lengths))
    tree: Tree | DynamicTree | None = None           # the tree every step verified (Tree / DynamicTree): what a
    #                                                  spec such as {"kind": "auto"} resolved to; Tree.chain(0) when
    #                                                  nothing was drafted
    prefill_time: float = 0.0                        # seconds of the prefill (target and drafter), in wall_time
    prefill_target_time: float = 0.0                 # of which in the target's forward, in target_time (observer)
    prefill_draft_time: float = 0.0                  # and in the drafter's prefill, in draft_time (observer)

    # ``sequences``: the prompts as given (left padding kept), then each row's new tokens and, after a row's eos,
    # the pad id up to T, the longest row's new tokens. ``accept_lengths``: one row's, or every row's one row
    # after another (so τ and histograms pool the rows).

    @property
    def batch_size(self) -> int:
        return self.sequences.shape[0]

    @property
    def target_passes(self) -> int:
        """Verification passes (the prefill, which commits the first token, is not counted); a batch's passes
        verify every row still decoding at once."""
        return len(self.accept_lengths) if self.passes is None else self.passes

    @property
    def mean_accept_length(self) -> float:
        """τ: mean tokens committed per verification pass, bonus token included (over every row's passes)."""
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    @property
    def new_tokens(self) -> int:
        """Tokens generated, over every row (a row's padding after its eos excluded)."""
        if not self.rows:  # a peer's result (transformers' generate) without rows
            return self.sequences.shape[1] - self.prompt_length
        return sum(row.new_tokens for row in self.rows)

