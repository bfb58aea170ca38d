"""Whole generations of a batch: the predicted speedup of B prompts decoded at once, rows leaving as they finish.

A per-step prediction (``autotree.predict``: τ ÷ a step's cost, against a vanilla step) is what one row gains. A batch
gains less, for reasons a step does not show:

- **The slowest row sets the time.** Rows accept different lengths every step, so they need different numbers of
  passes; the batch runs until its last row ends, which takes more passes than the mean row needs. Vanilla decoding
  ends every row at the same step (no eos).
- **The batch thins out.** A row that ends leaves the batch (treespec/generate.py, ``retire``): the last passes run
  fewer rows, at the cost of fewer rows, and with a ``TreesByBatch`` (treespec/batch_trees.py) another tree.
- **The prefill** of the B prompts is paid by both, once (``autotree.predict_generation`` at B = 1).
- **Ragged rows cost more than rows alike.** Rows that keep different paths leave holes on the shared slot axis:
  every pass then takes an explicit mask, compaction gathers per row, and the walk runs per row. That is part of
  each step's engine cost when it is measured with rows that accept differently (engine_cost.py, ``ragged``).

So the prediction simulates the generation (Monte Carlo, ``simulations`` runs): each step, every row left draws how
many tokens it commits from the accept-length distribution of that step's tree (``accept_distribution``: from the
rank accuracies, the same estimate as τ), the step costs a pass at the number of rows left (``BatchCosts``: cost
models measured at several B, interpolated between them), and a row leaves once it has its tokens. The speedup is
vanilla's time over the mean simulated time, both with the prefill.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from treespec.batch_trees import TreesByBatch
from treespec.dynamic_tree import DynamicTree
from treespec.planning.analysis import expected_tokens_per_round, reach_by_depth
from treespec.planning.autotree import CostModel, RankAccuracy, tau_source
from treespec.tree import Tree


def accept_distribution(tree: Tree | DynamicTree, accuracy) -> list[float]:
    """P(a step verifying ``tree`` commits 1 + k tokens), k = 0 .. depth. From rank accuracies (``RankAccuracy``):
    P(k ≥ d) is the sum of the depth-d nodes' path probabilities (siblings exclude each other), the estimate τ is
    made from. From a source that knows τ only (a chain τ table, τ measured by a dry run): the chain whose equal
    per-depth rate gives that τ over the tree's depth."""
    depth = tree.depth
    if depth == 0:
        return [1.0]
    source = tau_source(accuracy)
    if isinstance(source, RankAccuracy) and isinstance(tree, Tree):
        at_least = reach_by_depth(tree, source.accuracy)  # [D + 1]: P(k >= d)
    else:
        rate = _rate_for(source.tau(tree), depth)
        at_least = [rate**d for d in range(depth + 1)]
    at_least.append(0.0)
    return [max(0.0, at_least[d] - at_least[d + 1]) for d in range(depth + 1)]


def _rate_for(tau: float, depth: int) -> float:
    """The per-depth acceptance rate α with (1 − α^(depth+1)) / (1 − α) = τ (bisection; τ clipped to [1, depth + 1])."""
    tau = min(max(tau, 1.0), depth + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_round(mid, depth) < tau else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class BatchCosts:
    """Cost models measured at several batch sizes {B: CostModel} (each over B × N tokens, its engine and drafting at B
    rows); a batch of b rows between two of them costs the straight line between their costs (beyond the largest, the
    line through the two largest; below the smallest, the smallest's)."""

    by_size: dict[int, CostModel]

    def _between(self, rows: int, cost) -> float:
        sizes = sorted(self.by_size)
        if rows <= sizes[0] or len(sizes) == 1:  # below the smallest size measured: its cost, the cautious guess
            return cost(self.by_size[sizes[0]])
        lo = max((s for s in sizes if s <= rows), default=sizes[0]) if rows < sizes[-1] else sizes[-2]
        hi = min(s for s in sizes if s > lo)
        a, b = cost(self.by_size[lo]), cost(self.by_size[hi])
        return a + (b - a) * (rows - lo) / (hi - lo)

    def vanilla(self, rows: int) -> float:
        """Seconds of a vanilla step over ``rows`` rows."""
        return self._between(rows, lambda c: c.vanilla())

    def step(self, rows: int, tree, sizes: dict[int, float] | None = None) -> float:
        """Seconds of a speculative step over ``rows`` rows verifying ``tree`` (``sizes``: the share of passes at
        each number of nodes, for a tree measured by a dry run; default all of it)."""
        sizes = sizes or {tree.num_nodes: 1.0}
        return self._between(rows, lambda c: c.expected_step(tree, sizes))


@dataclass(frozen=True)
class BatchGenerationPrediction:
    speedup: float          # vanilla's time ÷ the mean simulated time, prefill in both
    seconds: float          # mean simulated seconds of the whole generation
    vanilla_seconds: float  # vanilla decoding's seconds of the same batch
    passes: float           # mean verification passes until the last row ends
    tau: float              # tokens committed per row and pass, over every row's passes


def predict_batch_generation(trees, accuracy, costs: BatchCosts, new_tokens: list[int], *,
                             prefill_seconds: float = 0.0, simulations: int = 200, seed: int = 0
                             ) -> BatchGenerationPrediction:
    """The predicted whole generation of a batch whose row r generates ``new_tokens[r]`` tokens (module docstring).
    ``trees``: a Tree, a DynamicTree, a TreesByBatch or a callable (rows left → tree); ``accuracy``:
    the drafter's rank accuracies or τ source; ``costs``: measured at batch sizes around len(new_tokens)."""
    tree_at = trees.at if isinstance(trees, TreesByBatch) else trees if callable(trees) else (lambda rows: trees)
    source = tau_source(accuracy) if accuracy is not None else None
    rng = random.Random(seed)
    cached: dict = {}

    def step_of(rows: int, headroom: int):
        """(tree after the loop's truncation, its accept-length CDF, its step seconds) at ``rows`` rows."""
        key = (rows, headroom)
        if key not in cached:
            whole = tree_at(rows)
            tree = whole.truncate(headroom - 1)
            if len(tree) and source is not None and not source.predicts(tree):
                tree = whole  # τ measured per tree knows the whole one; a row commits what it needs of it all the same
            if len(tree) == 0 or source is None:
                cached[key] = (None, None, costs.vanilla(rows))
            else:
                sizes = source.sizes(tree) if callable(getattr(source, "sizes", None)) else None
                cdf = torch.tensor(accept_distribution(tree, source), dtype=torch.float64).cumsum(0).tolist()
                cached[key] = (tree, cdf, costs.step(rows, tree, sizes))
        return cached[key]

    need = [max(0, n - 1) for n in new_tokens]  # the prefill commits each row's first token
    vanilla = prefill_seconds + sum(costs.vanilla(sum(1 for n in need if n > s)) for s in range(max(need, default=0)))
    total_seconds = total_passes = committed = row_passes = 0.0
    for _ in range(simulations):
        left = [n for n in need if n > 0]
        seconds, passes = prefill_seconds, 0
        while left:
            _, cdf, cost = step_of(len(left), max(left))
            seconds += cost
            passes += 1
            row_passes += len(left)
            kept = []
            for n in left:
                got = min(n, 1 + _draw(cdf, rng))
                committed += got
                if n - got > 0:
                    kept.append(n - got)
            left = kept
        total_seconds += seconds
        total_passes += passes
    mean = total_seconds / simulations
    return BatchGenerationPrediction(speedup=vanilla / mean if mean > 0 else 1.0, seconds=mean,
                                     vanilla_seconds=vanilla, passes=total_passes / simulations,
                                     tau=committed / row_passes if row_passes else 1.0)


def _draw(cdf: list[float] | None, rng: random.Random) -> int:
    """k ~ the accept-length distribution whose CDF is ``cdf`` (None: vanilla, 0)."""
    if cdf is None:
        return 0
    u = rng.random()
    return next((k for k, c in enumerate(cdf) if u < c), len(cdf) - 1)
