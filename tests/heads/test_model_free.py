"""Token Recycling and SuffixDecoding (heads/recycling/, heads/suffix/): lossless on the reference target and on two
more families, sampled output distributed as the target's (chi-square, with negative controls), and their parts
against brute force: the matrix's update and breadth-first read, the suffix trie's counts, matches and
evictions, the adaptive tree size, what persists across generate() calls; the loop's observe_pass hook."""

from __future__ import annotations

import importlib
import random
from collections import Counter

import pytest
import torch

from treespec import Tree, generate, reference
from treespec.drafter import Committed
from treespec.dynamic_tree import DynamicTree
from treespec.heads import PromptLookup, SuffixDecoding, TokenRecycling
from treespec.heads.recycling import RECYCLING_TREE, RECYCLING_TREE_80
from treespec.heads.suffix import SuffixTrie
from treespec.planning.tree_spec import build_tree, check_tree_spec
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

DRAFTERS = {"recycling": TokenRecycling, "suffix": SuffixDecoding}


# -- greedy: vanilla's tokens, on the reference target and on two more families ------------------------------------
@pytest.fixture(scope="module")
def reference_target():
    target, tokenizer = reference.load("target")
    held_out = [tokenizer(p, return_tensors="pt").input_ids[:, -96:] for p in reference.prompts()[:2]]
    return target, held_out


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_reference_greedy_equals_vanilla(reference_target, name):
    """Two held-out prompts through one drafter (its state carried across them, as in a comparison), each
    with its default tree and a chain; every output is vanilla greedy's, and it speculates (τ > 1)."""
    target, held_out = reference_target
    drafter = DRAFTERS[name]()
    taus = []
    for ids in held_out:
        expected = generate(target, ids, max_new_tokens=32).sequences
        for tree in (None, Tree.chain(3)):
            out = generate(target, ids, drafter=drafter, tree=tree, max_new_tokens=32)
            assert torch.equal(out.sequences, expected), (name, tree)
            taus.append(out.mean_accept_length)
    assert sum(taus) / len(taus) > 1.2


@pytest.mark.parametrize("family", ["Qwen3", "Mistral"])  # full attention; a sliding window of 8 (20-token prompts)
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_families_greedy_equal_transformers(name, family):
    target = use_attention(build(family), "eager", BY_NAME[family])
    drafter = DRAFTERS[name]()
    repetitive = torch.tensor([[5, 9, 13, 2, 7] * 4])  # long accepted paths: compaction across the window
    for ids in (prompt(), repetitive, prompt()):  # the third sees the matrix / outputs the first two left
        expect_greedy(target, ids, drafter, None)
        expect_greedy(target, ids, drafter, Tree.full(2, 2))


def test_llama_batch_equals_rows():
    """A left-padded batch: every row is vanilla greedy's (rows' own suffix trees, one shared matrix)."""
    target = tiny_llama(seed=2)
    rows = [torch.tensor([5, 9, 13, 2, 7] * 3), torch.tensor([1, 2, 3, 1, 2, 3, 4])]
    for name, make in DRAFTERS.items():
        out = generate(target, rows, drafter=make(), max_new_tokens=16)
        for b, row in enumerate(rows):
            expected = hf_greedy(target, row[None], 16)[0, len(row):]
            assert torch.equal(out.sequences[b, -16:], expected), name


# -- sampling: the target's law, and a control that the test can fail -------------------------------------------
@pytest.fixture(scope="module")
def small_target():
    return tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=11, init_std=0.1)  # tests/test_lossless.py's


SAMPLED = {"recycling": (lambda: TokenRecycling(k=2), Tree.full(2, 2)),
           "suffix": (lambda: SuffixDecoding(alpha=4.0, min_prob=0.0), DynamicTree(4, 2, 2))}


# 600 generations per case keep the default suite fast (the negative controls give p ≈ 0 at 600 already); the slow
# run takes RUNS (TREESPEC_LOSSLESS_RUNS, 3000 by default), as tests/test_lossless.py does
@pytest.mark.parametrize("runs", [600, pytest.param(RUNS, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", list(SAMPLED))
def test_sampling_matches_exact_distribution(small_target, name, runs):
    make, tree = SAMPLED[name]
    sampling = Sampling(1.0)
    counts = sampled_counts(small_target, make(), tree, sampling, runs=runs)
    assert chi2_pvalue(counts, exact_distribution(small_target, sampling)) > 1e-3


@pytest.mark.parametrize("name", list(SAMPLED))
def test_wrong_acceptance_is_detected(small_target, name, monkeypatch):
    """Negative control: the same drafter and tree with every drafted path accepted must fail the test."""
    monkeypatch.setattr(importlib.import_module("treespec.generate"), "walk_rows", row_by_row(accept_everything))
    make, tree = SAMPLED[name]
    sampling = Sampling(1.0)
    counts = sampled_counts(small_target, make(), tree, sampling, runs=600)
    assert chi2_pvalue(counts, exact_distribution(small_target, sampling)) < 1e-3


# -- the loop's hook -----------------------------------------------------------------------------------------------
class Spy(TokenRecycling):
    def __init__(self):
        super().__init__()
        self.seen = []

    def observe_pass(self, tokens, trees, logits):
        self.seen.append((tokens.clone(), [t.num_nodes for t in trees], logits.clone()))
        super().observe_pass(tokens, trees, logits)


class Deaf(PromptLookup):
    def observe_pass(self, tokens, trees, logits):
        raise AssertionError("a drafter that does not observe logits is never shown them")


def test_observe_pass_shows_every_verified_node():
    """The hook sees every node of every pass (rejected ones included) with the target's own logits there."""
    target = tiny_llama(seed=4)
    ids = torch.tensor([[5, 9, 13, 2, 7] * 3])
    spy = Spy()
    out = generate(target, ids, drafter=spy, tree=Tree.full(2, 2), max_new_tokens=12)
    assert len(spy.seen) == out.passes
    tokens, nodes, logits = spy.seen[0]
    assert tokens.shape[1] == nodes[0] and logits.shape[:2] == tokens.shape
    # node 0 is the root, fed after the prompt: its logits are the target's there, and so is a candidate's
    # after its own path (the tree mask at work)
    root = out.sequences[:, ids.shape[1] : ids.shape[1] + 1]
    assert torch.equal(tokens[:, :1], root)
    full = target(torch.cat([ids, root, tokens[:, 1:2]], dim=1)).logits[0]
    assert torch.allclose(logits[0, 0], full[-2], atol=1e-4) and torch.allclose(logits[0, 1], full[-1], atol=1e-4)
    generate(target, ids, drafter=Deaf(), tree=Tree.full(2, 2), max_new_tokens=12)  # observes_logits False


# -- Token Recycling's parts --------------------------------------------------------------------------------------
def test_recycling_update_and_read():
    """observe_pass writes each node's token's row with the top-k of its logits (the last node wins for a token
    seen twice); propose reads node i as M[token of its parent, its rank], breadth-first."""
    drafter = TokenRecycling(k=3, prompt_bigrams=False)
    drafter.check_target(tiny_llama(vocab=16))
    tokens = torch.tensor([[4, 7, 4, 9]])  # token 4 twice: node 2's logits win
    logits = torch.randn(1, 4, 16, generator=torch.Generator().manual_seed(0))
    drafter.observe_pass(tokens, [Tree.chain(3)], logits)
    top = logits.topk(3, dim=-1).indices[0]
    matrix = drafter.matrix
    assert torch.equal(matrix[7].long(), top[1]) and torch.equal(matrix[9].long(), top[3])
    assert torch.equal(matrix[4].long(), top[2])
    tree = Tree.from_paths([(0,), (2,), (0, 1), (2, 0), (0, 1, 2)])
    proposal = drafter.propose(committed_of([3, 1, 4]), None, tree, Sampling(0.0)).row(0)
    expected = {0: 4}
    for i in range(1, tree.num_nodes):
        expected[i] = int(matrix[expected[int(tree.parents[i])], int(tree.ranks[i])])
    assert proposal.tokens.tolist() == [expected[i] for i in range(1, tree.num_nodes)]


def committed_of(tokens):
    return Committed(torch.tensor([tokens]), [len(tokens)])


def test_recycling_persistence_and_prompt_bigrams():
    target = tiny_llama(seed=5)
    ids = torch.tensor([[5, 9, 13, 2, 7] * 3])
    kept, fresh = TokenRecycling(), TokenRecycling(persistent=False)
    for drafter in (kept, fresh):
        generate(target, ids, drafter=drafter, max_new_tokens=8)
    after_one = kept.matrix.clone()
    generate(target, torch.tensor([[1, 2]]), drafter=kept, max_new_tokens=4)
    changed = (kept.matrix != after_one).any(-1)
    assert changed.any() and not changed.all()  # the second call started from the first's matrix
    generate(target, torch.tensor([[1, 2]]), drafter=fresh, max_new_tokens=4)
    assert not fresh._filled[5] and fresh.matrix[5, 0] == 0  # back to zeros, then only the new call's rows
    # the prompt's bigrams fill rows the target never predicted after, never one it did
    cold = TokenRecycling()
    cold.check_target(target)
    cold._filled[9] = True
    cold.prefill(torch.tensor([[5, 9, 13, 5, 11]]), None)
    assert cold.matrix[5, 0] == 11 and cold.matrix[13, 0] == 5 and cold.matrix[9, 0] == 0


def test_recycling_refuses_bad_settings():
    with pytest.raises(ValueError, match="asks for rank 8; the matrix keeps k=8"):
        TokenRecycling(default_tree=Tree.full(9, 1))
    with pytest.raises(ValueError, match="integer tensor"):
        TokenRecycling(k=4, init=torch.zeros(10, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="holds a matrix for 10 tokens"):
        generate(tiny_llama(), torch.tensor([[1, 2]]), drafter=TokenRecycling(k=2, init=torch.zeros(10, 2,
                 dtype=torch.long)), max_new_tokens=2)
    with pytest.raises(ValueError, match="cannot grow DynamicTree"):
        generate(tiny_llama(), torch.tensor([[1, 2]]), drafter=TokenRecycling(), tree=DynamicTree(4, 2, 2),
                 max_new_tokens=2)
    assert len(RECYCLING_TREE) == 12 and len(RECYCLING_TREE_80) == 80
    assert TokenRecycling().default_tree == RECYCLING_TREE and TokenRecycling(k=1).default_tree == Tree.chain(10)


# -- SuffixDecoding's parts -----------------------------------------------------------------------------------------
def brute_counts(docs, depth):
    return Counter(tuple(d[i : i + n]) for d in docs for n in range(1, depth + 1) for i in range(len(d) - n + 1))


def test_suffix_trie_counts_matches_and_removal():
    """Counts, matches and removals against brute force over every substring, with strings seen once kept as tails
    (places in their documents): random documents of a small alphabet repeat at every length."""
    rng = random.Random(0)
    docs = [[rng.randrange(3) for _ in range(rng.randrange(1, 40))] for _ in range(8)] + [[1] * 12]
    trie = SuffixTrie(depth=5)
    handles = []
    for d in docs:  # each document added in pieces, as decoding appends
        handle = trie.add(d[:3])
        trie.add(d[3:], handle)
        handles.append(handle)

    def check(live):
        brute = brute_counts([docs[i] for i in live], 5)
        strings = {tuple(rng.randrange(3) for _ in range(rng.randrange(1, 6))) for _ in range(300)} | set(brute)
        assert all(trie.count(list(s)) == brute[s] for s in strings)
        for _ in range(50):
            context = [rng.randrange(3) for _ in range(rng.randrange(1, 10))]
            place, m = trie.match(context, 3)
            followed = {s[:-1] for s in brute if len(s) >= 2} | ({()} if brute else set())
            best = max((n for n in range(min(3, len(context)) + 1) if tuple(context[len(context) - n:]) in followed),
                       default=0)
            assert m == best and (place is None) == (not brute)
            if place is not None:  # its children: each continuation with its count
                kids = {token: count for token, count, _ in trie.children(place, m)}
                prefix = tuple(context[len(context) - m:])
                assert kids == {s[-1]: c for s, c in brute.items() if len(s) == m + 1 and s[:-1] == prefix}

    check(range(len(docs)))
    assert trie.tokens == sum(map(len, docs))
    for i in (0, 3, 8):
        trie.remove(handles[i])
    check([1, 2, 4, 5, 6, 7])
    for i in (1, 2, 4, 5, 6, 7):
        trie.remove(handles[i])
    assert trie.tokens == 0 and not trie.root.kids


def test_suffix_trie_documents_growing_in_turns_keep_their_counts():
    """Documents appended to in turns (as concurrent requests decode): another document turning one's last tail into
    a node once lost that document's later occurrences (count([1, 3, 3]) was 0)."""
    trie = SuffixTrie(depth=5)
    first = trie.add([1, 3])
    trie.add([1, 3])  # "3" and "1 3" are nodes now, made from the first document's tails
    trie.add([3], first)
    assert (trie.count([1, 3, 3]), trie.count([3, 3]), trie.count([3])) == (1, 1, 3)
    rng = random.Random(1)
    docs, handles = [[] for _ in range(5)], [None] * 5
    for _ in range(120):
        i, piece = rng.randrange(5), [rng.randrange(3) for _ in range(rng.randrange(1, 4))]
        handles[i] = trie.add(piece, handles[i])
        docs[i] += piece
    brute = brute_counts(docs + [[1, 3, 3], [1, 3]], 5)
    assert all(trie.count(list(s)) == c for s, c in brute.items())
    for i in (0, 2):
        trie.remove(handles[i])
    after = brute_counts([docs[1], *docs[3:], [1, 3, 3], [1, 3]], 5)
    assert all(trie.count(list(s)) == after[s] for s in brute)


@pytest.mark.parametrize("setting, message", [
    ({"alpha": float("inf")}, r"alpha must be a finite number > 0 .*got inf"),  # was an OverflowError at a proposal
    ({"alpha": float("nan")}, r"alpha must be a finite number > 0"),
    ({"alpha": True}, r"alpha must be a finite number > 0"),
    ({"min_prob": "0.1"}, r"min_prob must be a number in \[0, 1\), got '0.1'"),  # was a bare TypeError
    ({"default_tree": "abc"}, r"default_tree must be a Tree or a DynamicTree.*got 'abc'"),  # an AttributeError
])
def test_suffix_decoding_refuses_bad_settings_by_name(setting, message):
    with pytest.raises(ValueError, match=message):
        SuffixDecoding(**setting)


def test_outputs_added_from_another_tokenizer_are_named_before_decoding():
    # add_output([-1, 10**12]) was taken, and the first proposal of 10**12 failed in the target's embedding
    drafter, target = SuffixDecoding(), tiny_llama()
    for bad in ([-1, 3], ["a", "b"], [1.5]):
        with pytest.raises(ValueError, match=r"add_output takes token ids \(integers >= 0\)"):
            drafter.add_output(bad)
    drafter.add_output([1, 2, 10**12])
    with pytest.raises(ValueError, match=r"earlier outputs with token id 1000000000000, outside the target's "
                                         r"vocabulary of 64: .* clear\(\) forgets them"):
        generate(target, torch.tensor([[1, 2, 3]]), drafter=drafter, max_new_tokens=4)
    drafter.clear()
    assert generate(target, torch.tensor([[1, 2, 3]]), drafter=drafter, max_new_tokens=4).new_tokens == 4


def test_suffix_tree_size_follows_the_match():
    """The grown tree holds at most alpha × (match length) nodes, within the tree's budget, best-first by
    frequency, siblings ranked by count."""
    trie = SuffixTrie(depth=12)
    trie.add([1, 2, 3, 4] * 2 + [1, 2, 3, 5] + [1, 2, 6, 7, 8])
    drafter = SuffixDecoding(alpha=1.0, min_prob=0.0)
    node, m = trie.match([9, 1, 2, 3], 8)
    assert m == 3
    score, paths, tokens = drafter.grow(trie, node, m, DynamicTree(16, 4, 2))
    assert len(paths) == 3 and paths[0] == (0,) and tokens[0] == 4  # "1 2 3" → 4 twice, 5 once
    _, paths, _ = drafter.grow(trie, *trie.match([1, 2], 8), DynamicTree(16, 4, 2))
    assert len(paths) == 2  # a 2-token match: 2 nodes
    _, paths, _ = drafter.grow(trie, node, m, Tree.chain(2))  # a static tree: its paths only
    assert paths == [(0,), (0, 0)]


def test_suffix_outputs_persist_across_calls():
    """A call's output joins the cross-request index (all but its last step); the next call on a prompt that
    repeats it drafts from it; eviction keeps the index within max_cached_tokens."""
    target = tiny_llama(seed=6)
    drafter = SuffixDecoding(max_cached_tokens=60)
    first = generate(target, torch.tensor([[3, 1, 4, 1, 5]]), drafter=drafter, max_new_tokens=24)
    generate(target, torch.tensor([[2, 7]]), drafter=drafter, max_new_tokens=4)  # reset() files the first output
    output = first.sequences[0, 5:].tolist()
    indexed = drafter._cached[0].tokens
    # what the drafter saw before its last proposal (the last pass may be a plain one, drafting nothing)
    assert indexed == output[: len(indexed)] and len(indexed) >= len(output) - sum(first.accept_lengths[-2:])
    again = generate(target, first.sequences[:, :12], drafter=drafter, max_new_tokens=16)
    assert torch.equal(again.sequences, hf_greedy(target, first.sequences[:, :12], 16))
    assert again.mean_accept_length > 2
    for seed in range(4):
        generate(target, torch.tensor([[seed, 3]]), drafter=drafter, max_new_tokens=24)
    assert drafter.outputs.tokens <= 60


def test_default_tree_spec():
    assert check_tree_spec({"kind": "default"}) == {"kind": "default"}
    assert build_tree({"kind": "default"}, default=RECYCLING_TREE) is RECYCLING_TREE
    with pytest.raises(ValueError, match="needs the drafter"):
        build_tree({"kind": "default"})
    out = generate(tiny_llama(), torch.tensor([[1, 2, 3]]), drafter=SuffixDecoding(), tree={"kind": "default"},
                   max_new_tokens=3)
    assert out.tree == SuffixDecoding().default_tree
