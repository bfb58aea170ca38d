"""Expected tokens per target pass and speedup: the analytic model behind choosing γ and trees.

Chain (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"): with
i.i.d. per-token acceptance α and γ drafted tokens, a round commits the accepted prefix plus one
target token (the residual resample, or the free bonus token when all γ are accepted), so

    E[T] = 1 + α + α² + ... + α^γ = (1 − α^(γ+1)) / (1 − α),

at a cost of γ·c + 1 target-pass equivalents (c = draft forward time / target forward time).

Trees (SpecInfer, Miao et al. 2024; Medusa, Cai et al. 2024): a round commits 1 + the number of
nodes on the accepted root-to-node path. By linearity of expectation, E[T] = 1 + Σ_nodes
P(node reached and accepted). Medusa estimates that probability as the product of per-depth, per-rank
top-k accuracies along the node's path, and grows its sparse tree greedily from it (``grow_tree``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch

from treespec.tree import Tree

# Rounding allowed in probabilities read from files or measured in float32: a rank-accuracy row that sums
# to 1 + 4e-9 (247/248 + 1/248 in float32) is a row whose ranks cover every position, not an error.
ROUNDING = 1e-6


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """E[T] = (1 − α^(γ+1)) / (1 − α): tokens committed per target pass by a γ-token chain (γ + 1 at α = 1)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance rate alpha must be in [0, 1], got {alpha}")
    if gamma < 0:
        raise ValueError(f"gamma (drafted tokens per round) must be >= 0, got {gamma}")
    if alpha == 1.0:  # the limit of the geometric sum; the closed form is 0/0 there
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speedup(alpha: float, gamma: int, c: float) -> float:
    """Walltime speedup over plain decoding, E[T] / (γc + 1), ignoring verification's extra cost over one step.

    ``c`` is the draft/target cost ratio per forward. On CPU a target pass over γ + 1 tokens is not free
    (treespec measurements: ~1.4–1.7× a one-token step at 16 tokens), which this formula does not model.
    """
    if c < 0:
        raise ValueError(f"cost ratio c must be >= 0, got {c}")
    return expected_tokens_per_round(alpha, gamma) / (gamma * c + 1.0)


def _per_node(tree: Tree, accept_prob) -> torch.Tensor:
    """accept_prob (length N, or n without the root) → float64 Tensor [N] with the root's entry set to 1."""
    p = torch.as_tensor(accept_prob, dtype=torch.float64).flatten()
    if p.numel() == len(tree):
        p = torch.cat([p.new_ones(1), p])
    if p.numel() != tree.num_nodes:
        raise ValueError(f"accept_prob needs {len(tree)} (candidates) or {tree.num_nodes} (with root) entries, "
                         f"got {p.numel()}")
    if bool(((p < 0) | (p > 1)).any()):
        raise ValueError("accept_prob entries must be probabilities in [0, 1]")
    return torch.cat([p.new_ones(1), p[1:]])


def path_probabilities(tree: Tree, accept_prob) -> torch.Tensor:
    """Float64 Tensor [N]: P(node reached and accepted) = product of accept_prob over its path (root = 1)."""
    p = _per_node(tree, accept_prob)  # [N]
    # ancestors[i, j]: j on the root-to-i path, so row i's product over those j is the path probability
    return torch.where(tree.ancestors, p[None, :], torch.ones_like(p)[None, :]).prod(dim=1)  # [N]


def expected_tree_tokens(tree: Tree, accept_prob) -> float:
    """Expected tokens committed per target pass: 1 (bonus / resample) + Σ_nodes P(node reached and accepted).

    ``accept_prob[i]``: probability that node i is accepted given its parent was reached (length N with
    the root's entry ignored, or n). Assumes at most one child of a node is accepted, as in greedy
    walking (siblings carry distinct tokens) and in rejection walking (one path survives), so siblings'
    probabilities are mutually exclusive and must sum to at most 1.
    """
    p = _per_node(tree, accept_prob)  # [N]
    sibling_sum = torch.zeros_like(p).index_add_(0, tree.parents[1:], p[1:])  # [N]: Σ over each node's children
    if bool((sibling_sum > 1 + ROUNDING).any()):
        raise ValueError("children's acceptance probabilities sum above 1 at some node; at most one child can "
                         "be accepted, so they must be mutually exclusive")
    return float(path_probabilities(tree, p).sum())  # the root's term (1) is the bonus token


def _rank_table(acc: Sequence[Sequence[float]]) -> torch.Tensor:
    """Ragged acc[d][r] → float64 Tensor [D, R], zero-padded; checks each depth's ranks sum to <= 1 (up to
    ``ROUNDING``, which is scaled away: entries clamped to [0, 1], a row over 1 divided by its sum)."""
    depths = len(acc)
    width = max((len(row) for row in acc), default=0)
    table = torch.zeros(depths, width, dtype=torch.float64)  # [D, R]
    for d, row in enumerate(acc):
        try:  # a string was "too many dimensions 'str'"
            table[d, : len(row)] = torch.as_tensor(list(row), dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"rank accuracies are acc[depth][rank] numbers; depth {d} holds {row!r}") from None
    if not bool(torch.isfinite(table).all()) or bool(((table < -ROUNDING) | (table > 1 + ROUNDING)).any()):
        raise ValueError("rank accuracies must be probabilities in [0, 1]")
    sums = table.sum(dim=1)  # [D]
    if bool((sums > 1 + ROUNDING).any()):
        raise ValueError(f"rank accuracies at one depth must sum to <= 1 (at most one rank is the accepted token), "
                         f"got sums {[round(float(x), 6) for x in sums]}")
    table = table.clamp(0.0, 1.0)
    return table / table.sum(dim=1, keepdim=True).clamp(min=1.0)


def expected_tree_tokens_from_rank_accuracy(tree: Tree, acc: Sequence[Sequence[float]]) -> float:
    """Medusa's estimate: node (depth d, rank r) is accepted given its parent with probability acc[d-1][r].

    ``acc[d][r]``: probability that the rank-r candidate at depth d + 1 is the accepted token (Medusa's
    per-head top-k accuracy, mutually exclusive across ranks). It ignores that a head's accuracy depends
    on whether earlier positions were right; measured τ is usually lower.
    """
    table = _rank_table(acc)  # [D, R]
    depth, rank = tree.depths[1:] - 1, tree.ranks[1:]  # [n], [n]
    if len(tree) and (int(depth.max()) >= table.shape[0] or int(rank.max()) >= table.shape[1]):
        raise ValueError(f"{tree!r} uses a depth or rank that acc does not cover (acc has {table.shape[0]} depths)")
    return expected_tree_tokens(tree, table[depth, rank])


def reach_by_depth(tree: Tree, acc: Sequence[Sequence[float]]) -> list[float]:
    """P(a step's accepted path reaches depth d), d = 0 .. tree.depth, from Medusa's estimate (as
    ``expected_tree_tokens_from_rank_accuracy``): the sum of the depth-d nodes' path probabilities, siblings being
    exclusive. Its sum is that estimate of τ; its differences, the distribution of accepted lengths."""
    table = _rank_table(acc)  # [D, R]
    reach = path_probabilities(tree, table[tree.depths[1:] - 1, tree.ranks[1:]])  # [N]
    return [float(reach[tree.depths == d].sum()) for d in range(tree.depth + 1)]


def grow_tree(acc: Sequence[Sequence[float]], budget: int) -> Tree:
    """Medusa's sparse tree: the ``budget`` candidate paths with the largest P(path accepted), greedily.

    P(path (r0, r1, ...)) = acc[0][r0] · acc[1][r1] · ...; a path is a candidate once its parent is in
    the tree. A child never beats its parent (probabilities <= 1), so the greedy set is also the global
    top-``budget`` set and maximises ``expected_tree_tokens_from_rank_accuracy`` among trees of that size.
    Ties go to the shorter, then lexicographically smaller path.
    """
    table = _rank_table(acc)  # [D, R]
    available = sum(math.prod(len(acc[d]) for d in range(k)) for k in range(1, len(acc) + 1))
    if not 0 <= budget <= available:
        raise ValueError(f"budget must be in [0, {available}] (all paths acc allows), got {budget}")

    def children(path: tuple[int, ...], prob: float):
        depth = len(path)
        if depth < len(acc):
            for r in range(len(acc[depth])):
                child = (*path, r)
                yield (-prob * float(table[depth, r]), len(child), child)

    frontier = list(children((), 1.0))  # heap of (−P(path), length, path)
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while len(chosen) < budget:
        neg_prob, _, path = heapq.heappop(frontier)
        chosen.append(path)
        for item in children(path, -neg_prob):
            heapq.heappush(frontier, item)
    return Tree(chosen)
