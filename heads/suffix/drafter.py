"""SuffixDecoding: draft trees grown from suffix-index frequencies over the prompt and over earlier outputs.

Oliaro et al. 2024, "SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications". Two indexes
(heads/suffix/suffix_trie.py, bounded-depth suffix tries with occurrence counts):

* each row's own, over its prompt and what it has generated so far (built at prefill, appended every step);
* one across generate() calls, over earlier outputs (prompts excluded): a row's output joins it when the row
  leaves the batch or at the next call, oldest outputs evicted past ``max_cached_tokens``.

Each step, in each index, the longest suffix of the row's context (at most ``max_match`` tokens) that occurred
followed by something is found; from its node the candidate tree is grown best-first by empirical probability,
a node's score being the product of its path's conditional frequencies count(child) / count(all children).
The paper's adaptive size: at most ``alpha`` × (match length) nodes (a long match is a confident one), capped by
the tree's budget, and no node scoring below ``min_prob``. The index whose tree has the larger total score (its
expected accepted tokens) drafts the step, as in the paper.

The tree it is given is a budget: a ``DynamicTree(total_tokens, depth, top_k)`` caps the nodes, the depth and
the children per node; a static ``Tree`` restricts growth to its paths (a chain: the likeliest continuation). A
node's children are ranked by count, so siblings are distinct tokens in a fixed order, a deterministic function
of the past: verified losslessly like top-k ranks (treespec/walker.py). Rows without a match verify their root
alone (an empty tree).

Left out: the paper's suffix tree lives in C++; this trie is Python dictionaries, compact where text does not
repeat (a string seen once is a place in its document, not a node; docs/usage.md). A row's final step's tokens are
not indexed (the drafter is not told which tokens ended a row).
"""

from __future__ import annotations

import heapq
import math
import numbers
from collections import deque

import torch

from treespec.drafter import Committed, Drafter, Proposal, Proposals
from treespec.dynamic_tree import DynamicTree
from treespec.heads.suffix.suffix_trie import Document, SuffixTrie
from treespec.sampling import Sampling
from treespec.tree import Tree


class _Row:
    """One row's context: its tokens on the host, the part that is its prompt, and its own index."""

    __slots__ = ("tokens", "prompt", "trie", "doc")

    def __init__(self, prompt: list[int], depth: int):
        self.tokens, self.prompt = list(prompt), len(prompt)
        self.trie = SuffixTrie(depth)
        self.doc = self.trie.add(list(prompt))


class SuffixDecoding(Drafter):
    grows_dynamic_trees = True
    per_row = ("_rows",)

    def __init__(self, *, alpha: float = 4.0, min_prob: float = 0.1, max_match: int = 12,
                 max_cached_tokens: int = 50_000, default_tree: Tree | DynamicTree | None = None):
        for name, value, low in (("max_match", max_match, 1), ("max_cached_tokens", max_cached_tokens, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
        # alpha=inf once failed at the first proposal (OverflowError), min_prob="0.1" with a bare TypeError
        if not (number(alpha) and 0 < alpha < math.inf):
            raise ValueError(f"alpha must be a finite number > 0 (nodes per matched token), got {alpha!r}")
        if not (number(min_prob) and 0 <= min_prob < 1):
            raise ValueError(f"min_prob must be a number in [0, 1), got {min_prob!r}")
        if default_tree is not None and not isinstance(default_tree, (Tree, DynamicTree)):  # was an AttributeError
            raise ValueError(f"default_tree must be a Tree or a DynamicTree(total_tokens, depth, top_k), got "
                             f"{default_tree!r}")
        self.alpha, self.min_prob, self.max_match = alpha, min_prob, max_match
        self.max_cached_tokens = max_cached_tokens
        self.remembers_across_calls = max_cached_tokens > 0
        self.default_tree = default_tree if default_tree is not None else DynamicTree(16, 8, 4)
        self.depth = max_match + max(8, self.default_tree.depth)  # the tries' depth: a match, then a draft
        self.outputs = SuffixTrie(self.depth)  # earlier outputs, across generate() calls
        self._largest = -1  # the largest token id among them
        self._cached: deque[Document] = deque()  # its documents, oldest first
        self._rows: list[_Row] = []

    # -- the cross-request index -----------------------------------------------------------------------------
    def add_output(self, tokens: list[int]) -> None:
        """Index ``tokens`` as an earlier output (the drafter does it for its own rows; this adds others'),
        evicting the oldest outputs past ``max_cached_tokens``."""
        tokens = list(tokens)
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0 for t in tokens):
            raise ValueError(f"add_output takes token ids (integers >= 0), got {tokens[:8]!r}")
        if not tokens or self.max_cached_tokens == 0:
            return
        self._largest = max(self._largest, max(tokens))  # check_target: another tokenizer's ids fail in the target
        self._cached.append(self.outputs.add(tokens[-self.max_cached_tokens:]))
        while self.outputs.tokens > self.max_cached_tokens:
            self.outputs.remove(self._cached.popleft())

    def check_target(self, target) -> None:
        vocab = target.get_output_embeddings().weight.shape[0]
        if self._largest >= vocab:  # it would propose it, and the target's embedding fail (an IndexError)
            raise ValueError(f"SuffixDecoding holds earlier outputs with token id {self._largest}, outside the "
                             f"target's vocabulary of {vocab}: outputs of another tokenizer (add_output)? clear() "
                             "forgets them")

    def clear(self) -> None:
        """Forget every earlier output."""
        self._largest = -1
        self.outputs = SuffixTrie(self.depth)
        self._cached.clear()
        self._rows = []

    def _retire(self, rows: list[_Row]) -> None:
        for row in rows:
            self.add_output(row.tokens[row.prompt:])

    # -- the loop's calls -----------------------------------------------------------------------------------------
    def reset(self) -> None:
        self._retire(self._rows)  # the previous call's rows that were still decoding when it ended
        self._rows = []

    def prefill(self, input_ids, features, attention_mask=None) -> None:
        ids = input_ids.cpu()
        mask = None if attention_mask is None else attention_mask.cpu().bool()
        self._rows = [_Row(ids[b].tolist() if mask is None else ids[b][mask[b]].tolist(), self.depth)
                      for b in range(ids.shape[0])]

    def keep_rows(self, rows: torch.Tensor) -> None:
        keep = rows.tolist()
        self._retire([row for b, row in enumerate(self._rows) if b not in keep])  # their outputs join the index
        super().keep_rows(rows)

    def propose(self, committed: Committed, feature, tree: Tree | DynamicTree, sampling: Sampling,
                generator=None) -> Proposals:
        # the tokens committed since the last step (the last accepted path and its bonus token): one read
        tails, counts = committed.tails([len(row.tokens) for row in self._rows])
        tails = tails.tolist()
        proposals = []
        for row, tail, n in zip(self._rows, tails, counts, strict=True):
            row.tokens += tail[:n]
            row.trie.add(tail[:n], row.doc)
            proposals.append(self.propose_row(row.tokens, row.trie, tree))
        return Proposals.stack(proposals)

    # -- one row's tree -------------------------------------------------------------------------------------------
    def propose_row(self, context: list[int], own: SuffixTrie, tree: Tree | DynamicTree) -> Proposal:
        """The better of the trees grown in the row's own index and in the earlier outputs' for ``context``."""
        best = (0.0, [], [])
        for trie in (own, self.outputs):
            node, m = trie.match(context, self.max_match)
            if node is not None:
                grown = self.grow(trie, node, m, tree)
                if grown[0] > best[0]:
                    best = grown
        _, paths, tokens = best
        if not paths:
            return Proposal(tree=Tree.chain(0), tokens=torch.empty(0, dtype=torch.long))
        grown_tree = Tree(paths)
        token_of = dict(zip(paths, tokens, strict=True))
        return Proposal(tree=grown_tree, tokens=torch.tensor([token_of[p] for p in grown_tree.paths]))

    def grow(self, trie: SuffixTrie, start, m: int, tree: Tree | DynamicTree) -> tuple[float, list, list]:
        """Best-first from ``start`` (the place of a ``m``-token match in ``trie``): (total score, paths, tokens)
        of at most ``alpha·m`` nodes within ``tree``'s budget, each scoring at least ``min_prob``."""
        if isinstance(tree, DynamicTree):
            budget, depth, width, allowed = tree.total_tokens, tree.depth, tree.top_k, None
        else:
            budget, depth, width, allowed = len(tree), tree.depth, None, set(tree.paths)
        budget = min(budget, max(1, math.floor(self.alpha * m)))
        heap: list = []  # (−score, tie, path, token, place)
        tie = 0

        def push(place, path: tuple, score: float) -> None:
            nonlocal tie
            if len(path) >= depth:
                return
            kids = trie.children(place, m + len(path))
            total = sum(count for _, count, _ in kids)
            ranked = sorted(kids, key=lambda kid: (-kid[1], kid[0]))[:width]
            for rank, (token, count, kid) in enumerate(ranked):
                child = (*path, rank)
                p = score * count / total
                if p < self.min_prob:
                    break  # ranked by count: the rest score lower
                if allowed is None or child in allowed:
                    heapq.heappush(heap, (-p, tie, child, token, kid))
                    tie += 1

        push(start, (), 1.0)
        total, paths, tokens = 0.0, [], []
        while heap and len(paths) < budget:
            neg, _, path, token, kid = heapq.heappop(heap)
            total -= neg
            paths.append(path)
            tokens.append(token)
            push(kid, path, -neg)
        return total, paths, tokens
