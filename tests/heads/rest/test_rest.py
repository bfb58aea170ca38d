"""REST (heads/rest/): lossless on the reference target and on two more families, sampled output distributed as the
target's (chi-square, with a negative control); its parts against brute force: the suffix array's order and
searches, the retrieved continuations, the trie's most frequent nodes; the datastore's cache (reused by content,
rebuilt on an edit), its corpora (stdlib minus its held-out files, a folder, a .jsonl, a datasets folder) and the
refusals of a bad corpus."""

from __future__ import annotations

import importlib
import json
import random
from collections import Counter

import numpy as np
import pytest
import torch

from treespec import Tree, generate, reference
from treespec.corpus import STDLIB_CORPUS, load_corpus
from treespec.dynamic_tree import DynamicTree
from treespec.heads import Rest, registry
from treespec.heads.rest import SuffixArray, load_datastore
from treespec.heads.rest.datastore import encode, read_texts
from treespec.heads.rest.drafter import frequent_nodes
from treespec.heads.rest.suffix_array import SEPARATOR
from treespec.sampling import Sampling
from treespec.train.checks.architectures import BY_NAME, build, expect_greedy, prompt, use_attention
from treespec.walker import row_by_row

from tests.helpers import (
    RUNS,
    VOCAB,
    accept_everything,
    chat_tokenizer,
    chi2_pvalue,
    exact_distribution,
    hf_greedy,
    sampled_counts,
    tiny_llama,
)


# -- the suffix array and its searches, against brute force ---------------------------------------------------------
def random_stream(rng, n, alphabet=3):
    """A token stream of a small alphabet (repeats at every length), documents cut by separators."""
    return np.array([SEPARATOR if rng.random() < 0.08 else rng.randrange(alphabet) for _ in range(n)], np.int32)


def followed(tokens, context, m):
    """The starts of the occurrences of ``context``'s last m tokens that a token (not a separator) follows."""
    return [i for i in range(len(tokens) - m) if tokens[i : i + m].tolist() == context[len(context) - m:]
            and tokens[i + m] != SEPARATOR]


def test_suffix_array_and_searches_match_brute_force():
    rng = random.Random(0)
    for _ in range(60):
        tokens = random_stream(rng, rng.randrange(1, 80))
        index = SuffixArray.build(tokens)
        n = len(tokens)
        assert index.sa.tolist() == sorted(range(n), key=lambda i: tokens[i:].tolist())
        for _ in range(10):
            context = [rng.randrange(3) for _ in range(rng.randrange(1, 8))]
            # find: exactly the occurrences of a pattern
            pattern = context[-rng.randrange(1, len(context) + 1):]
            lo, hi = index.find(pattern)
            starts = [i for i in range(n) if tokens[i : i + len(pattern)].tolist() == pattern]
            assert sorted(index.sa[lo:hi].tolist()) == starts
            # longest_match: the longest suffix (2..5 tokens) followed by a token, and those occurrences
            best = max((m for m in range(2, min(5, len(context)) + 1) if followed(tokens, context, m)), default=0)
            m, lo, hi = index.longest_match(context, 5, 2)
            assert m == best and sorted(index.sa[lo:hi].tolist()) == (followed(tokens, context, m) if m else [])
            if m:  # continuations: the next tokens of each, cut where a document ends
                got = index.continuations(lo, hi, m, depth=3, limit=1000)
                expected = []
                for i in followed(tokens, context, m):
                    nxt = tokens[i + m : i + m + 3].tolist() + [SEPARATOR] * 3
                    cut = nxt.index(SEPARATOR) if SEPARATOR in nxt else 3
                    expected.append(tuple(nxt[:cut] + [SEPARATOR] * (3 - cut)))
                assert sorted(map(tuple, got.tolist())) == sorted(expected)


def test_continuations_past_the_limit_are_sampled_evenly():
    """More occurrences than ``limit``: an even sample of the range (which is sorted by continuation), so each
    continuation keeps about its share, not the first ones in sort order."""
    tokens = np.array(([7, 1] * 300 + [7, 2] * 100 + [SEPARATOR]), np.int32)
    index = SuffixArray.build(tokens)
    m, lo, hi = index.longest_match([7], 1, 1)
    assert (m, hi - lo) == (1, 400)
    got = Counter(index.continuations(lo, hi, m, depth=1, limit=40)[:, 0].tolist())
    assert got == {1: 30, 2: 10}


def brute_tree(rows, budget, depth, width):
    """The most frequent nodes of the trie of ``rows`` by brute force, in the same order: by count, then depth, then
    token path."""
    counts = Counter(tuple(r[:j]) for r in rows for j in range(1, depth + 1)
                     if len(r) >= j and SEPARATOR not in r[:j])
    ranks = {}
    for prefix in counts:
        siblings = sorted((p for p in counts if len(p) == len(prefix) and p[:-1] == prefix[:-1]),
                          key=lambda p: (-counts[p], p[-1]))
        ranks[prefix] = siblings.index(prefix)
    chosen, paths = [], {(): ()}
    for prefix in sorted(counts, key=lambda p: (-counts[p], len(p), p)):
        if len(chosen) < budget and prefix[:-1] in paths and ranks[prefix] < width:
            paths[prefix] = (*paths[prefix[:-1]], ranks[prefix])
            chosen.append(prefix)
    return [paths[p] for p in chosen], [p[-1] for p in chosen]


def test_frequent_nodes_match_brute_force():
    rng = random.Random(1)
    for _ in range(40):
        rows = [[rng.choice([0, 0, 1, 2, 3, SEPARATOR]) for _ in range(4)] for _ in range(rng.randrange(1, 30))]
        budget, width = rng.randrange(1, 12), rng.randrange(1, 4)
        got = frequent_nodes(np.array(rows, np.int32), DynamicTree(budget, 3, width))
        assert got == brute_tree(rows, budget, 3, width)
        # a static tree: only its paths, in the same order
        tree = Tree.full(2, 2)
        paths, tokens = frequent_nodes(np.array(rows, np.int32), tree)
        wide_paths, wide_tokens = brute_tree(rows, 100, 2, 2)
        assert paths == [p for p in wide_paths if p in set(tree.paths)][: len(tree)]


# -- greedy: vanilla's tokens, on the reference target and on two more families ------------------------------------
@pytest.fixture(scope="module")
def reference_target():
    target, tokenizer = reference.load("target")
    held_out = [tokenizer(p, return_tensors="pt").input_ids[:, -96:] for p in reference.prompts()[:2]]
    # a slice of the stdlib corpus's training files keeps the test fast; the full one is the comparison's
    texts = read_texts("stdlib")[:150]
    return target, held_out, SuffixArray.build(encode(tokenizer, texts))


def test_reference_greedy_equals_vanilla(reference_target):
    """Two held-out prompts with REST's default tree and a chain: vanilla greedy's tokens, and it speculates."""
    target, held_out, index = reference_target
    drafter = Rest(index)
    taus = []
    for ids in held_out:
        expected = generate(target, ids, max_new_tokens=32).sequences
        for tree in (None, Tree.chain(3)):
            out = generate(target, ids, drafter=drafter, tree=tree, max_new_tokens=32)
            assert torch.equal(out.sequences, expected), tree
            taus.append(out.mean_accept_length)
    assert sum(taus) / len(taus) > 1.05


def own_text_index(target, prompts, seed=0):
    """A datastore holding the target's own greedy continuations of ``prompts`` (long accepted paths) and random
    documents of its vocabulary (rejected candidates)."""
    g = torch.Generator().manual_seed(seed)
    docs = [hf_greedy(target, p, 24)[0, -30:].tolist() for p in prompts]
    docs += [torch.randint(0, target.config.vocab_size, (40,), generator=g).tolist() for _ in range(4)]
    return SuffixArray.build(np.array([t for d in docs for t in [*d, SEPARATOR]], np.int32))


@pytest.mark.parametrize("family", ["Qwen3", "Mistral"])  # full attention; a sliding window of 8 (20-token prompts)
def test_families_greedy_equal_transformers(family):
    target = use_attention(build(family), "eager", BY_NAME[family])
    repetitive = torch.tensor([[5, 9, 13, 2, 7] * 4])
    drafter = Rest(own_text_index(target, [prompt()]), min_match=1)
    accepted = []
    for ids in (prompt(), repetitive):
        for tree in (None, Tree.full(2, 2), Tree.chain(4)):
            accepted.append(expect_greedy(target, ids, drafter, tree).mean_accept_length)
    assert max(accepted) > 1.5  # the datastore held the target's own text: it drafted and was accepted


def test_llama_batch_equals_rows():
    """A left-padded batch: every row is vanilla greedy's."""
    target = tiny_llama(seed=2)
    rows = [torch.tensor([5, 9, 13, 2, 7] * 3), torch.tensor([1, 2, 3, 1, 2, 3, 4])]
    drafter = Rest(own_text_index(target, [r[None] for r in rows]), min_match=1)
    out = generate(target, rows, drafter=drafter, max_new_tokens=16)
    for b, row in enumerate(rows):
        assert torch.equal(out.sequences[b, -16:], hf_greedy(target, row[None], 16)[0, len(row):])
    assert out.mean_accept_length > 1.5


# -- sampling: the target's law, and a control that the test can fail -------------------------------------------
@pytest.fixture(scope="module")
def small_target():
    return tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=11, init_std=0.1)  # tests/test_lossless.py's


def small_rest():
    tokens = random_stream(random.Random(2), 300, alphabet=VOCAB)
    return Rest(SuffixArray.build(tokens), min_match=1, max_match=3)


@pytest.mark.parametrize("runs", [600, pytest.param(RUNS, marks=pytest.mark.slow)])
def test_sampling_matches_exact_distribution(small_target, runs):
    sampling = Sampling(1.0)
    counts = sampled_counts(small_target, small_rest(), DynamicTree(4, 2, 2), sampling, runs=runs)
    assert chi2_pvalue(counts, exact_distribution(small_target, sampling)) > 1e-3


def test_wrong_acceptance_is_detected(small_target, monkeypatch):
    """Negative control: the same drafter and tree with every drafted path accepted must fail the test."""
    monkeypatch.setattr(importlib.import_module("treespec.generate"), "walk_rows", row_by_row(accept_everything))
    sampling = Sampling(1.0)
    counts = sampled_counts(small_target, small_rest(), DynamicTree(4, 2, 2), sampling, runs=600)
    assert chi2_pvalue(counts, exact_distribution(small_target, sampling)) < 1e-3


# -- the datastore: corpora, cache, refusals ------------------------------------------------------------------------
def test_stdlib_corpus_leaves_out_the_held_out_files():
    texts = read_texts("stdlib")
    corpus = load_corpus(**STDLIB_CORPUS)
    assert texts == [t for _, t in corpus.train] and corpus.val
    assert not {t for _, t in corpus.val} & set(texts)


def test_cache_is_reused_by_content_and_rebuilt_on_an_edit(tmp_path, monkeypatch):
    tokenizer = chat_tokenizer()
    corpus = tmp_path / "texts"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the cat sat on the mat\n" * 3)
    (corpus / "b.txt").write_text("a dog ran\n")
    built = []
    real = SuffixArray.build
    monkeypatch.setattr(SuffixArray, "build", lambda tokens: built.append(len(tokens)) or real(tokens))
    cache = tmp_path / "cache"
    first = load_datastore(corpus, tokenizer, cache_dir=cache, log=lambda *_: None)
    again = load_datastore(corpus, tokenizer, cache_dir=cache, log=lambda *_: None)
    assert len(built) == 1 and np.array_equal(first.tokens, again.tokens) and np.array_equal(first.sa, again.sa)
    copy = tmp_path / "copy"  # the same files elsewhere: the same content, the same datastore
    copy.mkdir()
    for f in corpus.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    load_datastore(copy, tokenizer, cache_dir=cache, log=lambda *_: None)
    assert len(built) == 1
    (corpus / "b.txt").write_text("a dog ran far\n")  # an edit: built again
    edited = load_datastore(corpus, tokenizer, cache_dir=cache, log=lambda *_: None)
    assert len(built) == 2 and len(edited) > len(first)
    assert sorted(p.name for p in cache.iterdir()) == sorted(p.name for p in cache.glob("rest-*.safetensors"))
    # what it holds: each document's ids, then a separator
    expected = [t for text in ("the cat sat on the mat\n" * 3, "a dog ran far\n")
                for t in [*tokenizer(text, add_special_tokens=False).input_ids, SEPARATOR]]
    assert edited.tokens.tolist() == expected
    # a corrupt cache file is rebuilt, not trusted
    for f in cache.iterdir():
        f.write_bytes(b"not a safetensors file")
    assert np.array_equal(load_datastore(corpus, tokenizer, cache_dir=cache, log=lambda *_: None).sa, edited.sa)


def test_jsonl_and_datasets_corpora(tmp_path):
    rows = ["first document", "second one", "third"]
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    assert sorted(read_texts(jsonl)) == sorted(rows)
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": rows}).save_to_disk(str(tmp_path / "ds"))
    assert read_texts(tmp_path / "ds") == rows
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": rows[:2]})}).save_to_disk(str(tmp_path / "dd"))
    assert read_texts(tmp_path / "dd") == rows[:2]
    datasets.Dataset.from_dict({"body": rows}).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(ValueError, match="no 'text' column .*body"):
        read_texts(tmp_path / "bad")


def test_a_one_document_corpus_is_stored_once(tmp_path):
    # a lone document is both train and validation (a language model needs both), and REST read both: "2 documents"
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("the cat sat on the mat\n")
    assert load_corpus(str(tmp_path / "texts"), pattern="*", val_fraction=0.0).documents() == [
        ("a.txt", "the cat sat on the mat\n")]
    assert read_texts(tmp_path / "texts") == ["the cat sat on the mat\n"]
    lines = []
    index = load_datastore(tmp_path / "texts", chat_tokenizer(), cache_dir=tmp_path / "cache", log=lines.append)
    assert "(1 documents)" in lines[0] and int((index.tokens == SEPARATOR).sum()) == 1


@pytest.mark.parametrize("line, message", [
    (b'{"text": "ok"\n', r"c.jsonl line 2 is not JSON \(Expecting ',' delimiter at column"),
    (b'{"text": "caf\xe9"}\n', r"c.jsonl line 2 is not UTF-8 text \(byte b'\\xe9' at column 14\)"),
])
def test_a_bad_jsonl_corpus_line_is_named(tmp_path, line, message):
    # a bare JSONDecodeError / UnicodeDecodeError named neither the file nor the line
    (tmp_path / "c.jsonl").write_bytes(b'{"text": "first"}\n' + line + b'{"text": "third"}\n')
    with pytest.raises(ValueError, match=message):
        read_texts(tmp_path / "c.jsonl")
    with pytest.raises(ValueError, match=message):
        load_corpus(str(tmp_path / "c.jsonl"))


@pytest.mark.parametrize("setting, message", [
    ({"max_files": 0}, r"max_files must be an integer >= 1 or None \(all\), got 0"),  # read every file
    ({"max_files": -1}, r"max_files must be an integer >= 1"),  # "holds no documents"
    ({"val_fraction": 1.5}, r"val_fraction must be a number in \[0, 1\), got 1.5"),  # an empty train part, unsaid
])
def test_impossible_corpus_settings_are_named(tmp_path, setting, message):
    (tmp_path / "a.txt").write_text("alpha beta\n")
    with pytest.raises(ValueError, match=message):
        load_corpus(str(tmp_path), pattern="*", **setting)


def test_bad_corpus_and_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="does not exist; give 'stdlib', a folder"):
        Rest(tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="is a file but not a .jsonl"):
        Rest(tmp_path / "notes.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no documents"):
        load_datastore(tmp_path / "empty", chat_tokenizer(), cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match="must be 'stdlib', a folder"):
        Rest(42)
    with pytest.raises(ValueError, match="min_match=5 exceeds max_match=4"):
        Rest(SuffixArray.build(np.array([1, 2], np.int32)), min_match=5, max_match=4)
    with pytest.raises(ValueError, match="max_retrieved must be an integer >= 1"):
        Rest(SuffixArray.build(np.array([1, 2], np.int32)), max_retrieved=0)
    with pytest.raises(ValueError, match="token ids up to 99; the target has 64"):
        generate(tiny_llama(), torch.tensor([[1, 2]]), drafter=Rest(SuffixArray.build(np.array([99], np.int32))),
                 max_new_tokens=2)
    with pytest.raises(ValueError, match="target's tokenizer"):
        generate(tiny_llama(), torch.tensor([[1, 2]]), drafter=Rest(tmp_path / "empty"), max_new_tokens=2)


def test_registry_reads_the_corpus_from_the_source(tmp_path, monkeypatch):
    """drafter=rest in the comparison: the registry's load reads the datastore of ``source`` (None: stdlib)."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("def f(x):\n    return x\n")
    target = tiny_llama(vocab=512)
    monkeypatch.setattr("treespec.heads.rest.kind.tokenizer_of", lambda target: chat_tokenizer())
    monkeypatch.chdir(tmp_path)  # the default cache folder, .cache/data, under the test's folder
    drafter = registry.build("rest", target, source=str(tmp_path / "corpus"))
    assert isinstance(drafter, Rest) and len(drafter.index) > 5
    assert registry.get("rest").drafting_step(drafter) is None  # model-free: nothing to time
