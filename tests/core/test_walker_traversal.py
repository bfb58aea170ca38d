"""Block and traversal verification (treespec/walker_traversal.py, modes of the one walker), and candidates drawn
without replacement (recursive rejection sampling, Jeon et al. 2024): lossless, greedy-exact, faithful to Sun et
al.'s block verification on chains, and accepting at least as much as token-level rejection.

Losslessness is shown two ways on the walker's toy world (tests/helpers/walker_world.py). Exactly: the
walker's trials give the law of its output for one draft (Σ_k Π_{j<k}(1 − a_j) · a_k · next-token law at trial
k), which summed over every draft of a tiny vocabulary (weighted by its draft probability) must equal the
target's law of the first two tokens to float precision. Statistically: a chi-square test on the walks themselves, which
also covers the uniforms and the sampling. A biased variant fails both (negative controls).
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pytest
import torch

from treespec import walker_traversal
from treespec.drafter import Proposal, Proposals
from treespec.sampling import Sampling, probs, sample_without_replacement
from treespec.tree import Tree
from treespec.walker import sequence_trials, walk
from treespec.walker_batch import walk_batch

from tests.helpers import ALPHA, GREEDY, T1, UNEVEN, World, chi2_pvalue, first_two_counts, logits_with_argmax

T06 = Sampling(0.6, top_p=0.95)


def trial_law(world: World, proposal: Proposal, logits: torch.Tensor, sampling: Sampling) -> np.ndarray:
    """float64 [V, V]: the exact law of the first two committed tokens after one walk over ``proposal``
    (a second token the walk does not commit comes from the target after the first, as the next step's)."""
    vocab, tree = world.vocab, proposal.tree
    after_first = probs(world.target[[world.child_code(0, a) for a in range(vocab)]], sampling).double().numpy()
    law, reach = np.zeros((vocab, vocab)), 1.0
    for trial in sequence_trials(logits, proposal, sampling):
        stop = 1.0 if trial.node == 0 else trial.probability
        if reach * stop > 0:
            nxt = trial.mass.next_distribution().double().numpy()
            nxt = nxt / nxt.sum()
            tokens = [int(proposal.tokens[i - 1]) for i in tree.path_to(trial.node).tolist()]
            if len(tokens) >= 2:
                law[tokens[0], tokens[1]] += reach * stop
            elif len(tokens) == 1:
                law[tokens[0]] += reach * stop * nxt
            else:
                law += reach * stop * nxt[:, None] * after_first
        reach *= 1.0 - stop
    return law


def exact_walk_law(world: World, tree: Tree, sampling: Sampling, draws: str) -> np.ndarray:
    """The walker's law of the first two tokens over the drafter's randomness: float64 [V, V]. draws:
    "sampled" (children i.i.d. from the draft, every draft enumerated), "without_replacement" (siblings
    drawn one after another, each from the draft without the earlier ones), "topk" or "topk-duplicates"."""
    if draws != "sampled":
        proposal, logits = world.deterministic_proposal(tree, sampling, duplicate_ranks=draws == "topk-duplicates")
        return trial_law(world, proposal, logits, sampling)
    q_table = probs(world.draft, sampling)  # [rows, V]
    total, spent = np.zeros((world.vocab, world.vocab)), []
    for tokens in itertools.product(range(world.vocab), repeat=len(tree)):
        codes, weight = [0] * tree.num_nodes, 1.0
        for i in range(1, tree.num_nodes):
            parent = tree.parent_list[i]
            q = q_table[codes[parent]].clone()
            if draws == "without_replacement":
                taken = [tokens[s - 1] for s in tree.children[parent] if s < i]
                q[taken] = 0.0
                if float(q.sum()) <= 1e-6:  # the draft is spent: the first token not drawn yet (as World draws)
                    q = torch.tensor([float(x not in taken) for x in range(world.vocab)])
                    q[int(q.argmax()) + 1 :] = 0.0
                    spent.append(i)
            weight *= float(q[tokens[i - 1]] / q.sum())
            codes[i] = world.child_code(codes[parent], tokens[i - 1])
        if weight > 0:
            proposal = Proposal(tree, torch.tensor(tokens), q_table[codes], draws == "without_replacement")
            total += weight * trial_law(world, proposal, world.target[codes], sampling)
    return total


EXACT_CASES = [
    # (tree, vocab, sampling, draws)
    (Tree.chain(2), 4, T1, "sampled"),
    (Tree.chain(3), 3, T1, "sampled"),
    (Tree.chain(3), 3, T06, "sampled"),
    (Tree.chain(3), 4, T1, "topk"),
    (Tree.full(2, 2), 3, T1, "sampled"),
    (Tree.full(2, 2), 4, T06, "sampled"),
    (UNEVEN, 3, T1, "sampled"),
    (UNEVEN, 3, T1, "topk"),  # node 1's three children cover the vocabulary: every residual empties
    (UNEVEN, 5, T06, "topk"),
    (UNEVEN, 5, T1, "topk-duplicates"),
    (Tree.full(2, 2), 4, T1, "without_replacement"),
    (Tree.full(3, 2), 3, T06, "without_replacement"),  # three siblings, top-p: the draft is spent before the last
    (UNEVEN, 3, T1, "without_replacement"),
]


@pytest.mark.parametrize("tree, vocab, sampling, draws", EXACT_CASES,
                         ids=[f"{t.num_nodes}n-v{v}-T{s.temperature}-{d}" for t, v, s, d in EXACT_CASES])
def test_traversal_law_is_exactly_the_targets(tree, vocab, sampling, draws):
    world = World(vocab, tree.depth, seed=5)
    law = exact_walk_law(world, tree, sampling, draws)
    assert np.abs(law - world.exact_first_two(sampling)).max() < 1e-6


def test_exact_law_detects_a_missing_residual(monkeypatch):
    """Negative control for the exact test: a rejected child that leaves its parent's mass as it was."""
    monkeypatch.setattr(walker_traversal.Mass, "reject", lambda self, token, draft: None)
    world = World(3, 2, seed=5)
    law = exact_walk_law(world, Tree.full(2, 2), T1, "sampled")
    assert np.abs(law - world.exact_first_two(T1)).max() > 1e-2


# -- block verification is Sun et al.'s Algorithm 2 --------------------------------------------------------
def block_verification_reference(p: torch.Tensor, q: torch.Tensor, tokens: list[int]) -> list[float]:
    """Sun et al. 2024, Algorithm 2, as written: p, q: [γ + 1, V] target and draft distributions after
    X_1..X_i; → h_γ, h_{γ−1}, ..., h_1 (the chance each length is the accepted one, given longer ones failed)."""
    gamma, weights = len(tokens), [1.0]
    for i, x in enumerate(tokens):
        weights.append(min(1.0, weights[-1] * float(p[i, x]) / float(q[i, x])))
    h = [weights[gamma]]
    for i in range(gamma - 1, 0, -1):
        residual = float((weights[i] * p[i] - q[i]).clamp(min=0).sum())
        h.append(residual / (residual + 1 - weights[i]))
    return h


@pytest.mark.parametrize("seed", range(5))
def test_block_trials_are_sun_et_al_algorithm_2(seed):
    g = torch.Generator().manual_seed(seed)
    gamma, vocab = 4, 6
    p = torch.softmax(torch.randn(gamma + 1, vocab, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(gamma + 1, vocab, generator=g) * 2, -1)
    tokens = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(gamma)]
    proposal = Proposal(Tree.chain(gamma), torch.tensor(tokens), q)
    got = [t.probability for t in sequence_trials(p.log(), proposal, T1)]
    assert got[-1] == 1.0  # the root: τ = 0 when every longer block failed
    assert got[:-1] == pytest.approx(block_verification_reference(p, q, tokens), abs=1e-5)


# -- chi-square on the walks --------------------------------------------------------------------------
CHI2_CASES = [
    # (id, acceptance, tree, vocab, sampling, sampled candidates)
    ("block-iid-chain3", "block", Tree.chain(3), 4, T1, True),
    ("block-topk-chain2", "block", Tree.chain(2), 4, T1, False),
    ("block-iid-chain2-t06-topp", "block", Tree.chain(2), 5, T06, True),
    ("traversal-iid-full22", "traversal", Tree.full(2, 2), 4, T1, True),
    ("traversal-iid-uneven", "traversal", UNEVEN, 5, T1, True),
    ("traversal-topk-uneven", "traversal", UNEVEN, 5, T1, False),
    ("traversal-iid-full22-t06-topp", "traversal", Tree.full(2, 2), 6, T06, True),
    # candidates drawn without replacement: recursive rejection sampling, token-level and in the traversal
    ("rejection-distinct-full32", "rejection", Tree.full(3, 2), 4, T1, "without_replacement"),
    ("rejection-distinct-full22-t06-topp", "rejection", Tree.full(2, 2), 6, T06, "without_replacement"),
    ("traversal-distinct-uneven", "traversal", UNEVEN, 5, T1, "without_replacement"),
]


# with -m slow: i.i.d. candidates at T = 1 and the block rule, which tests/test_lossless.py's block-chain-sampled
# and traversal-tree-sampled test by chi-square through generate() (each row's walk is this walk), and the exact law
# above on every tree (the block rule on a chain is the traversal's walk). The default cases are those that
# test_lossless.py runs only with -m slow: top-k candidates, T = 0.6 with top-p, siblings without replacement.
SLOW_CHI2 = {"block-iid-chain3", "block-topk-chain2", "block-iid-chain2-t06-topp", "traversal-iid-full22",
             "traversal-iid-uneven"}


@pytest.mark.parametrize("acceptance, tree, vocab, sampling, sampled",
                         [pytest.param(*c[1:], id=c[0], marks=[pytest.mark.slow] if c[0] in SLOW_CHI2 else [])
                          for c in CHI2_CASES])
def test_walks_are_lossless(acceptance, tree, vocab, sampling, sampled):
    world = World(vocab, tree.depth, seed=vocab * 100 + len(tree))
    walker = functools.partial(walk, acceptance=acceptance)
    counts = first_two_counts(world, walker, tree, sampling, sampled=bool(sampled),
                              without_replacement=sampled == "without_replacement")
    assert chi2_pvalue(counts, world.exact_first_two(sampling)) > ALPHA


def test_chi_square_detects_a_missing_residual(monkeypatch):
    monkeypatch.setattr(walker_traversal.Mass, "reject", lambda self, token, draft: None)
    world = World(4, 2, seed=406)
    counts = first_two_counts(world, functools.partial(walk, acceptance="traversal"), Tree.full(2, 2), T1,
                              sampled=True, runs=2000)  # a tenth of the walks: p ~ 1e-266
    assert chi2_pvalue(counts, world.exact_first_two(T1)) < ALPHA


# -- at least token-level's acceptance, in expectation ------------------------------------------------------
@pytest.mark.parametrize("acceptance, tree", [("block", Tree.chain(4)), ("traversal", Tree.full(2, 3))],
                         ids=["block-chain4", "traversal-full23"])
def test_accepts_at_least_as_much_as_token_level(acceptance, tree):
    """The papers' claim (Sun et al. Theorem 2; Weng et al.): on the same sampled drafts, the mean accepted
    length is at or above token-level rejection's. A one-sided z-test on paired differences; the drafts
    (a noisy draft at T = 1) leave room to gain, and the gain is significant."""
    world, runs = World(4, tree.depth, seed=3, draft_noise=1.5), 4000
    g = torch.Generator().manual_seed(0)
    tokens, logits, q_draft = world.sampled_proposals(tree, T1, runs, g)
    sequence = [len(walk(logits[r], Proposal(tree, tokens[r], q_draft[r]), T1, acceptance=acceptance,
                         generator=g).path) for r in range(runs)]
    token_level = walk_batch(logits, Proposals.shared(tree, tokens, q_draft), T1, generator=g).lengths  # [runs]
    gains = torch.tensor(sequence, dtype=torch.float64) - token_level.double()
    z = float(gains.mean() / (gains.std() / math.sqrt(runs)))
    assert z > 3.0, f"mean gain {float(gains.mean()):.3f} tokens per step, z = {z:.2f}"


# -- greedy, and what each mode accepts ------------------------------------------------------------------
@pytest.mark.parametrize("acceptance", ["block", "traversal"])
def test_greedy_is_the_greedy_walk(acceptance):
    tree = UNEVEN if acceptance == "traversal" else Tree.chain(3)
    tokens = torch.tensor([4, 4, 9, 1, 2, 3, 6, 5])[: len(tree)]
    logits = logits_with_argmax([4, 1, 6, 0, 5, 0, 0, 7, 3][: tree.num_nodes], 10)
    a = walk(logits, Proposal(tree, tokens), GREEDY, acceptance=acceptance)
    b = walk(logits, Proposal(tree, tokens), GREEDY)
    assert a.path.tolist() == b.path.tolist() and a.next_token == b.next_token


def test_block_refuses_a_branching_tree():
    proposal = Proposal(Tree.full(2, 1), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="acceptance='traversal'"):
        walk(torch.zeros(3, 4), proposal, T1, acceptance="block")
    for acceptance in ("block", "traversal"):  # no candidates: one token from the target
        w = walk(torch.tensor([[0.0, 3.0, 1.0]]), Proposal(Tree.chain(0), torch.zeros(0, dtype=torch.long)), T1,
                 acceptance=acceptance, generator=torch.Generator().manual_seed(0))
        assert w.path.tolist() == [] and w.next_token in (0, 1, 2)


def test_certain_path_is_accepted():
    """A target that puts all its mass on the drafted tokens accepts the whole deepest path every time."""
    tree = Tree.full(2, 2)
    tokens = torch.tensor([1, 0, 2, 0, 1, 1])  # node 1 (token 1) → node 3 (token 2) is the target's path
    logits = torch.full((7, 3), -torch.inf)
    logits[0, 1] = logits[1, 2] = logits[3, 0] = 0.0
    logits[[2, 4, 5, 6], 0] = 0.0
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        w = walk(logits, Proposal(tree, tokens), T1, acceptance="traversal", generator=g)
        assert w.path.tolist() == [1, 3] and w.next_token == 0


def test_recursive_rejection_without_the_draft_update_is_detected(monkeypatch):
    """Negative control: siblings drawn without replacement but verified as if i.i.d. (the draft law not
    updated after each sibling) is biased, and the chi-square test sees it."""
    from treespec import walker_batch

    monkeypatch.setattr(walker_batch, "draft_without", lambda q, spent, x: (q, spent))
    world = World(3, 1, seed=7, draft_noise=2.0)
    counts = first_two_counts(world, walk, Tree.full(2, 1), T1, sampled=True, without_replacement=True)
    assert chi2_pvalue(counts, world.exact_first_two(T1)) < ALPHA


def test_gumbel_top_k_draws_one_after_another():
    """sample_without_replacement (the drafters' draw): the ordered pair law is p(a) · p(b) / (1 − p(a))."""
    p = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0])
    g = torch.Generator().manual_seed(0)
    counts = np.zeros((5, 5))
    for _ in range(20_000):
        a, b = sample_without_replacement(p, 2, g).tolist()
        counts[a, b] += 1
    expected = (p[:, None] * p[None, :] / (1 - p[:, None])).fill_diagonal_(0.0).double().numpy()
    assert chi2_pvalue(counts, expected) > ALPHA
    assert sample_without_replacement(torch.tensor([0.0, 1.0, 0.0]), 3, g)[0] == 1  # zero-mass tokens come last


def test_dynamic_trees_refuse_sampled_candidates():
    from treespec import generate
    from treespec.dynamic_tree import DynamicTree
    from treespec.heads import DraftModel

    from tests.helpers import tiny_llama

    target = tiny_llama(vocab=8, hidden=16, layers=1)
    drafter = DraftModel(tiny_llama(vocab=8, hidden=16, layers=1), candidates="without_replacement")
    with pytest.raises(ValueError, match="without_replacement"):
        generate(target, torch.tensor([[1, 2, 3]]), drafter=drafter, tree=DynamicTree(4, 2, 2), max_new_tokens=4,
                 temperature=1.0, generator=torch.Generator().manual_seed(0))
