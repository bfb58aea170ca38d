"""Lookahead decoding (heads/lookahead/): its tree is the paper's attention pattern; its Jacobi steps, n-gram pool
and window slides against a reference kept in absolute positions; lossless on the reference target and on two more
families, sampled output distributed as the target's (chi-square, with a negative control)."""

from __future__ import annotations

import importlib
import random

import pytest
import torch

from treespec import Tree, generate, reference
from treespec.drafter import Committed
from treespec.dynamic_tree import DynamicTree
from treespec.heads import Lookahead, registry
from treespec.sampling import Sampling
from treespec.train.checks.architectures import BY_NAME, build, expect_greedy, prompt, use_attention
from treespec.walker import row_by_row

from tests.helpers import (
    RUNS,
    VOCAB,
    accept_everything,
    chi2_pvalue,
    exact_distribution,
    hf_greedy,
    sampled_counts,
    tiny_llama,
)


def full_window(drafter, first=100):
    """A drafter with one row whose window has every level filled with distinct tokens (no shared prefixes)."""
    drafter.prefill(torch.tensor([[1, 2, 3, 1, 2, 4]]), None)
    row = drafter._rows[0]
    w = drafter.window
    row.levels = [[first + lv * w + c for c in range(w)] for lv in range(drafter.ngram - 1)]
    return row


def test_tree_is_the_papers_attention_pattern():
    """The window token at level l, column c attends to level 0's columns 0..c and to levels 1..l of column c, at
    positions root + c + l (the paper's mask): in the tree, its ancestors are exactly those, and its depth c + l.
    Each verified n-gram is a chain from the root."""
    drafter = Lookahead(window=4, ngram=4, guesses=2, prompt_ngrams=False)
    row = full_window(drafter)
    row.pool[row.levels[0][0]] = [(7, 8, 9), (7, 5, 6)]  # share a first token: merged into one node
    proposal = drafter.build(row, drafter.default_tree)
    tree, tokens = proposal.tree, [row.levels[0][0], *proposal.tokens.tolist()]
    node_of = {t: i for i, t in enumerate(tokens) if t >= 100}
    w = drafter.window
    for lv in range(drafter.ngram - 1):
        for c in range(w):
            if lv == 0 and c == 0:
                continue  # the root
            node = node_of[row.levels[lv][c]]
            seen = [tokens[i] for i in tree.path_to(node).tolist()]
            assert seen == row.levels[0][1 : c + 1] + [row.levels[k][c] for k in range(1, lv + 1)]
            assert int(tree.depths[node]) == c + lv
    # the top level's nodes are the ones whose predictions extend the window
    assert [tokens[i] for i in row.top_nodes] == row.levels[-1]
    guesses = [tuple(tokens[i] for i in tree.path_to(n).tolist()) for n in range(tree.num_nodes) if tokens[n] < 100]
    assert {(7, 8, 9), (7, 5, 6)} <= set(guesses) and (7,) in guesses and len(guesses) == 5  # 7 once, then 8 9, 5 6
    assert len(tree) == drafter.default_tree.total_tokens - 1  # the two guesses share their first node


def committed_after(tokens):
    return Committed(torch.tensor([tokens]), [len(tokens)])


class Reference:
    """The window kept in absolute positions: guesses[l][position] for every level, the pool as (key, n-gram)
    pairs in order; a Jacobi step as the paper describes it. Positions the drafter filled with fillers (arbitrary
    by design) are taken from it; every position the reference knows must hold what it holds."""

    def __init__(self):
        self.guesses: list[dict[int, int]] = []
        self.ngrams = []

    def sync(self, levels, root_position, root_token):
        while len(self.guesses) < len(levels):
            self.guesses.append({})
        self.guesses[0][root_position] = root_token  # column 0 of level 0 is the committed root, not a guess
        for lv, level in enumerate(levels):
            for c, token in enumerate(level):
                known = self.guesses[lv].setdefault(root_position + lv + c, token)
                assert known == token, (lv, c)

    def step(self, predicted_top, root_position, width, ngram):
        top = len(self.guesses) - 1
        self.guesses.append({root_position + top + c + 1: predicted_top[c] for c in range(width)})
        if len(self.guesses) == ngram:  # full: each column bottom to top, then the prediction, is an n-gram
            for c in range(width):
                p = root_position + c
                self.ngrams.append((self.guesses[0][p], tuple(self.guesses[lv][p + lv] for lv in range(1, ngram))))
            self.guesses = self.guesses[1:]


def test_jacobi_steps_pool_and_slides_match_a_reference():
    """Random predictions and accepted lengths: at every step each level holds, at each position, what the
    reference holds there, and the pool holds the reference's n-grams (the drafter takes a pass's predictions in
    at its next proposal)."""
    rng = random.Random(0)
    for ngram in (2, 3, 4):
        drafter = Lookahead(window=4, ngram=ngram, guesses=0, pool_size=1000, prompt_ngrams=False)
        context = [1, 2, 3, 4, 5]
        drafter.prefill(torch.tensor([context]), None)
        root = 5  # the first root's position: the prompt's length
        context.append(9)
        ref = Reference()
        for _ in range(12):
            proposal = drafter.propose(committed_after(context), None, drafter.default_tree, Sampling(0.0)).row(0)
            row = drafter._rows[0]
            ref.sync(row.levels, root, context[-1])
            assert len(row.levels) == len(ref.guesses)
            assert sorted((key, g) for key, grams in row.pool.items() for g in grams) == sorted(set(ref.ngrams))
            predicted = [rng.randrange(50, 90) for _ in range(proposal.tree.num_nodes)]
            drafter.observe_pass(None, [proposal.tree], torch.nn.functional.one_hot(torch.tensor([predicted]), 90))
            ref.step([predicted[i] for i in row.top_nodes], root, drafter.window, ngram)
            moved = rng.randrange(1, 4)  # accepted tokens + the bonus
            context += [rng.randrange(10, 20) for _ in range(moved)]
            root += moved
        assert len(ref.ngrams) > 10 if ngram < 4 else len(ref.ngrams) > 4  # the window filled and the pool grew


# -- greedy: vanilla's tokens, on the reference target and on two more families ------------------------------------
def test_reference_greedy_equals_vanilla():
    target, tokenizer = reference.load("target")
    drafter = Lookahead()
    taus = []
    for text in reference.prompts()[:2]:
        ids = tokenizer(text, return_tensors="pt").input_ids[:, -96:]
        expected = generate(target, ids, max_new_tokens=32).sequences
        for tree in (None, Tree.full(2, 2)):  # its own structure; a static tree caps nodes and depth
            out = generate(target, ids, drafter=drafter, tree=tree, max_new_tokens=32)
            assert torch.equal(out.sequences, expected), tree
            taus.append(out.mean_accept_length)
    assert sum(taus) / len(taus) > 1.2


@pytest.mark.parametrize("family", ["Qwen3", "Mistral"])  # full attention; a sliding window of 8 (20-token prompts)
def test_families_greedy_equal_transformers(family):
    target = use_attention(build(family), "eager", BY_NAME[family])
    for ids in (prompt(), torch.tensor([[5, 9, 13, 2, 7] * 4])):
        for drafter, tree in ((Lookahead(), None), (Lookahead(window=5, ngram=4, guesses=5), None),
                              (Lookahead(), DynamicTree(6, 3, 2))):
            expect_greedy(target, ids, drafter, tree)


def test_llama_batch_equals_rows():
    """A left-padded batch where one row ends early (an eos): every row is vanilla greedy's up to its eos, and the
    rows left keep their own windows."""
    target = tiny_llama(seed=2)
    rows = [torch.tensor([5, 9, 13, 2, 7] * 3), torch.tensor([1, 2, 3, 1, 2, 3, 4]), torch.tensor([8, 8])]
    greedy = [hf_greedy(target, row[None], 16)[0, len(row):].tolist() for row in rows]
    eos = greedy[1][5]  # row 1 stops at its sixth token
    out = generate(target, rows, drafter=Lookahead(), max_new_tokens=16, eos_token_id=eos, pad_token_id=0)
    width = max(len(row) for row in rows)
    for b, expected in enumerate(greedy):
        expected = expected[: expected.index(eos) + 1] if eos in expected else expected
        assert out.sequences[b, width : width + len(expected)].tolist() == expected, b
    assert out.rows[1].new_tokens < 16 < sum(r.new_tokens for r in out.rows)


# -- sampling: the target's law, and a control that the test can fail -------------------------------------------
@pytest.fixture(scope="module")
def small_target():
    return tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=11, init_std=0.1)  # tests/test_lossless.py's


def small_lookahead():
    return Lookahead(window=3, ngram=3, guesses=2)


@pytest.mark.parametrize("runs", [600, pytest.param(RUNS, marks=pytest.mark.slow)])
def test_sampling_matches_exact_distribution(small_target, runs):
    sampling = Sampling(1.0)
    counts = sampled_counts(small_target, small_lookahead(), None, sampling, runs=runs)
    assert chi2_pvalue(counts, exact_distribution(small_target, sampling)) > 1e-3


def test_wrong_acceptance_is_detected(small_target, monkeypatch):
    """Negative control: the same drafter with every drafted path accepted must fail the test."""
    monkeypatch.setattr(importlib.import_module("treespec.generate"), "walk_rows", row_by_row(accept_everything))
    sampling = Sampling(1.0)
    counts = sampled_counts(small_target, small_lookahead(), None, sampling, runs=600)
    assert chi2_pvalue(counts, exact_distribution(small_target, sampling)) < 1e-3


def test_bad_settings_are_refused_and_the_kind_is_registered():
    for kwargs, message in (({"window": 1}, "window must be an integer >= 2"), ({"ngram": 1}, "ngram must be"),
                            ({"guesses": -1}, "guesses must be an integer >= 0"), ({"pool_size": True}, "pool_size")):
        with pytest.raises(ValueError, match=message):
            Lookahead(**kwargs)
    drafter = registry.build("lookahead", tiny_llama())
    assert isinstance(drafter, Lookahead) and registry.get("lookahead").drafting_step(drafter) is None
