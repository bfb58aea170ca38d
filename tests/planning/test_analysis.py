"""treespec.planning.analysis: the seed's worked numbers (Leviathan et al. 2023), tree expectations, Medusa's tree
growth."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from treespec.planning.analysis import (
    expected_tokens_per_round,
    expected_tree_tokens,
    expected_tree_tokens_from_rank_accuracy,
    grow_tree,
    path_probabilities,
    speedup,
)
from treespec.tree import Tree

# c = 0.08 (draft/target cost) is the seed's ratio; it also reproduces its α = 0.4 speedups:
# 1.6496 / (4·0.08 + 1) = 1.2497 ≈ 1.25 and 1.6662 / (8·0.08 + 1) = 1.0160.
C = 0.08


@pytest.mark.parametrize(
    "alpha, gamma, tokens, tokens_decimals, gain, gain_tol",
    [
        (0.7, 4, 2.7731, 4, 2.10, 0.005),
        (0.85, 3, 3.187, 3, None, None),
        (0.4, 4, 1.6496, 4, 1.25, 0.005),
        (0.4, 8, 1.6662, 4, 1.016, 0.0005),
    ],
)
def test_seed_worked_numbers(alpha, gamma, tokens, tokens_decimals, gain, gain_tol):
    assert round(expected_tokens_per_round(alpha, gamma), tokens_decimals) == tokens
    if gain is not None:
        assert speedup(alpha, gamma, C) == pytest.approx(gain, abs=gain_tol)


def test_chain_limits_and_validation():
    assert expected_tokens_per_round(1.0, 5) == 6.0
    assert expected_tokens_per_round(0.0, 5) == 1.0
    assert expected_tokens_per_round(0.999999, 5) == pytest.approx(6.0, abs=1e-4)  # continuous at α → 1
    assert expected_tokens_per_round(0.5, 0) == 1.0
    assert speedup(0.7, 4, 0.0) == expected_tokens_per_round(0.7, 4)
    for bad in [(-0.1, 3), (1.1, 3), (0.5, -1)]:
        with pytest.raises(ValueError):
            expected_tokens_per_round(*bad)
    with pytest.raises(ValueError):
        speedup(0.5, 3, -0.1)


@pytest.mark.parametrize("alpha", [0.0, 0.4, 0.7, 1.0])
@pytest.mark.parametrize("gamma", [0, 1, 4])
def test_chain_tree_equals_closed_form(alpha, gamma):
    tree = Tree.chain(gamma)
    assert expected_tree_tokens(tree, [alpha] * gamma) == pytest.approx(expected_tokens_per_round(alpha, gamma))
    # length-N form: the root's entry is ignored
    assert expected_tree_tokens(tree, [0.123] + [alpha] * gamma) == pytest.approx(
        expected_tokens_per_round(alpha, gamma))


def test_path_probabilities_by_hand():
    tree = Tree.from_paths([(0,), (1,), (0, 0)])  # nodes: 1=(0,), 2=(1,), 3=(0,0)
    probs = path_probabilities(tree, [0.5, 0.3, 0.4])
    assert probs.tolist() == pytest.approx([1.0, 0.5, 0.3, 0.2])
    assert expected_tree_tokens(tree, [0.5, 0.3, 0.4]) == pytest.approx(2.0)


def test_tree_probabilities_validated():
    tree = Tree.from_paths([(0,), (1,)])
    with pytest.raises(ValueError, match="sum above 1"):
        expected_tree_tokens(tree, [0.7, 0.6])  # siblings are mutually exclusive
    with pytest.raises(ValueError, match="entries"):
        expected_tree_tokens(tree, [0.5])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        expected_tree_tokens(tree, [-0.1, 0.5])


def _simulate(tree: Tree, accept_prob: list[float], rounds: int, seed: int) -> float:
    """Walk the tree: at each node at most one child is accepted, child c with probability accept_prob[c]."""
    rng = random.Random(seed)
    total = 0
    for _ in range(rounds):
        node, tokens = 0, 1  # the bonus / resampled token is always committed
        while True:
            u, acc = rng.random(), 0.0
            for child in tree.children[node]:
                acc += accept_prob[child]
                if u < acc:
                    node, tokens = child, tokens + 1
                    break
            else:
                break
        total += tokens
    return total / rounds


def test_tree_expectation_matches_monte_carlo():
    tree = Tree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0)])
    accept_prob = [1.0, 0.5, 0.25, 0.1, 0.6, 0.3, 0.7, 0.5, 0.4, 0.9]  # [N]; siblings sum <= 1
    rounds = 20_000
    simulated = _simulate(tree, accept_prob, rounds, seed=0)
    exact = expected_tree_tokens(tree, accept_prob)
    # tokens per round lie in [1, 4], so the std of the mean is < 1.5 / sqrt(rounds) ≈ 0.011
    assert simulated == pytest.approx(exact, abs=0.04)


ACC = [[0.6, 0.2, 0.1], [0.5, 0.2]]  # acc[d][r]: per-depth, per-rank accuracy (each depth sums <= 1)


def test_rank_accuracy_expectation():
    tree = Tree.from_paths([(0,), (1,), (0, 0), (0, 1)])
    expected = 1 + 0.6 + 0.2 + 0.6 * 0.5 + 0.6 * 0.2
    assert expected_tree_tokens_from_rank_accuracy(tree, ACC) == pytest.approx(expected)
    with pytest.raises(ValueError, match="does not cover"):
        expected_tree_tokens_from_rank_accuracy(Tree.chain(3), ACC)
    with pytest.raises(ValueError, match="sum to <= 1"):
        expected_tree_tokens_from_rank_accuracy(tree, [[0.6, 0.5], [0.1]])


def test_grow_tree_by_hand():
    # candidates: (0,) .6  (0,0) .3  (1,) .2  (0,1) .12  (2,) .1  (1,0) .1  (2,0) .05  (1,1) .04 ...
    assert grow_tree(ACC, 4) == Tree.from_paths([(0,), (1,), (0, 0), (0, 1)])
    assert grow_tree(ACC, 1) == Tree.chain(1)
    assert grow_tree(ACC, 0) == Tree.chain(0)
    full = grow_tree(ACC, 9)  # everything acc allows: 3 + 3·2
    assert len(full) == 9 and full.top_k_per_depth() == [3, 2]
    with pytest.raises(ValueError, match="budget"):
        grow_tree(ACC, 10)


def _prefix_closed(paths) -> bool:
    chosen = set(paths)
    return all(len(p) == 1 or p[:-1] in chosen for p in paths)


@pytest.mark.parametrize("budget", [1, 2, 3, 5, 7])
def test_grow_tree_is_optimal(budget):
    acc = [[0.45, 0.3, 0.1], [0.7, 0.1], [0.5, 0.4]]
    tree = grow_tree(acc, budget)
    assert len(tree) == budget
    assert (tree.parents[1:] < torch.arange(1, budget + 1)).all()  # a valid tree: parents precede children
    best = expected_tree_tokens_from_rank_accuracy(tree, acc)
    candidates = grow_tree(acc, 3 + 6 + 12).paths
    for subset in itertools.combinations(candidates, budget):  # brute force over all trees of this size
        if _prefix_closed(subset):
            assert expected_tree_tokens_from_rank_accuracy(Tree(subset), acc) <= best + 1e-12
