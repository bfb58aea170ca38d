"""Combined drafters (heads/combined.py): the union of proposals merged by shared prefixes within a node budget, the
fallback on a weak match; lossless in both modes (greedy equals vanilla, sampled output follows the target, with a
negative control), each drafter told the part of the accepted path it proposed."""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch

from treespec import Tree, generate
from treespec.drafter import Proposal
from treespec.dynamic_tree import DynamicTree
from treespec.heads import Combined, DraftModel, PromptLookup, SuffixDecoding, TokenRecycling
from treespec.heads.combined import merge
from treespec.heads.eagle import Eagle
from treespec.sampling import Sampling
from treespec.walker import row_by_row

from .helpers import (
    VOCAB,
    accept_everything,
    chi2_pvalue,
    exact_distribution,
    hf_greedy,
    perturbed,
    random_eagle,
    sampled_counts,
    tiny_llama,
)


def token_paths(proposal: Proposal) -> set[tuple[int, ...]]:
    """Every node's tokens from the root: what a tree means, whatever its node order."""
    out, parents, tokens = {0: ()}, proposal.tree.parent_list, proposal.tokens.tolist()
    for i in range(1, proposal.tree.num_nodes):
        out[i] = (*out[parents[i]], tokens[i - 1])
    return set(out.values()) - {()}


def test_merge_is_the_union_by_prefix_within_the_budget():
    a = Proposal(Tree.from_paths([(0,), (1,), (0, 0), (0, 1)]), torch.tensor([5, 6, 7, 8]))
    b = Proposal(Tree.from_paths([(0,), (1,), (0, 0), (1, 0)]), torch.tensor([5, 9, 7, 3]))
    merged, maps = merge([a, b], budget=100)
    assert token_paths(merged) == token_paths(a) | token_paths(b) and len(merged.tree) == 6
    for p, mapped in zip((a, b), maps, strict=True):  # each node lands on the node spelling the same tokens
        for i, m in mapped.items():
            assert merged.tree.path_to(m).shape[0] == p.tree.path_to(i).shape[0]
            assert merged.tokens[merged.tree.path_to(m) - 1].tolist() == p.tokens[p.tree.path_to(i) - 1].tolist()
    small, maps = merge([a, b], budget=5)  # a's 4 nodes first, then b's first new one
    assert token_paths(small) == token_paths(a) | {(9,)}
    for union in (merged, small):  # siblings are distinct tokens: the walker's sibling rule needs no more
        for kids in union.tree.children:
            assert len({int(union.tokens[k - 1]) for k in kids}) == len(kids)


class Recorder(PromptLookup):
    """Prompt lookup that records the paths it is told were accepted, against its own proposals."""

    def __init__(self, depth: int = 8):
        super().__init__(max_ngram=2)
        self.log, self.depth = [], depth

    def propose_row(self, seq, tree):
        proposal = super().propose_row(seq, tree.truncate(self.depth))
        self.log.append([proposal, None])
        return proposal

    def accept(self, paths, features):
        self.log[-1][1] = paths[0]


def test_each_drafter_is_told_its_part_of_the_accepted_path():
    target = tiny_llama(seed=3)
    ids = torch.tensor([[5, 9, 13, 2, 7] * 4])
    first, second = Recorder(depth=1), Recorder()  # the first proposes one level: the second's paths go deeper
    out = generate(target, ids, drafter=Combined([first, second]), tree=Tree.full(2, 3), max_new_tokens=20)
    assert torch.equal(out.sequences, hf_greedy(target, ids, 20))
    seq = out.sequences[0].tolist()
    length, partial = ids.shape[1] + 1, 0  # committed after prefill: the prompt and the root
    for (p1, path1), (p2, path2), n in zip(first.log, second.log, out.accept_lengths, strict=False):
        committed = seq[length : length + n - 1]  # the accepted candidates, the bonus token excluded
        for proposal, path in ((p1, path1), (p2, path2)):  # its part: the accepted tokens' prefix it proposed
            tokens = proposal.tokens[path - 1].tolist() if len(path) else []  # node i holds tokens[i - 1]
            assert tokens == committed[: len(tokens)]
            if len(tokens) < len(committed):
                assert tuple(committed[: len(tokens) + 1]) not in token_paths(proposal)
                partial += 1
        length += n
    assert partial  # some steps accepted more than one of the drafters proposed

CASES = {
    "recycling+lookup": lambda t: Combined([TokenRecycling(), PromptLookup(max_ngram=2)]),
    "suffix+draft": lambda t: Combined([SuffixDecoding(), DraftModel(perturbed(t, 0.3))]),
    "fallback": lambda t: Combined([PromptLookup(max_ngram=2), TokenRecycling()], mode="fallback", min_nodes=2),
    "budget": lambda t: Combined([TokenRecycling(), PromptLookup()], nodes=3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_vanilla(case):
    target = tiny_llama(seed=1)
    drafter = CASES[case](target)
    for ids, tree in itertools.product([torch.tensor([[5, 9, 13, 2, 7] * 3]), torch.tensor([[1, 2, 3]])],
                                       [None, Tree.full(2, 2)]):
        out = generate(target, ids, drafter=drafter, tree=tree, max_new_tokens=16)
        assert torch.equal(out.sequences, hf_greedy(target, ids, 16)), (case, tree)
    rows = [torch.tensor([5, 9, 13, 2, 7] * 3), torch.tensor([1, 2, 3, 1, 2])]
    out = generate(target, rows, drafter=drafter, max_new_tokens=12)  # a left-padded batch
    for b, row in enumerate(rows):
        assert torch.equal(out.sequences[b, -12:], hf_greedy(target, row[None], 12)[0, len(row):]), case


def test_suffix_and_draft_model_on_dynamic_trees():
    target = tiny_llama(seed=2)
    drafter = Combined([SuffixDecoding(), DraftModel(perturbed(target, 0.3))])
    ids = torch.tensor([[4, 8, 15, 16, 23, 42 % 64] * 3])
    out = generate(target, ids, drafter=drafter, tree=DynamicTree(8, 3, 2), max_new_tokens=16)
    assert torch.equal(out.sequences, hf_greedy(target, ids, 16)) and out.mean_accept_length > 1


@pytest.fixture(scope="module")
def small_target():
    return tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=11, init_std=0.1)  # tests/test_lossless.py's


def test_sampling_matches_exact_distribution(small_target):
    sampling = Sampling(1.0)
    drafter = Combined([TokenRecycling(k=2), PromptLookup(max_ngram=2)])
    counts = sampled_counts(small_target, drafter, Tree.full(2, 2), sampling, runs=400)
    assert chi2_pvalue(counts, exact_distribution(small_target, sampling)) > 1e-3


def test_wrong_acceptance_is_detected(small_target, monkeypatch):
    monkeypatch.setattr(importlib.import_module("treespec.generate"), "walk_rows", row_by_row(accept_everything))
    sampling = Sampling(1.0)
    drafter = Combined([TokenRecycling(k=2), PromptLookup(max_ngram=2)])
    counts = sampled_counts(small_target, drafter, Tree.full(2, 2), sampling, runs=400)
    assert chi2_pvalue(counts, exact_distribution(small_target, sampling)) < 1e-3


def test_refusals():
    target = tiny_llama()
    with pytest.raises(ValueError, match="two or more treespec Drafters"):
        Combined([PromptLookup()])
    with pytest.raises(ValueError, match="samples them"):
        Combined([PromptLookup(), DraftModel(perturbed(target), candidates="sample")])
    with pytest.raises(ValueError, match="needs the target's hidden states"):
        Combined([PromptLookup(), Eagle(random_eagle(target))])
    with pytest.raises(ValueError, match="mode must be one of"):
        Combined([PromptLookup(), TokenRecycling()], mode="best")
    with pytest.raises(ValueError, match="cannot grow DynamicTree"):  # recycling reads static templates only
        generate(target, torch.tensor([[1, 2]]), drafter=Combined([SuffixDecoding(), TokenRecycling()]),
                 tree=DynamicTree(4, 2, 2), max_new_tokens=2)
    assert not Combined([PromptLookup(), PromptLookup()]).observes_logits
    both = Combined([TokenRecycling(), PromptLookup()])  # the loop shows it passes, a comparison copies it
    assert both.observes_logits and both.remembers_across_calls
