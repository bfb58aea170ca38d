"""REST's index: a suffix array over one token stream, searched by binary search.

He et al. 2024 ("REST: Retrieval-Based Speculative Decoding") keep their datastore in a suffix array: the start
of every suffix of the corpus, sorted lexicographically, so the occurrences of any string are one contiguous
range of it, found by two binary searches. Documents are joined by ``SEPARATOR`` (-1, below every token id), so no
match and no continuation crosses from one document into the next.

    index = SuffixArray.build(np.array([5, 6, 7, -1, 5, 6, 8], dtype=np.int32))
    index.find([5, 6])                        # (lo, hi): index.sa[lo:hi] are where "5 6" starts
    m, lo, hi = index.longest_match([9, 5, 6], max_len=16, min_len=2)   # 2: "5 6" continues
    index.continuations(lo, hi, m, depth=4, limit=5000)  # [2, 4]: "7 -1 -1 -1" and "8 -1 -1 -1"

Suffix order: a suffix that ends (the stream's last tokens) sorts before its extensions, and the separator before
every token; so within the range of a string s, its occurrences that end a document come first and those that
continue with a token (>= 0) are the range of ``s + [0]`` onwards: one more binary search, no scan.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

import numpy as np

SEPARATOR = -1


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """int32 [n]: the starts of ``tokens``' suffixes in lexicographic order.

    Prefix doubling (Manber & Myers 1993): after the round with step k every suffix is ranked by its first 2k
    tokens, from the pairs (rank[i], rank[i + k]) of the round before (0 past the end: an ended suffix first).
    One sort of n int64 keys per round, as many rounds as log2 of the longest repeated string (about 20 on
    the stdlib corpus, whose files repeat licence headers and whole test data)."""
    n = len(tokens)
    if n == 0:
        return np.zeros(0, dtype=np.int32)
    rank = np.unique(tokens, return_inverse=True)[1].reshape(-1).astype(np.int64) + 1  # 1..n by first token
    k = 1
    while True:
        second = np.zeros(n, dtype=np.int64)
        second[: n - k] = rank[k:] if k < n else second[:0]
        key = rank * (n + 1) + second  # < 2^63 for any n below 3·10^9
        order = np.argsort(key)
        ordered = key[order]
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.cumsum(np.concatenate([[1], ordered[1:] != ordered[:-1]]))
        if rank[order[-1]] == n or k >= n:  # every suffix has its own rank: sorted
            return order.astype(np.int32)
        k *= 2


class SuffixArray:
    """A token stream [n] (int32, documents joined by SEPARATOR) and its suffix array [n] (int32)."""

    def __init__(self, tokens: np.ndarray, sa: np.ndarray):
        if tokens.ndim != 1 or sa.shape != tokens.shape:
            raise ValueError(f"a suffix array needs tokens [n] and sa [n], got {tokens.shape} and {sa.shape}")
        self.tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        self.sa = np.ascontiguousarray(sa, dtype=np.int32)
        #: the vocabulary the stream needs (its largest id + 1): a target must have at least as many
        self.vocab_needed = int(self.tokens.max()) + 1 if len(self.tokens) else 0

    @classmethod
    def build(cls, tokens: np.ndarray) -> SuffixArray:
        tokens = np.asarray(tokens, dtype=np.int32)
        return cls(tokens, suffix_array(tokens))

    def __len__(self) -> int:
        return len(self.tokens)

    def _prefix(self, m: int):
        """The sort key of a suffix-array entry for a search with an m-token pattern: its suffix's first m tokens
        (fewer where the stream ends), compared as a list."""
        tokens, sa = self.tokens, self.sa
        return lambda j: tokens[sa[j] : sa[j] + m].tolist()

    def find(self, pattern: list[int], lo: int = 0, hi: int | None = None) -> tuple[int, int]:
        """(lo, hi): ``sa[lo:hi]`` are the starts of ``pattern``'s occurrences (empty: lo == hi), searched within
        ``[lo, hi)``."""
        hi = len(self.sa) if hi is None else hi
        key = self._prefix(len(pattern))
        start = bisect_left(range(len(self.sa)), pattern, lo, hi, key=key)
        return start, bisect_right(range(len(self.sa)), pattern, start, hi, key=key)

    def continuing(self, pattern: list[int]) -> tuple[int, int]:
        """(lo, hi) of ``pattern``'s occurrences followed by a token (neither the stream's end nor a separator)."""
        lo, hi = self.find(pattern)
        if lo == hi or not self._followed(hi - 1, len(pattern)):  # the last one sorts highest: none continues
            return lo, lo
        first = bisect_left(range(len(self.sa)), [*pattern, 0], lo, hi, key=self._prefix(len(pattern) + 1))
        return first, hi

    def _followed(self, j: int, m: int) -> bool:
        end = int(self.sa[j]) + m
        return end < len(self.tokens) and int(self.tokens[end]) != SEPARATOR

    def longest_match(self, context: list[int], max_len: int, min_len: int = 1) -> tuple[int, int, int]:
        """(m, lo, hi): the longest suffix of ``context``, ``min_len`` to ``max_len`` tokens, that occurs followed
        by a token, and the range of those occurrences; (0, 0, 0) when none does.

        Monotone in m (if s·x occurs, so does every suffix of s followed by x), so a binary search over m finds
        what trying ``max_len`` down to ``min_len`` one by one (REST's order) would."""
        top = min(max_len, len(context))
        if top < min_len:
            return 0, 0, 0
        found = self.continuing(context[len(context) - min_len :])
        if found[0] == found[1]:
            return 0, 0, 0
        best, low, high = (min_len, *found), min_len, top
        while low < high:  # a suffix of `low` tokens continues
            mid = (low + high + 1) // 2
            lo, hi = self.continuing(context[len(context) - mid :])
            if lo < hi:
                best, low = (mid, lo, hi), mid
            else:
                high = mid - 1
        return best

    def continuations(self, lo: int, hi: int, m: int, depth: int, limit: int) -> np.ndarray:
        """int32 [k, depth]: the ``depth`` tokens after each of at most ``limit`` occurrences ``sa[lo:hi]`` of an
        m-token string, SEPARATOR from where a document (or the stream) ends. More than ``limit`` occurrences are
        sampled evenly over the range (deterministic; the range is sorted by continuation, so the sample keeps
        their frequencies), rather than its first ``limit``, which would favour low token ids."""
        count = hi - lo
        picks = np.arange(lo, hi) if count <= limit else lo + (np.arange(limit, dtype=np.int64) * count) // limit
        starts = self.sa[picks].astype(np.int64) + m  # [k]
        where = starts[:, None] + np.arange(depth)[None]  # [k, depth]
        out = np.full(where.shape, SEPARATOR, dtype=np.int32)
        inside = where < len(self.tokens)
        out[inside] = self.tokens[where[inside]]
        ended = np.maximum.accumulate(out == SEPARATOR, axis=1)  # past a separator nothing belongs to the match
        out[ended] = SEPARATOR
        return out
