"""Sampling through generate() is lossless: the continuation distribution is exactly the target's.

A tiny-vocabulary target makes the exact distribution of a 3-token continuation enumerable
(V³ cells, from the target's own forward passes); the sampled generations per drafter and tree must
match it under a chi-square test, for every lossless acceptance rule (token-level rejection; block
verification on chains; traversal verification on chains, static and dynamic trees) with two drafters (a
draft model, sampled or top-k, and prompt lookup). A drafter that was wrongly verified (every candidate
accepted) fails the same test, so the test can fail.
"""


import pytest

from treespec import Tree
from treespec.dynamic_tree import DynamicTree
from treespec.heads import DraftModel, PromptLookup
from treespec.sampling import Sampling
from treespec.walker import row_by_row

from tests.helpers import (
    VOCAB,
    accept_everything,
    chi2_pvalue,
    exact_distribution,
    perturbed,
    sampled_counts,
    tiny_llama,
)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=11, init_std=0.1)  # all 64 cells informative


CASES = {
    "chain-sampled": (lambda t: DraftModel(perturbed(t, 1.0), candidates="sample"), Tree.chain(2), Sampling(1.0)),
    "tree-sampled": (lambda t: DraftModel(perturbed(t, 1.0), candidates="sample"), Tree.full(2, 2), Sampling(1.0)),
    "chain-topk": (lambda t: DraftModel(perturbed(t, 1.0)), Tree.chain(2), Sampling(1.0)),
    "tree-topk-top_p": (lambda t: DraftModel(perturbed(t, 1.0)), Tree.full(2, 2), Sampling(0.8, 0.9)),
    "prompt-lookup-tree": (lambda t: PromptLookup(max_ngram=2), Tree.full(2, 2), Sampling(1.0)),
    # sequence-level rules (treespec/walker_traversal.py): block on chains, traversal on every tree kind
    "block-chain-sampled": (lambda t: DraftModel(perturbed(t, 1.0), candidates="sample"), Tree.chain(3), Sampling(1.0),
                            "block"),
    "block-chain-prompt-lookup": (lambda t: PromptLookup(max_ngram=2), Tree.chain(2), Sampling(1.0), "block"),
    "traversal-tree-sampled": (lambda t: DraftModel(perturbed(t, 1.0), candidates="sample"), Tree.full(2, 2),
                               Sampling(1.0), "traversal"),
    "traversal-tree-sampled-t06-top_p": (lambda t: DraftModel(perturbed(t, 1.0), candidates="sample"),
                                         Tree.full(2, 2), Sampling(0.6, 0.95), "traversal"),
    "traversal-dynamic-topk": (lambda t: DraftModel(perturbed(t, 1.0)), DynamicTree(4, 2, 2), Sampling(1.0),
                               "traversal"),
    "traversal-prompt-lookup-tree": (lambda t: PromptLookup(max_ngram=2), Tree.full(2, 2), Sampling(1.0),
                                     "traversal"),
    # siblings drawn without replacement (Gumbel-top-k), recursive rejection sampling (Jeon et al. 2024)
    "without-replacement-tree": (lambda t: DraftModel(perturbed(t, 1.0), candidates="without_replacement"),
                                 Tree.full(3, 2), Sampling(1.0)),
    "without-replacement-traversal-top_p": (lambda t: DraftModel(perturbed(t, 1.0), candidates="without_replacement"),
                                            Tree.full(3, 2), Sampling(0.6, 0.95), "traversal"),
}


# the default suite runs one case per sequence-level rule and tree kind; the rest run with -m slow (the walker's
# own tests, tests/core/test_walker_traversal.py, cover them all fast, exactly and by chi-square)
SLOW = {"chain-topk", "block-chain-prompt-lookup", "traversal-dynamic-topk", "traversal-tree-sampled-t06-top_p",
        "traversal-prompt-lookup-tree", "without-replacement-traversal-top_p"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES])
def test_sampling_matches_exact_distribution(target, case):
    make_drafter, tree, sampling, *acceptance = CASES[case]
    counts = sampled_counts(target, make_drafter(target), tree, sampling, acceptance=acceptance[0] if acceptance else
                            "rejection")
    assert chi2_pvalue(counts, exact_distribution(target, sampling)) > 1e-3


def test_wrong_acceptance_is_detected(target, monkeypatch):
    """Negative control: accepting every drafted token (ignoring p_target) must fail the test."""
    import importlib

    monkeypatch.setattr(importlib.import_module("treespec.generate"), "walk_rows", row_by_row(accept_everything))
    sampling = Sampling(1.0)
    counts = sampled_counts(target, DraftModel(perturbed(target, 1.0)), Tree.chain(2), sampling, runs=3000)
    assert chi2_pvalue(counts, exact_distribution(target, sampling)) < 1e-3
