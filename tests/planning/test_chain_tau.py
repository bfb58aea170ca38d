"""Each rule's τ on sampled chains in closed form (treespec/planning/chain_tau.py), and what tree=auto chooses from it.

The closed form given a draft, averaged exactly over every draft of a tiny vocabulary, must equal the walker's
exact expected accepted length: for block verification the law of its trials (walker.sequence_trials), for
token-level rejection and for block walks themselves the mean of many walks (a z-test). One D-deep draft
predicts every γ <= D, so the D-deep enumeration is compared with the walker on each γ-deep chain.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from treespec.drafter import Proposal
from treespec.planning import chain_tau
from treespec.planning.autotree import ChainTable, choose_tree, predict
from treespec.planning.chain_tau import ChainTau, block_accepted, draft_chain, measure_chain_tau, token_level_accepted
from treespec.sampling import Sampling, probs
from treespec.tree import Tree
from treespec.walker import sequence_trials, walk

from tests.helpers import T1, World, random_eagle, record_proposals, tiny_llama

T06 = Sampling(0.6, top_p=0.95)
CASES = [(3, 3, T1, 1.0), (4, 3, T1, 1.5), (4, 2, T06, 1.5), (3, 4, T1, 2.0)]  # (vocab, D, sampling, draft noise)
IDS = [f"v{v}-D{d}-T{s.temperature}-noise{n}" for v, d, s, n in CASES]


def drafts(world: World, depth: int, sampling: Sampling):
    """Every depth-token draft → (weights [m], p [m, D+1, V], q [m, D+1, V], tokens [m, D])."""
    q_table, p_table = probs(world.draft, sampling), probs(world.target, sampling)  # [rows, V]
    weights, codes_all, tokens_all = [], [], []
    for tokens in itertools.product(range(world.vocab), repeat=depth):
        codes, weight = [0], 1.0
        for x in tokens:
            weight *= float(q_table[codes[-1], x])
            codes.append(world.child_code(codes[-1], x))
        weights.append(weight)
        codes_all.append(codes)
        tokens_all.append(tokens)
    codes = torch.tensor(codes_all)  # [m, D+1]
    return torch.tensor(weights, dtype=torch.float64), p_table[codes], q_table[codes], torch.tensor(tokens_all)


def exact(accepted, world, depth, sampling) -> torch.Tensor:
    """float64 [D+1]: E[accepted | γ] of a closed form, over every D-deep draft."""
    weights, p, q, tokens = drafts(world, depth, sampling)
    return (weights[:, None] * accepted(p, q, tokens).double()).sum(0)


def walker_block_exact(world, gamma, sampling) -> float:
    """The walker's exact expected accepted length on γ-deep chains: Σ over drafts and trials of
    P(draft) · P(trial reached and accepted) · the trial's depth."""
    weights, p, q, tokens = drafts(world, gamma, sampling)
    total = 0.0
    for k in range(len(weights)):
        if weights[k] == 0:
            continue
        proposal = Proposal(Tree.chain(gamma), tokens[k], q[k])
        reach = 1.0
        # p is already at ``sampling``: its log at temperature 1 gives it back (softmax(log p) = p)
        for trial in sequence_trials(p[k].log(), proposal, T1):
            stop = 1.0 if trial.node == 0 else trial.probability
            total += float(weights[k]) * reach * stop * trial.node  # a chain's node i has depth i
            reach *= 1.0 - stop
    return total


@pytest.mark.parametrize("vocab, depth, sampling, noise", CASES, ids=IDS)
def test_block_closed_form_is_the_walkers_expectation(vocab, depth, sampling, noise):
    world = World(vocab, depth, seed=vocab + depth, draft_noise=noise)
    closed = exact(block_accepted, world, depth, sampling)
    assert float(closed[0]) == 0.0
    for gamma in range(1, depth + 1):
        assert float(closed[gamma]) == pytest.approx(walker_block_exact(world, gamma, sampling), abs=1e-6)


@pytest.mark.parametrize("vocab, depth, sampling, noise", CASES, ids=IDS)
def test_block_accepts_more_than_token_level(vocab, depth, sampling, noise):
    """Sun et al. Theorem 2 in expectation over drafts; and the token-level closed form is not the walker's
    block expectation (negative control: the exact comparison above tells the rules apart)."""
    world = World(vocab, depth, seed=vocab + depth, draft_noise=noise)
    block, token = exact(block_accepted, world, depth, sampling), exact(token_level_accepted, world, depth, sampling)
    assert bool((block >= token - 1e-9).all())
    assert float(token[1]) == pytest.approx(float(block[1]), abs=1e-9)  # one token: the same rule
    if sampling == T1:  # at T = 0.6 and top-p 0.95 the distributions of 4 tokens leave (almost) nothing to gain
        assert float(block[depth] - token[depth]) > 1e-3
        assert abs(float(token[depth]) - walker_block_exact(world, depth, sampling)) > 1e-3


@pytest.mark.parametrize("acceptance", ["rejection", "block"])
def test_closed_form_matches_walks(acceptance):
    """The walks themselves (uniforms and all) average to the exact closed form: a z-test on 3000 walks."""
    depth, runs = 3, 3000
    world = World(4, depth, seed=11, draft_noise=1.5)
    accepted = token_level_accepted if acceptance == "rejection" else block_accepted
    expected = float(exact(accepted, world, depth, T1)[depth])
    g = torch.Generator().manual_seed(1)
    tokens, logits, q_draft = world.sampled_proposals(Tree.chain(depth), T1, runs, g)
    lengths = torch.tensor([len(walk(logits[r], Proposal(Tree.chain(depth), tokens[r], q_draft[r]), T1,
                                     acceptance=acceptance, generator=g).path) for r in range(runs)],
                           dtype=torch.float64)
    z = (float(lengths.mean()) - expected) / (float(lengths.std()) / math.sqrt(runs))
    assert abs(z) < 4.0, f"walks {float(lengths.mean()):.4f}, closed form {expected:.4f}, z = {z:.2f}"


def test_averaging_is_rao_blackwellised():
    """Per draft, the closed form is the expectation of that draft's walks: its variance across drafts is below
    the walks' (it integrates the verifier's coins out)."""
    world, runs, depth = World(4, 3, seed=11, draft_noise=1.5), 2000, 3
    g = torch.Generator().manual_seed(2)
    tokens, logits, q_draft = world.sampled_proposals(Tree.chain(depth), T1, runs, g)
    closed = block_accepted(torch.softmax(logits, -1), q_draft, tokens)[:, depth]
    walks = torch.tensor([float(len(walk(logits[r], Proposal(Tree.chain(depth), tokens[r], q_draft[r]), T1,
                                         acceptance="block", generator=g).path)) for r in range(runs)])
    assert float(closed.var()) < 0.8 * float(walks.var())


# -- through the Drafter interface ---------------------------------------------------------------------------
def test_a_drafter_equal_to_the_target_is_always_accepted():
    """The draft model is the target itself (same weights): p = q along every chain, so both rules accept the
    whole chain. A position off by one between the drafter's q and the target's p would break it."""
    from treespec.heads import DraftModel

    target = tiny_llama(vocab=32, hidden=16, layers=1, seed=3)
    drafter = DraftModel(tiny_llama(vocab=32, hidden=16, layers=1, seed=3), candidates="sample")
    windows = torch.randint(0, 32, (3, 24), generator=torch.Generator().manual_seed(0))
    got = measure_chain_tau(target, drafter, windows, depth=4, sampling=T1, lead=8, cuts=2,
                            generator=torch.Generator().manual_seed(0))
    assert got.drafts == 6
    for rule in ("rejection", "block"):
        assert got.tau[rule] == pytest.approx([1, 2, 3, 4, 5], abs=1e-4)


def test_eagle_drafts_as_generate_does():
    """The root's draft distribution an EAGLE drafter gives in the measurement is the one it gives in generate()
    for the same committed tokens (its features are the target's at the right positions)."""
    from treespec.heads import Eagle

    target = tiny_llama(vocab=32, hidden=16, layers=1, seed=4)
    drafter = Eagle(random_eagle(target, seed=1), candidates="sample")
    seen = record_proposals(drafter)
    from treespec import generate

    generate(target, torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]]), drafter=drafter, tree=Tree.chain(3), max_new_tokens=6,
             temperature=1.0, generator=torch.Generator().manual_seed(0))
    committed, _, proposal = seen[-1]
    p, q, tokens = draft_chain(target, drafter, committed, 3, T1, torch.Generator().manual_seed(0))
    assert q.shape == (1, 4, 32) and tokens.shape == (1, 3)
    assert torch.allclose(q[0, 0], proposal.q_draft[0].float(), atol=1e-5)
    assert torch.allclose(p[0, 0].sum(), torch.tensor(1.0), atol=1e-5)


def test_pooled_is_the_mean_over_all_drafts():
    g = torch.Generator().manual_seed(0)
    p, q = torch.softmax(torch.randn(6, 4, 5, generator=g), -1), torch.softmax(torch.randn(6, 4, 5, generator=g), -1)
    tokens = torch.randint(0, 5, (6, 3), generator=g)
    whole = ChainTau.from_drafts(p, q, tokens, T1)
    parts = ChainTau.pooled([ChainTau.from_drafts(p[:2], q[:2], tokens[:2], T1),
                             ChainTau.from_drafts(p[2:], q[2:], tokens[2:], T1)])
    assert parts.drafts == 6 and parts.tau["block"] == pytest.approx(whole.tau["block"])
    assert all(e > 0 for e in parts.stderr["rejection"][1:])


# -- the auto chooser with chain τ -----------------------------------------------------------------------------
def test_auto_chooses_among_chains_by_each_rules_tau():
    measured = ChainTau(T1, {"rejection": [1.0, 1.5, 1.6, 1.65], "block": [1.0, 1.5, 1.9, 2.2]},
                        {"rejection": [0.0] * 4, "block": [0.0] * 4}, 10)
    curve = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}
    best = {}
    for rule in ("rejection", "block", "traversal"):
        pred, preds = choose_tree(measured.source(rule), curve, max_nodes=64, draft_cost_per_depth=0.1)
        assert [p.tree.depth for p in preds] == [0, 1, 2, 3] and all(p.tree.is_chain for p in preds)
        assert [p.tau for p in preds] == pytest.approx(measured.tau[chain_tau.CHAIN_RULES[rule]])
        best[rule] = pred.tree.depth
    # τ/(1 + 0.1γ): rejection 1.5/1.1 = 1.36 at γ = 1 beats 1.6/1.2 and 1.65/1.3; block's 2.2/1.3 = 1.69 at γ = 3 wins
    assert best == {"rejection": 1, "block": 3, "traversal": 3}
    assert choose_tree(measured.source("block"), curve, draft_cost_per_depth=5.0)[0].tree.depth == 0
    assert measured.source("typical") is None
    with pytest.raises(ValueError, match="chains of depth"):
        predict(Tree.full(2, 1), measured.source("block"), curve)
    with pytest.raises(ValueError, match="measured at"):
        measured.source("block", Sampling(0.7))
    assert isinstance(measured.source("block", T1), ChainTable)


def test_generate_auto_uses_the_drafters_chain_tau():
    """generate(tree=auto) with a sampling drafter whose chain τ is measured: block verification is handed a chain
    chosen from block's τ (rank accuracies could grow a branching tree, which block refuses)."""
    from treespec import generate
    from treespec.heads import DraftModel
    from treespec.planning.autotree import auto_chooser
    from treespec.planning.profile import DrafterProfile
    from treespec.planning.tree_spec import build_tree

    target = tiny_llama(vocab=32, hidden=16, layers=1, seed=3)
    drafter = DraftModel(tiny_llama(vocab=32, hidden=16, layers=1, seed=5), candidates="sample")
    profile = DrafterProfile(accuracy=[[0.5, 0.4], [0.5, 0.4]],  # would grow a branching tree
                             chain_tau=ChainTau(T1, {"rejection": [1.0, 1.4, 1.5], "block": [1.0, 1.4, 1.8]},
                                                {"rejection": [0.0] * 3, "block": [0.0] * 3}, 8),
                             tree_chooser=auto_chooser({1: 1.0, 8: 1.0}))
    sampled = {"profile": profile, "candidates": "sample", "sampling": T1}
    assert build_tree({"kind": "auto"}, acceptance="block", **sampled) == Tree.chain(2)
    assert not build_tree({"kind": "auto"}, acceptance="typical", **sampled).is_chain
    with pytest.raises(ValueError, match="measured at"):
        build_tree({"kind": "auto"}, profile=profile, candidates="sample", acceptance="block", sampling=Sampling(0.5))
    out = generate(target, torch.tensor([[1, 2, 3]]), drafter=drafter, tree={"kind": "auto"}, profile=profile,
                   max_new_tokens=5, temperature=1.0, acceptance="block", generator=torch.Generator().manual_seed(0))
    assert out.sequences.shape[1] == 8 and max(out.accept_lengths) <= 3
