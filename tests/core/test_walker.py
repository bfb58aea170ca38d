"""The walker (treespec/walker.py): greedy exactness, exact losslessness of sampling, typical acceptance.

Losslessness is tested on the committed *tokens*, not on the walker's internals: for a tiny vocabulary
and tree, the distribution of the first two committed tokens must equal the target's own
P(a, b) = p(a | root) · p(b | root, a), checked with a chi-square test over many walks; a deliberately
wrong walker must fail the same test (negative controls), which shows the test has power.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treespec import walker, walker_batch
from treespec.drafter import Proposal
from treespec.sampling import probs, sample
from treespec.tree import Tree
from treespec.walker import Walk, walk

from tests.helpers import ALPHA, GREEDY, T07, T1, UNEVEN, World, chi2_pvalue, first_two_counts, logits_with_argmax


# -- greedy ---------------------------------------------------------------------------------------
def test_greedy_full_accept():
    tree = Tree.chain(3)
    tokens = torch.tensor([5, 6, 7])
    logits = logits_with_argmax([5, 6, 7, 1], 8)
    w = walk(logits, Proposal(tree, tokens), GREEDY)
    assert w.path.tolist() == [1, 2, 3] and w.next_token == 1


def test_greedy_partial_and_none():
    tree = Tree.chain(3)
    tokens = torch.tensor([5, 6, 7])
    w = walk(logits_with_argmax([5, 0, 7, 1], 8), Proposal(tree, tokens), GREEDY)
    assert w.path.tolist() == [1] and w.next_token == 0
    w = walk(logits_with_argmax([3, 6, 7, 1], 8), Proposal(tree, tokens), GREEDY)
    assert w.path.tolist() == [] and w.next_token == 3
    assert w.path.dtype == torch.long


def test_greedy_picks_deepest_branch():
    # Siblings 1 and 2 both carry the argmax 4 (a duplicate); only node 2's subtree continues.
    tokens = torch.tensor([4, 4, 9, 1, 2, 3, 6, 5])
    argmax = [4, 8, 6, 0, 0, 0, 0, 7, 0]  # node 1's children (1, 2, 3) miss 8; node 7's token 6 matches
    w = walk(logits_with_argmax(argmax, 10), Proposal(UNEVEN, tokens), GREEDY)
    assert w.path.tolist() == [2, 7] and w.next_token == 7
    # Make node 1's branch match two deep (1 → 4 → 8): now it wins.
    argmax = [4, 1, 6, 0, 5, 0, 0, 7, 3]
    w = walk(logits_with_argmax(argmax, 10), Proposal(UNEVEN, tokens), GREEDY)
    assert w.path.tolist() == [1, 4, 8] and w.next_token == 3


def test_greedy_tie_first_in_node_order():
    tree = Tree.full(2, 1)
    w = walk(logits_with_argmax([3, 0, 1], 4), Proposal(tree, torch.tensor([3, 3])), GREEDY)
    assert w.path.tolist() == [1] and w.next_token == 0


@st.composite
def trees(draw, max_nodes=12):
    """Random valid trees: each new node picks an existing node as parent and takes the next rank."""
    picks = draw(st.lists(st.integers(0, 1000), min_size=1, max_size=max_nodes))
    paths: list[tuple[int, ...]] = []
    n_children: dict[tuple[int, ...], int] = {}
    for k in picks:
        parent = ([()] + paths)[k % (len(paths) + 1)]
        rank = n_children.get(parent, 0)
        n_children[parent] = rank + 1
        paths.append(parent + (rank,))
    return Tree.from_paths(paths)


def reference_greedy(tree, tokens, argmax):
    """Straightforward loop: a node is reachable if its parent is and its token is the parent's argmax."""
    reachable = [True] + [False] * len(tree)
    best = 0
    for i in range(1, tree.num_nodes):
        parent = int(tree.parents[i])
        reachable[i] = reachable[parent] and tokens[i - 1] == argmax[parent]
        if reachable[i] and int(tree.depths[i]) > int(tree.depths[best]):
            best = i
    return tree.path_to(best).tolist(), argmax[best]


@settings(max_examples=100, deadline=None)
@given(tree=trees(), data=st.data())
def test_greedy_properties(tree, data):
    vocab = data.draw(st.integers(2, 3))
    tokens = data.draw(st.lists(st.integers(0, vocab - 1), min_size=len(tree), max_size=len(tree)))
    seed = data.draw(st.integers(0, 2**31))
    logits = torch.randn(tree.num_nodes, vocab, generator=torch.Generator().manual_seed(seed))
    argmax = logits.argmax(-1).tolist()
    w = walk(logits, Proposal(tree, torch.tensor(tokens)), GREEDY)
    path = w.path.tolist()
    # a valid root-to-node path
    assert [int(tree.depths[i]) for i in path] == list(range(1, len(path) + 1))
    assert all(int(tree.parents[c]) == p for p, c in zip(([0] + path)[: len(path)], path, strict=True))
    # every token is the argmax at its parent, and the next token is the argmax at the end
    assert all(tokens[c - 1] == argmax[p] for p, c in zip(([0] + path)[: len(path)], path, strict=True))
    last = path[-1] if path else 0
    assert w.next_token == argmax[last]
    # maximal: no child of the last node matches
    assert all(tokens[c - 1] != argmax[last] for c in tree.children[last])
    assert (path, w.next_token) == reference_greedy(tree, tokens, argmax)


# -- exact losslessness of sampling -----------------------------------------------------------------
LOSSLESS_CASES = [
    # (id, tree, vocab, sampling, sampled candidates, duplicate sibling tokens)
    ("det-full22", Tree.full(2, 2), 4, T1, False, False),
    ("det-chain2", Tree.chain(2), 4, T1, False, False),
    ("det-uneven-dup", UNEVEN, 5, T1, False, True),
    ("det-uneven-t07-topp", UNEVEN, 5, T07, False, False),
    ("iid-full22", Tree.full(2, 2), 4, T1, True, False),
    ("iid-chain2", Tree.chain(2), 4, T1, True, False),
    ("iid-uneven", UNEVEN, 5, T1, True, False),
    ("iid-full22-t07-topp", Tree.full(2, 2), 5, T07, True, False),
]


@pytest.mark.parametrize(
    "tree, vocab, sampling, sampled, duplicates", [c[1:] for c in LOSSLESS_CASES], ids=[c[0] for c in LOSSLESS_CASES]
)
def test_sampling_is_lossless(tree, vocab, sampling, sampled, duplicates):
    world = World(vocab, tree.depth, seed=vocab * 100 + len(tree))
    counts = first_two_counts(world, walk, tree, sampling, sampled=sampled, duplicate_ranks=duplicates)
    assert chi2_pvalue(counts, world.exact_first_two(sampling)) > ALPHA


# negative controls: the same harness must reject walkers that are wrong
def accept_everything(logits, proposal, sampling, generator=None):
    """Accept the first child at every depth and take the bonus token: the draft's bias leaks through."""
    tree, node, path = proposal.tree, 0, []
    while tree.children[node]:
        node = tree.children[node][0]
        path.append(node)
    next_token = int(sample(probs(logits[node], sampling), generator))
    return Walk(path=torch.tensor(path, dtype=torch.long), next_token=next_token)


def test_negative_control_accept_everything():
    tree, world = Tree.full(2, 2), World(4, 2, seed=406)
    counts = first_two_counts(world, accept_everything, tree, T1, sampled=False)
    assert chi2_pvalue(counts, world.exact_first_two(T1)) < ALPHA


def test_negative_control_residual_not_updated(monkeypatch):
    """SpecInfer without the residual update (retest every sibling against p, resample from p) is biased."""
    monkeypatch.setattr(walker_batch, "residual_after", lambda residual, *args: residual)
    tree, world = Tree.full(2, 2), World(4, 2, seed=406)
    counts = first_two_counts(world, walk, tree, T1, sampled=True)
    assert chi2_pvalue(counts, world.exact_first_two(T1)) < ALPHA


def test_walks_are_reproducible():
    world = World(4, 2, seed=1)
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    tokens, logits, q_draft = world.sampled_proposals(Tree.full(2, 2), T1, 50, torch.Generator().manual_seed(3))
    for r in range(50):
        proposal = Proposal(Tree.full(2, 2), tokens[r], q_draft[r])
        a, b = walk(logits[r], proposal, T1, generator=g1), walk(logits[r], proposal, T1, generator=g2)
        assert a.path.tolist() == b.path.tolist() and a.next_token == b.next_token


def test_duplicate_siblings_deterministic():
    """All target mass on token 0; siblings (1, 1, 0): the duplicate is skipped, the third accepted."""
    tree = Tree.full(3, 1)
    logits = torch.tensor([[0.0, -torch.inf, -torch.inf]] * 4)
    for seed in range(20):
        w = walk(logits, Proposal(tree, torch.tensor([1, 1, 0])), T1, generator=torch.Generator().manual_seed(seed))
        assert w.path.tolist() == [3]


def test_deterministic_all_rejected_resamples_from_the_rest():
    tree = Tree.full(2, 1)
    logits = torch.log(torch.tensor([[0.2, 0.3, 0.5, 0.0]] * 3))
    seen = set()
    for seed in range(200):
        w = walk(logits, Proposal(tree, torch.tensor([0, 1])), T1, generator=torch.Generator().manual_seed(seed))
        if not len(w.path):
            seen.add(w.next_token)
    assert seen == {2}


def test_sampled_empty_residual_falls_back_to_p():
    """q == p and a drafted token outside both supports: rejected, and max(p − q, 0) is all zero."""
    logits = torch.tensor([[0.0, 1.0, 2.0, -torch.inf]] * 2)
    q_draft = probs(logits, T1)
    for seed in range(20):
        proposal = Proposal(Tree.chain(1), torch.tensor([3]), q_draft)
        w = walk(logits, proposal, T1, generator=torch.Generator().manual_seed(seed))
        assert w.path.tolist() == [] and w.next_token in (0, 1, 2)


# -- typical acceptance (Medusa) -----------------------------------------------------------------
P_ROOT = torch.tensor([0.5, 0.3, 0.15, 0.05])  # H ≈ 1.142 nats → threshold min(0.09, 0.3·e^−H ≈ 0.096) = 0.09


def typical_threshold(p, epsilon=0.09, delta=0.3):
    entropy = -(p * p.log()).sum()
    return min(epsilon, delta * float(torch.exp(-entropy)))


def test_typical_threshold():
    assert typical_threshold(P_ROOT) == pytest.approx(0.09)
    logits = P_ROOT.log().repeat(3, 1)  # every node: P_ROOT
    g = torch.Generator().manual_seed(0)
    # p(2) = 0.15 > 0.09 passes; p(3) = 0.05 does not
    for token, accepted in [(2, [1]), (3, [])]:
        w = walk(logits[:2], Proposal(Tree.chain(1), torch.tensor([token])), T1, acceptance="typical", generator=g)
        assert w.path.tolist() == accepted
    # deepest all-passing path: node 1 (token 3) fails, node 2 (token 1) → node 4 (token 0) passes
    tree = Tree.from_paths([(0,), (1,), (0, 0), (1, 0)])
    logits = P_ROOT.log().repeat(5, 1)
    w = walk(logits, Proposal(tree, torch.tensor([3, 1, 0, 0])), T1, acceptance="typical", generator=g)
    assert w.path.tolist() == [2, 4]
    # a smaller ε lowers the bar below p(3) = 0.05; a larger δ does not raise it above ε
    for epsilon, delta, accepted in [(0.01, 0.3, [1]), (0.09, 3.0, [])]:
        w = walk(logits[:2], Proposal(Tree.chain(1), torch.tensor([3])), T1, acceptance="typical",
                 generator=g, typical_epsilon=epsilon, typical_delta=delta)
        assert w.path.tolist() == accepted


def test_typical_is_not_lossless_and_not_default():
    assert inspect.signature(walk).parameters["acceptance"].default == "rejection"
    # token 0 has target probability 0.5 but typical acceptance commits it every time
    logits = P_ROOT.log().repeat(2, 1)
    proposal = Proposal(Tree.chain(1), torch.tensor([0]))
    g = torch.Generator().manual_seed(0)
    firsts = [walk(logits, proposal, T1, acceptance="typical", generator=g).path.tolist() for _ in range(200)]
    assert firsts == [[1]] * 200
    lossless = [walk(logits, proposal, T1, generator=g).path.tolist() for _ in range(200)]
    assert 60 < lossless.count([1]) < 140  # ≈ 100: accepted with probability 0.5


def test_typical_greedy_is_greedy():
    tokens = torch.tensor([4, 4, 9, 1, 2, 3, 6, 5])
    logits = logits_with_argmax([4, 1, 6, 0, 5, 0, 0, 7, 3], 10)
    a = walk(logits, Proposal(UNEVEN, tokens), GREEDY, acceptance="typical")
    b = walk(logits, Proposal(UNEVEN, tokens), GREEDY)
    assert a.path.tolist() == b.path.tolist() == [1, 4, 8] and a.next_token == b.next_token == 3


def test_no_candidates():
    """Tree.chain(0): only the root is verified; every mode commits exactly one token."""
    proposal = Proposal(Tree.chain(0), torch.zeros(0, dtype=torch.long))
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    assert walk(logits, proposal, GREEDY).next_token == 1
    for acceptance in ("rejection", "typical"):
        w = walk(logits, proposal, T1, acceptance=acceptance, generator=torch.Generator().manual_seed(0))
        assert w.path.tolist() == [] and w.next_token in (0, 1, 2)


# -- input validation ---------------------------------------------------------------------------
def test_validation():
    tree = Tree.chain(2)
    proposal = Proposal(tree, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="num_nodes"):
        walk(torch.zeros(2, 4), proposal, T1)
    with pytest.raises(ValueError, match="unknown acceptance"):
        walk(torch.zeros(3, 4), proposal, T1, acceptance="greedy")
    with pytest.raises(ValueError, match="q_draft"):
        walk(torch.zeros(3, 4), Proposal(tree, torch.tensor([0, 1]), torch.full((3, 5), 0.2)), T1)


@pytest.mark.parametrize("sampling", [GREEDY, T1, T07])
def test_rank_acceptance_is_how_often_the_walker_accepts_each_sibling(sampling):
    """walker.rank_acceptance (the input of accuracy-grown trees at a temperature) against the walker: the
    share of walks accepting sibling r of a one-level tree."""
    tree = Tree.full(3, 1)
    logits = torch.tensor([[0.3, 1.2, 0.0, 0.9, -0.5, 0.4]]).repeat(4, 1)  # [N, V]
    drafted = torch.tensor([3, 1, 5])  # distinct tokens in "draft rank" order; 1 is the target's argmax
    expected = walker.rank_acceptance(drafted[None], logits[:1], sampling)[0]  # [3]
    counts = torch.zeros(3)
    for seed in range(4000):
        w = walk(logits, Proposal(tree, drafted), sampling, generator=torch.Generator().manual_seed(seed))
        if len(w.path):
            counts[int(w.path[0]) - 1] += 1
    assert torch.allclose(counts / 4000, expected, atol=0.03), (counts / 4000, expected)
    if sampling.greedy:
        assert expected.tolist() == [0.0, 1.0, 0.0]
