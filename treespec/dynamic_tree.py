"""EAGLE-2's dynamic draft tree (Li et al. 2024b, "EAGLE-2: Faster Inference of Language Models with
Dynamic Draft Trees"): a node budget the drafter grows into a new tree every step, from its own confidence.

The whole rule lives here; drafters (treespec.heads.drafting.expansion) only run their model where it says:

* **score**: a node's score is its cumulative draft log-probability (the sum along its path);
* **frontier** (expansion): at each depth the ``top_k`` nodes of the newest depth with the highest score
  propose their ``top_k`` most likely children;
* **select** (reranking): after ``depth`` levels the best ``total_tokens`` nodes by score are kept and
  verified as a concrete ``Tree``. A child never outscores its parent, so the kept set is a connected
  subtree; siblings stay in draft-probability order, so the walker's sibling rule stays lossless.
"""

from __future__ import annotations

from treespec.tree import Tree, whole


class DynamicTree:
    """EAGLE-2's dynamic draft tree (Li et al. 2024b): a budget, not a topology. The drafter grows the
    tree every step from its own confidence (treespec.heads.drafting.expansion): at each depth the ``top_k``
    nodes of the previous depth with the highest cumulative draft log-probability propose their
    ``top_k`` most likely children; after ``depth`` levels the best ``total_tokens`` nodes by cumulative
    log-probability are kept (``select``) and verified as a concrete ``Tree``.

    It stands in for a Tree in generate(): ``len`` is the most candidates a step can verify and
    ``truncate`` caps the depth (a depth-0 budget is the empty static tree).
    """

    def __init__(self, total_tokens: int, depth: int, top_k: int):
        total_tokens, depth, top_k = (whole(v, f"dynamic tree {name}") for name, v in
                                      (("total_tokens", total_tokens), ("depth", depth), ("top_k", top_k)))
        if total_tokens < 1 or depth < 1 or top_k < 1:
            raise ValueError(f"dynamic tree needs total_tokens, depth and top_k >= 1, got total_tokens={total_tokens}, "
                             f"depth={depth}, top_k={top_k}")
        self.total_tokens, self.depth, self.top_k = int(total_tokens), int(depth), int(top_k)

    def __len__(self) -> int:
        """Most candidates a step can verify: top_k at depth 1, top_k² at each deeper depth, capped."""
        return min(self.total_tokens, self.top_k + (self.depth - 1) * self.top_k**2)

    @property
    def num_nodes(self) -> int:
        return len(self) + 1

    def __eq__(self, other) -> bool:
        return isinstance(other, DynamicTree) and (self.total_tokens, self.depth, self.top_k) == (
            other.total_tokens, other.depth, other.top_k)

    def __hash__(self) -> int:
        return hash((self.total_tokens, self.depth, self.top_k))

    def __repr__(self) -> str:
        return f"DynamicTree(total_tokens={self.total_tokens}, depth={self.depth}, top_k={self.top_k})"

    def truncate(self, max_depth: int) -> DynamicTree | Tree:
        """The same budget grown at most ``max_depth`` deep (used when few tokens remain to generate)."""
        if max_depth < 1:
            return Tree.chain(0)
        return self if max_depth >= self.depth else DynamicTree(self.total_tokens, max_depth, self.top_k)

    @staticmethod
    def child_score(parent_score: float, log_q: float) -> float:
        """A child's score: its parent's plus its own draft log-probability. log q <= 0, so min() only guards
        rounding: a child never outscores its parent (what keeps every selected set connected)."""
        return min(parent_score + log_q, parent_score)

    def frontier(self, newest: list[int], scores: list[float]) -> list[int]:
        """The ``top_k`` nodes of the newest depth (ids ``newest``) with the best scores, which propose the next
        depth's children (EAGLE-2's expansion phase); ties go to the smaller id."""
        return sorted(newest, key=lambda i: (-scores[i], i))[: self.top_k]

    def select(self, parents: list[int], ranks: list[int], scores: list[float]) -> tuple[Tree, list[int]]:
        """Keep the best ``total_tokens`` grown nodes → (the concrete Tree, grown-node id of each tree node).

        Grown nodes are numbered 0 (the root) .. m, every parent before its children and siblings in rank
        order; ``ranks[i]`` is node i's rank among its siblings in draft-probability order and ``scores[i]``
        its cumulative draft log-probability (a child never scores above its parent). Sorting by
        (−score, id) ranks a parent before its children even on ties, so every prefix of the order — the
        kept set — is a connected subtree; a kept node's siblings of better rank are kept too, so ranks stay
        in draft order.
        Returns ``nodes`` with nodes[0] = 0 and nodes[i] the grown node at tree node i (Tree order).
        """
        kept = sorted(range(1, len(parents)), key=lambda i: (-scores[i], i))[: self.total_tokens]
        return self.tree_of(kept, parents, ranks)

    @staticmethod
    def tree_of(kept: list[int], parents: list[int], ranks: list[int]) -> tuple[Tree, list[int]]:
        """The Tree of the grown nodes ``kept`` (a connected set without the root; ``parents`` and ``ranks`` as
        ``select`` takes them) → (the Tree, grown-node id of each tree node, the root's 0 first)."""
        path_of = {0: ()}
        for i in sorted(kept):  # parents first: a parent's id is smaller than its children's
            path_of[i] = path_of[parents[i]] + (ranks[i],)
        node_of_path = {path_of[i]: i for i in kept}
        tree = Tree(list(node_of_path))
        return tree, [0] + [node_of_path[p] for p in tree.paths]
