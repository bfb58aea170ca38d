"""Hardware-aware tree sizing: pick the tree that maximises predicted tokens/s on this device.

Verifying N tree tokens costs one target forward over N tokens, and that cost is flat only while the
device is memory-bound (on a CPU, a pass over tens of tokens costs a small multiple of a one-token pass).
A bigger tree commits more tokens per pass but each pass costs more; the best size depends on
the drafter's accuracy *and* the device. So:

    predicted speedup(tree) = τ(tree) / [(cost(N) + draft cost(tree)) / cost(1)]

with τ from the drafter's measured per-depth top-k accuracies (analysis.expected_tree_tokens_from_rank
_accuracy), cost(N) from the measured cost curve, and candidate trees grown greedily by accuracy
(analysis.grow_tree) at every node budget (Medusa's sparse trees, Cai et al. 2024; Sequoia, Chen et
al. 2024, optimises the same trade-off with a hardware-aware search).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from treespec.analysis import expected_tree_tokens_from_rank_accuracy, grow_tree
from treespec.timing import forward_time
from treespec.tree import Tree

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def measure_cost_curve(model, sizes=DEFAULT_SIZES, past_len: int = 256, repeats: int = 10,
                       before=None, batch: int = 1) -> dict[int, float]:
    """Median seconds of one target forward over N new tokens per row after ``past_len`` cached ones, for
    ``batch`` rows (a batch's cost curve is over B × N tokens). ``before``: a drafting call to run (untimed)
    ahead of each forward, so the curve is what verification costs while that drafter alternates with the
    target (its weights push the target's out of the caches)."""
    # two passes, sizes up then down, and each size's faster median: a slow spell of a shared machine during one
    # pass (once a one-token forward at 5.7 ms against 4.5 ms in the same run's decoding) does not set the curve
    passes = [{n: forward_time(model, n_tokens=n, past_len=past_len, repeats=repeats, before=before, batch=batch)
               for n in order}
              for order in (sorted(sizes), sorted(sizes, reverse=True))]
    return {n: min(p[n] for p in passes) for n in sizes}


def cost_at(curve: dict[int, float], n: int) -> float:
    """Cost of a forward over n tokens, linearly interpolated (and extrapolated) from the curve."""
    sizes = sorted(curve)
    if n in curve:
        return curve[n]
    if n <= sizes[0]:
        return curve[sizes[0]]
    lo = max(s for s in sizes if s < n) if n < sizes[-1] else sizes[-2]
    hi = min(s for s in sizes if s > n) if n < sizes[-1] else sizes[-1]
    return curve[lo] + (curve[hi] - curve[lo]) * (n - lo) / (hi - lo)


@dataclass
class Prediction:
    tree: Tree
    tau: float              # predicted tokens per verification pass
    step_cost: float        # predicted seconds per step (target verify + drafting)
    speedup: float          # predicted tokens/s over vanilla decoding


def predict(tree: Tree, accuracy, curve: dict[int, float], draft_cost_per_depth: float = 0.0,
            draft_cost_fixed: float = 0.0, baseline: float | None = None) -> Prediction:
    """Predicted τ and speedup of ``tree``. Drafting costs ``draft_cost_fixed`` + depth × per-depth seconds
    (a draft model runs one forward per depth; Medusa heads one call in all). ``baseline``: seconds per token
    of vanilla decoding (default the curve's one-token cost; pass the target-alone cost when ``curve`` was
    timed between drafting calls)."""
    baseline = cost_at(curve, 1) if baseline is None else baseline
    if not len(tree):  # no candidates: nothing is drafted, so this is vanilla decoding
        return Prediction(tree, 1.0, baseline, 1.0)
    tau = expected_tree_tokens_from_rank_accuracy(tree, accuracy)
    step = cost_at(curve, tree.num_nodes) + draft_cost_fixed + tree.depth * draft_cost_per_depth
    return Prediction(tree, tau, step, tau * baseline / step)


def choose_tree(accuracy, curve: dict[int, float], *, max_nodes: int = 64, draft_cost_per_depth: float = 0.0,
                draft_cost_fixed: float = 0.0, baseline: float | None = None) -> tuple[Prediction, list[Prediction]]:
    """The accuracy-grown tree (budgets 0..max_nodes) with the highest predicted speedup, and all
    candidates' predictions. Budget 0 is no speculation at all: when no tree is predicted to beat vanilla
    decoding (a drafter that rarely agrees with the target at this temperature), "auto" does not draft."""
    max_paths = sum(math.prod(len(row) for row in accuracy[:d]) for d in range(1, len(accuracy) + 1))
    budgets = range(0, min(max_nodes, max_paths) + 1)
    preds = [predict(grow_tree(accuracy, b), accuracy, curve, draft_cost_per_depth, draft_cost_fixed, baseline)
             for b in budgets]
    return max(preds, key=lambda p: p.speedup), preds



def auto_chooser(curve: dict[int, float], draft_cost_fixed: float = 0.0, draft_cost_per_depth: float = 0.0,
                 baseline: float | None = None):
    """The ``choose(accuracy, max_nodes) -> Tree`` that tree_spec.build_tree needs for kind "auto"."""
    def choose(accuracy, max_nodes: int) -> Tree:
        best, _ = choose_tree(accuracy, curve, max_nodes=max_nodes, draft_cost_per_depth=draft_cost_per_depth,
                              draft_cost_fixed=draft_cost_fixed, baseline=baseline)
        return best.tree

    return choose
