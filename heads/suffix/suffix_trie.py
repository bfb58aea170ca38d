"""SuffixDecoding's index: a suffix trie of bounded depth with occurrence counts, appended to token by token.

Every substring of length <= ``depth`` of every document is a path from the root, and each node counts the
occurrences of its string, so a node's children, with their counts, are the empirical next-token distribution
after that string: what SuffixDecoding (Oliaro et al. 2024) grows its candidate trees from. The paper's suffix
tree is bounded by a maximum depth the same way; a trie without path compression is the simple form of it.

Why not SAM-Decoding's suffix automaton (Hu et al. 2024), which matches in O(1) amortized per token with O(n)
states: its states' occurrence counts (|endpos|) are not maintained by online appends without walking the
suffix-link path at every token, and frequencies are what this drafter ranks by; SAM-Decoding itself drafts one
chain from the latest occurrence. Here an appended token costs ``depth`` dictionary steps (the open suffixes each
grow by it), a match a binary search over match lengths (a suffix that continues implies that every shorter one
does), and memory is at most ``depth`` nodes per token, fewer where text repeats: the bound on the cross-request
index's size (``SuffixDecoding(max_cached_tokens=...)``).

    trie = SuffixTrie(depth=20)
    doc = trie.add([5, 6, 7, 5, 6])       # a document; trie.add([8], doc) extends it
    node, m = trie.match([1, 5, 6], 12)   # the longest suffix of a context that continues: "5 6", m = 2
    node.kids[7].count                    # 1: "5 6" was followed by 7 once
    trie.remove(doc)                      # its counts leave the trie
"""

from __future__ import annotations


class Node:
    """One string: its occurrences, and its one-token extensions (None until it has one)."""

    __slots__ = ("count", "kids")

    def __init__(self):
        self.count = 0
        self.kids: dict[int, Node] | None = None

    def child(self, token: int) -> Node:
        if self.kids is None:
            self.kids = {}
        node = self.kids.get(token)
        if node is None:
            node = self.kids[token] = Node()
        return node


class Document:
    """A document's tokens and its open suffixes: ``open[j]`` is the node of its last j + 1 tokens."""

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
        opened = doc.open
        for token in tokens:
            # the new suffixes: the token alone, then each open suffix (shorter than depth) extended by it
            grown = [self.root.child(token)]
            grown += [node.child(token) for node in opened[: self.depth - 1]]
            for node in grown:
                node.count += 1
            opened = grown
        doc.open = opened
        doc.tokens += tokens
        self.tokens += len(tokens)
        return doc

    def remove(self, doc: Document) -> None:
        """Take ``doc``'s occurrences out again (what ``add`` counted), dropping strings left with none."""
        opened: list[tuple[Node, Node]] = []  # (parent, node) of each open suffix
        for token in doc.tokens:
            grown = [(self.root, self.root.kids[token])]
            grown += [(node, node.kids[token]) for _, node in opened[: self.depth - 1]]
            for parent, node in grown:
                node.count -= 1
                if node.count == 0:
                    del parent.kids[token]
            opened = grown
        self.tokens -= len(doc.tokens)
        doc.tokens, doc.open = [], []

    def find(self, tokens: list[int]) -> Node | None:
        """The node of string ``tokens``, None when it never occurred (or is longer than ``depth``)."""
        node = self.root
        for token in tokens:
            if node.kids is None or token not in node.kids:
                return None
            node = node.kids[token]
        return node

    def match(self, context: list[int], max_len: int) -> tuple[Node | None, int]:
        """(node, m): the longest suffix of ``context``, at most ``max_len`` tokens, that occurred followed by some
        token (its node has children); (None, 0) when even the empty one has none (an empty trie).

        "Occurred with a continuation" is monotone in the suffix's length (if s·x occurred, so did every suffix
        of s followed by x), so a binary search finds the longest."""
        def continues(m: int) -> Node | None:
            node = self.find(context[len(context) - m:]) if m else self.root
            return node if node is not None and node.kids else None

        lo, hi = 0, min(max_len, len(context), self.depth - 1)
        best = continues(0)
        if best is None:
            return None, 0
        while lo < hi:  # continues(lo) holds
            mid = (lo + hi + 1) // 2
            node = continues(mid)
            if node is not None:
                lo, best = mid, node
            else:
                hi = mid - 1
        return best, lo
