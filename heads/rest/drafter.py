"""REST: draft trees retrieved from a datastore of text, no model and no training.

He et al. 2024, "REST: Retrieval-Based Speculative Decoding". Each step, for each row:

1. the longest suffix of the row's context, ``max_match`` tokens down to ``min_match``, that occurs in the
   datastore followed by a token (heads/rest/suffix_array.py: binary searches on its suffix array);
2. the tokens after each occurrence, at most ``max_retrieved`` of them (the paper's N = 5000), the tree's depth
   long;
3. a trie of those continuations, each node counting the continuations through it; its most frequent nodes,
   within the tree's budget, are the draft tree (a node counts at least as often as its children, so the most
   frequent ones form a tree).

The tree it is given is a budget: a ``DynamicTree(total_tokens, depth, top_k)`` caps the nodes, the depth and the
children per node; a static ``Tree`` restricts the draft to its paths (a chain: the most frequent continuation).
A node's children are ranked by count (then token id), a deterministic function of the past, so the tree is
verified losslessly like top-k ranks (treespec/walker.py): greedy output equals vanilla greedy and sampled output
follows the target. A row without a match verifies its root alone.

The index stays on the host (numpy int32 arrays); a step reads back from the device only the tokens committed
since the last one, to extend each row's context.

Left out (docs/usage.md, "REST"): DraftRetriever's Rust suffix array and its datastores from UltraChat and The
Stack; here numpy's sort builds the array (prefix doubling) and Python's bisect searches it, over the corpus the
user names (the stdlib corpus for the code reference target).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from treespec.drafter import Committed, Drafter, Proposal, Proposals
from treespec.dynamic_tree import DynamicTree
from treespec.heads.rest.datastore import check_corpus, load_datastore
from treespec.heads.rest.suffix_array import SEPARATOR, SuffixArray
from treespec.sampling import Sampling
from treespec.tree import Tree

EMPTY = Proposal(tree=Tree.chain(0), tokens=torch.empty(0, dtype=torch.long))


def tokenizer_of(target):
    """The tokenizer saved beside ``target``'s weights (its ``name_or_path``), to encode a corpus with."""
    from transformers import AutoTokenizer

    where = getattr(target, "name_or_path", "") or ""
    try:
        return AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"REST encodes its corpus with the target's tokenizer, and none was found at the target's "
                         f"name_or_path {where!r} ({type(err).__name__}); give Rest(..., tokenizer=...)") from None


class Rest(Drafter):
    grows_dynamic_trees = True
    per_row = ("_contexts", "_lengths")

    def __init__(self, corpus: str | os.PathLike | SuffixArray = "stdlib", *, tokenizer=None,
                 pattern: str | None = None, max_retrieved: int = 5000, max_match: int = 16, min_match: int = 2,
                 cache_dir: str | os.PathLike = ".cache/data", default_tree: Tree | DynamicTree | None = None):
        for name, value in (("max_retrieved", max_retrieved), ("max_match", max_match), ("min_match", min_match)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if min_match > max_match:
            raise ValueError(f"min_match={min_match} exceeds max_match={max_match}")
        if not isinstance(corpus, SuffixArray):
            check_corpus(corpus)  # a bad path is refused now, not at the first generate()
        self.corpus, self.tokenizer, self.pattern, self.cache_dir = corpus, tokenizer, pattern, cache_dir
        self.max_retrieved, self.max_match, self.min_match = max_retrieved, max_match, min_match
        self.index: SuffixArray | None = corpus if isinstance(corpus, SuffixArray) else None
        self.default_tree = default_tree if default_tree is not None else DynamicTree(16, 8, 4)
        self._contexts: list[list[int]] = []  # each row's last max_match tokens
        self._lengths: list[int] = []  # each row's committed tokens seen so far

    def check_target(self, target) -> None:
        if self.index is None:  # built (or read from the cache) once, with the first target
            self.index = load_datastore(self.corpus, self.tokenizer or tokenizer_of(target), pattern=self.pattern,
                                        cache_dir=self.cache_dir)
        head = target.get_output_embeddings()
        vocab = head.weight.shape[0] if head is not None else target.config.vocab_size
        if self.index.vocab_needed > vocab:
            raise ValueError(f"REST's datastore holds token ids up to {self.index.vocab_needed - 1}; the target has "
                             f"{vocab}: it was encoded with another tokenizer")

    # -- the loop's calls -------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self._contexts, self._lengths = [], []

    def prefill(self, input_ids, features, attention_mask=None) -> None:
        ids = input_ids.cpu()
        mask = None if attention_mask is None else attention_mask.cpu().bool()
        rows = [ids[b] if mask is None else ids[b][mask[b]] for b in range(ids.shape[0])]
        self._contexts = [row[-self.max_match :].tolist() for row in rows]
        self._lengths = [len(row) for row in rows]

    def propose(self, committed: Committed, feature, tree: Tree | DynamicTree, sampling: Sampling,
                generator=None) -> Proposals:
        # the tokens committed since the last step (the last accepted path and its bonus token): one read
        tails, counts = committed.tails(self._lengths)
        proposals = []
        for b, (tail, n) in enumerate(zip(tails.tolist(), counts, strict=True)):
            self._contexts[b] = (self._contexts[b] + tail[:n])[-self.max_match :]
            self._lengths[b] += n
            proposals.append(self.propose_row(self._contexts[b], tree))
        return Proposals.stack(proposals)

    # -- one row's tree ---------------------------------------------------------------------------------------------
    def propose_row(self, context: list[int], tree: Tree | DynamicTree) -> Proposal:
        """The draft tree for ``context``: retrieval, then the most frequent nodes of the continuations' trie."""
        m, lo, hi = self.index.longest_match(context, self.max_match, self.min_match)
        if m == 0:
            return EMPTY
        continuations = self.index.continuations(lo, hi, m, tree.depth, self.max_retrieved)
        paths, tokens = frequent_nodes(continuations, tree)
        if not paths:
            return EMPTY
        grown = Tree(paths)
        token_of = dict(zip(paths, tokens, strict=True))
        return Proposal(tree=grown, tokens=torch.tensor([token_of[p] for p in grown.paths]))


def frequent_nodes(continuations: np.ndarray, tree: Tree | DynamicTree) -> tuple[list[tuple], list[int]]:
    """(paths, tokens) of the most frequent nodes of the trie of ``continuations`` [k, d] (SEPARATOR-padded)
    within ``tree``'s budget: at most its node count, its depth, and its ``top_k`` children per node (a
    DynamicTree) or its paths (a static Tree). A node's path names its children's ranks by count, then token id."""
    if isinstance(tree, DynamicTree):
        budget, width, allowed = tree.total_tokens, tree.top_k, None
    else:
        budget, width, allowed = len(tree), None, set(tree.paths)
    k, depth = continuations.shape
    depth = min(depth, tree.depth)
    # the trie, a depth at a time: node ids of depth j are unique (parent id, token) pairs among the rows that
    # reach it; arrays over every node so far: parent, token, count, depth
    parent, token, count, level = [np.zeros(0, np.int64)] * 4
    at = np.zeros(k, dtype=np.int64) - 1  # each row's node at the current depth (-1: the root)
    alive = np.ones(k, dtype=bool)
    for j in range(depth):
        alive &= continuations[:, j] != SEPARATOR
        if not alive.any():
            break
        pairs = (at[alive] + 1) << 32 | continuations[alive, j].astype(np.int64)
        unique, inverse, counts = np.unique(pairs, return_inverse=True, return_counts=True)
        first = len(parent)
        at[alive] = first + inverse.reshape(-1)
        parent = np.concatenate([parent, (unique >> 32) - 1])
        token = np.concatenate([token, unique & 0xFFFFFFFF])
        count = np.concatenate([count, counts])
        level = np.concatenate([level, np.full(len(unique), j)])
    if not len(parent):
        return [], []
    # a node's rank among its siblings: by count, then token id (parent ids sort the groups)
    by_sibling = np.lexsort((token, -count, parent))
    group_start = np.searchsorted(parent[by_sibling], parent[by_sibling], side="left")
    rank = np.empty(len(parent), dtype=np.int64)
    rank[by_sibling] = np.arange(len(parent)) - group_start
    # selection by frequency, then depth; a parent counts at least as often as its children and, on a tie, is
    # shallower. Node ids of a depth follow their token paths' order (np.unique's), the stable sort's last resort
    order = np.lexsort((level, -count))
    path_of: dict[int, tuple] = {-1: ()}
    paths, tokens = [], []
    for i in order.tolist():
        if len(paths) >= budget:
            break
        up = int(parent[i])
        if up not in path_of or (width is not None and rank[i] >= width):
            continue
        path = (*path_of[up], int(rank[i]))
        if allowed is not None and path not in allowed:
            continue
        path_of[i] = path
        paths.append(path)
        tokens.append(int(token[i]))
    return paths, tokens
