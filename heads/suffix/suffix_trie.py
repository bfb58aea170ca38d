"""SuffixDecoding's index: a suffix trie of bounded depth with occurrence counts, appended to token by token.

Every substring of length <= ``depth`` of every document is a path from the root, and each node counts the
occurrences of its string, so a node's children, with their counts, are the empirical next-token distribution
after that string: what SuffixDecoding (Oliaro et al. 2024) grows its candidate trees from. The paper's suffix
tree is bounded by a maximum depth the same way.

Compact where text does not repeat: a string that occurred once is no node but a *tail*, ``(document, end)``, the
place of its one occurrence, whose continuation is read from the document itself (a suffix tree's leaf edge). A
tail becomes a node when its string occurs a second time. So the nodes are the repeated strings, and each token
adds at most one tail per repeated suffix it ends: memory grows with repetition, not with ``depth`` × tokens.

Why not SAM-Decoding's suffix automaton (Hu et al. 2024), which matches in O(1) amortized per token with O(n)
states: its states' occurrence counts (|endpos|) are not maintained by online appends without walking the
suffix-link path at every token, and frequencies are what this drafter ranks by (SAM-Decoding drafts one chain
from the latest occurrence). Here an appended token costs one dictionary step per repeated suffix it ends (at
most ``depth``), and a match a binary search over match lengths (a suffix that continues implies that every
shorter one does).

    trie = SuffixTrie(depth=20)
    doc = trie.add([5, 6, 7, 5, 6])       # a document; trie.add([8], doc) extends it
    trie.count([5, 6])                    # 2
    node, m = trie.match([1, 5, 6], 12)   # the longest suffix of a context that continues: "5 6", m = 2
    trie.children(node, m)                # [(7, 1, ...)]: "5 6" was followed by 7 once
    trie.remove(doc)                      # its occurrences leave the trie
"""

from __future__ import annotations


class Node:
    """A string that occurred more than once: its occurrences, and its one-token extensions, each a Node or a
    tail ``(document, end)`` (None until it has one)."""

    __slots__ = ("count", "kids")

    def __init__(self):
        self.count = 0
        self.kids: dict | None = None


class Document:
    """A document's tokens and its open suffixes: ``open[j]`` is the node of its last j + 1 tokens, for every such
    suffix that is a node (they are the shortest ones: a suffix occurs at least as often as a longer one)."""

    __slots__ = ("tokens", "open")

    def __init__(self):
        self.tokens: list[int] = []
        self.open: list[Node] = []


class SuffixTrie:
    def __init__(self, depth: int):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 2:
            raise ValueError(f"a suffix trie's depth must be an integer >= 2, got {depth!r}")
        self.depth = depth
        self.root = Node()
        self.tokens = 0  # tokens indexed, over all documents

    def add(self, tokens: list[int], doc: Document | None = None) -> Document:
        """Append ``tokens`` to ``doc`` (a new document when None): every suffix ending at each new token, up to
        ``depth`` long, counts one more occurrence."""
        doc = Document() if doc is None else doc
        for token in tokens:
            doc.tokens.append(token)
            end = len(doc.tokens) - 1
            grown = []
            # the suffixes ending here: the token alone, then each open node (shorter than depth) extended by it
            for length, node in enumerate([self.root, *doc.open[: self.depth - 1]]):
                if node.kids is None:
                    node.kids = {}
                kid = node.kids.get(token)
                if kid is None:  # a new string, and so is every longer suffix: tails, one per open node
                    node.kids[token] = (doc, end)
                    continue
                if type(kid) is tuple:  # it occurred once: a node now
                    kid = node.kids[token] = self._node_of(kid, length + 1)
                kid.count += 1
                grown.append(kid)
            doc.open = grown
        self.tokens += len(tokens)
        return doc

    def _node_of(self, tail: tuple, depth: int) -> Node:
        """The node of a string of ``depth`` tokens that so far occurred once, at ``tail``."""
        node = Node()
        node.count = 1
        doc, end = tail
        if depth < self.depth and end + 1 < len(doc.tokens):  # that occurrence's continuation, a tail itself
            node.kids = {doc.tokens[end + 1]: (doc, end + 1)}
        elif end + 1 == len(doc.tokens) and len(doc.open) == depth - 1:
            # the end of a document that may still grow (add(tokens, doc)): its open suffixes must now hold this
            # node, or that document's next tokens never extend it (its occurrences were lost)
            doc.open.append(node)
        return node

    def remove(self, doc: Document) -> None:
        """Take ``doc``'s occurrences out again, dropping strings left with none: from each start, down its path
        until the occurrence's own tail or a node it alone held."""
        tokens = doc.tokens
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + self.depth]:
                kid = node.kids[token]
                if type(kid) is tuple:
                    del node.kids[token]
                    break
                kid.count -= 1
                if kid.count == 0:
                    del node.kids[token]
                    break
                node = kid
        self.tokens -= len(tokens)
        doc.tokens, doc.open = [], []

    # -- reading ------------------------------------------------------------------------------------------------
    def find(self, tokens: list[int]):
        """The place of string ``tokens``: a Node, a tail ``(document, end)`` (it occurred once), or None (never,
        or longer than ``depth``)."""
        if len(tokens) > self.depth:
            return None
        node = self.root
        for token in tokens:
            if type(node) is tuple:
                doc, end = node
                if end + 1 >= len(doc.tokens) or doc.tokens[end + 1] != token:
                    return None
                node = (doc, end + 1)
            else:
                node = node.kids.get(token) if node.kids else None
                if node is None:
                    return None
        return node

    def count(self, tokens: list[int]) -> int:
        """Occurrences of string ``tokens`` (up to ``depth`` long)."""
        node = self.find(tokens)
        return 0 if node is None else 1 if type(node) is tuple else node.count

    def children(self, node, depth: int) -> list[tuple[int, int, object]]:
        """(token, occurrences, place) of each one-token extension of ``node``, a string of ``depth`` tokens."""
        if type(node) is tuple:
            doc, end = node
            if depth >= self.depth or end + 1 >= len(doc.tokens):
                return []
            return [(doc.tokens[end + 1], 1, (doc, end + 1))]
        return [(token, 1 if type(kid) is tuple else kid.count, kid) for token, kid in (node.kids or {}).items()]

    def match(self, context: list[int], max_len: int) -> tuple[object, int]:
        """(place, m): the longest suffix of ``context``, at most ``max_len`` tokens, that occurred followed by some
        token; (None, 0) when even the empty one has none (an empty trie).

        "Occurred with a continuation" is monotone in the suffix's length (if s·x occurred, so did every suffix
        of s followed by x), so a binary search finds the longest."""
        def continues(m: int):
            node = self.find(context[len(context) - m:]) if m else self.root
            return node if node is not None and self.children(node, m) else None

        best = continues(0)
        if best is None:
            return None, 0
        lo, hi = 0, min(max_len, len(context), self.depth - 1)
        while lo < hi:  # continues(lo) holds
            mid = (lo + hi + 1) // 2
            node = continues(mid)
            if node is not None:
                lo, best = mid, node
            else:
                hi = mid - 1
        return best, lo
