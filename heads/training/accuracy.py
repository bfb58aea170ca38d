"""Per-depth rank accuracies of a drafter: acc[d][r], the chance that its rank-r candidate at draft depth
d + 1 is the token the target emits at that node's parent (treespec.walker.rank_acceptance: greedy, the
target's argmax; sampling, p_target of it, EAGLE-2's sibling rule). Ranks are mutually exclusive, as
analysis.grow_tree expects, so they drive accuracy-grown static trees and predicted speedups.

Each drafter kind measures its own (``rank_accuracy`` in its module, teacher forced on held-out
windows); this module holds what they share: the counter, and the one file the numbers live in beside
a trained drafter's weights. ``first_root``: the first root scored (a root is the last accepted token; a draft
at depth d + 1 from root j guesses token j + d + 1), so that a window opening with prompt text (a comparison's
held-out continuations keep their whole prompt as context) is scored only where decoding drafts: on the target's
own continuation.

Each depth is scored over every root that reaches it, not only over the roots whose chain was accepted up to
there. Acceptance comes in runs, so the product of these rates under-predicts long chains where the drafter's
hits cluster, but the rates conditioned on the chain's own path over-predict them by as much: decoding jumps over
an easy run in one step and spends its steps at the misses, while every root of a run counts once in either
table. On the shipped EAGLE's held-out code continuations the conditioned rates over-predicted chain τ by more
than these (docs/results.md, "Predictions on a user-built chat target").
"""

from __future__ import annotations

from pathlib import Path

import torch

from treespec.io import atomic_write_json, read_json
from treespec.sampling import Sampling
from treespec.walker import rank_acceptance

ACCURACY_FILE = "head_accuracy.json"


class RankHits:
    """Accumulates acc[d][r] over batches: ``add(d, candidates [..., R], target_logits [..., V])``.

    Counts are float64: in float32, 247/248 + 1/248 sums to 1 + 4e-9 and a depth whose top-k covers every
    position would break ranks' mutual exclusivity (analysis.grow_tree refuses a row summing above 1)."""

    def __init__(self, depth: int, top_k: int, sampling: Sampling):
        self.hits = torch.zeros(depth, top_k, dtype=torch.float64)  # [D, R]
        self.counts = torch.zeros(depth, dtype=torch.float64)       # [D]
        self.sampling = sampling

    def add(self, depth: int, candidates: torch.Tensor, target_logits: torch.Tensor) -> None:
        accepted = rank_acceptance(candidates, target_logits, self.sampling)  # [..., R]
        self.hits[depth] += accepted.reshape(-1, accepted.shape[-1]).double().sum(0).cpu()
        self.counts[depth] += accepted.numel() // accepted.shape[-1]

    def add_blocks(self, candidates: torch.Tensor, roots: torch.Tensor, target_logits: torch.Tensor) -> None:
        """A block drafter's ``candidates`` [b, m, D, R] at depths 1..D of blocks rooted at window positions
        ``roots`` [m], against the target's ``target_logits`` [b, S, V] on the window: depth d + 1 from root a guesses
        token a + d + 1, scored where that lies in the window."""
        s = target_logits.shape[1]
        for d in range(candidates.shape[2]):
            keep = roots + d + 1 < s
            if keep.any():
                self.add(d, candidates[:, keep, d], target_logits[:, roots[keep] + d])

    def table(self) -> list[list[float]]:
        """acc[d][r], each in [0, 1] and each depth's ranks summing to at most 1: sampled acceptances are
        float32 probabilities of distinct tokens, whose sum may pass 1 by rounding, so such a row is scaled
        back to 1."""
        acc = (self.hits / self.counts.clamp(min=1)[:, None]).clamp(0.0, 1.0)  # [D, R]
        return (acc / acc.sum(-1, keepdim=True).clamp(min=1.0)).tolist()


def write_accuracy(folder, accuracy: list[list[float]]) -> None:
    atomic_write_json(Path(folder) / ACCURACY_FILE, accuracy)


def read_accuracy(folder) -> list[list[float]] | None:
    """A trained drafter's measured accuracies (greedy), or None when its folder has none."""
    path = Path(folder) / ACCURACY_FILE
    if not path.is_file():
        return None
    acc = read_json(path, "accuracy file", list)
    if not (isinstance(acc, list) and acc and all(isinstance(row, list) and row for row in acc)):
        raise ValueError(f"accuracy file {path} must hold a non-empty list of per-depth lists of rank accuracies")
    for d, row in enumerate(acc):
        bad = [x for x in row if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 1]
        if bad:  # NaN fails 0 <= x too
            raise ValueError(f"accuracy file {path}: depth {d + 1} holds {bad[:3]}; rank accuracies are chances in "
                             "[0, 1]")
        if sum(row) > 1 + 1e-6:
            raise ValueError(f"accuracy file {path}: depth {d + 1}'s rank accuracies sum to {sum(row):.4f} > 1 "
                             "(each is the chance that one rank is the target's token)")
    return acc


def accuracy_metrics(acc: list[list[float]], prefix: str = "depth") -> dict:
    """Top-1 and top-5 per depth, for logs: {"depth1_top1": ..., "depth1_top5": ...}."""
    return {m: v for k, row in enumerate(acc) for m, v in
            ((f"{prefix}{k + 1}_top1", row[0]), (f"{prefix}{k + 1}_top5", sum(row[:5])))}
