"""Tree policies: which candidate tree to verify each step, built from a config.

Static kinds (one Tree for every step):
    {"kind": "chain", "depth": γ}                   classic speculative decoding
    {"kind": "full", "width": w, "depth": d}
    {"kind": "paths", "paths": [[0], [1], [0, 0]]}   Medusa "choices"
    {"kind": "accuracy", "nodes": n}                 grown greedily from measured per-depth top-k
                                                     accuracies (Medusa's sparse trees; analysis.grow_tree)
Dynamic kind (grown by the drafter every step; EAGLE-2, Li et al. 2024b):
    {"kind": "dynamic", "total_tokens": n, "depth": d, "top_k": k}   → DynamicTree
Bad specifications raise ValueError naming the spec.
"""

from __future__ import annotations

from treespec.analysis import grow_tree
from treespec.tree import Tree

KINDS = ("chain", "full", "paths", "accuracy", "dynamic")


def build_tree(spec, accuracy=None) -> Tree | DynamicTree:
    """A Tree (a DynamicTree for kind "dynamic") from a spec dict (or either, returned as is).
    ``accuracy[d][r]``: probability that the rank-r candidate at depth d+1 is the accepted one (needed by
    kind "accuracy")."""
    if isinstance(spec, (Tree, DynamicTree)):
        return spec
    original, spec = dict(spec), dict(spec)
    kind = spec.pop("kind", None)
    try:
        if kind == "chain":
            return Tree.chain(int(spec.pop("depth")))
        if kind == "full":
            return Tree.full(int(spec.pop("width")), int(spec.pop("depth")))
        if kind == "paths":
            return Tree.from_paths([tuple(p) for p in spec.pop("paths")])
        if kind == "accuracy":
            if accuracy is None:
                raise ValueError("needs measured per-depth top-k accuracies (train heads first)")
            return grow_tree(accuracy, int(spec.pop("nodes")))
        if kind == "dynamic":
            return DynamicTree(int(spec.pop("total_tokens")), int(spec.pop("depth")), int(spec.pop("top_k")))
    except KeyError as missing:
        raise ValueError(f"tree spec {original} lacks {missing}") from None
    except (TypeError, ValueError) as err:
        raise ValueError(f"bad tree spec {original}: {err}") from None
    raise ValueError(f"tree spec {original}: kind {kind!r} is not one of {KINDS}")


# -- dynamic trees (EAGLE-2) -------------------------------------------------------------------------
class DynamicTree:
    """EAGLE-2's dynamic draft tree (Li et al. 2024b): a budget, not a topology. The drafter grows the
    tree every step from its own confidence (treespec.heads.expansion): at each depth the ``top_k``
    nodes of the previous depth with the highest cumulative draft log-probability propose their
    ``top_k`` most likely children; after ``depth`` levels the best ``total_tokens`` nodes by cumulative
    log-probability are kept (``select``) and verified as a concrete ``Tree``.

    It stands in for a Tree in generate(): ``len`` is the most candidates a step can verify and
    ``truncate`` caps the depth (a depth-0 budget is the empty static tree).
    """

    def __init__(self, total_tokens: int, depth: int, top_k: int):
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
        path_of = {0: ()}
        for i in sorted(kept):  # parents first: a parent's id is smaller than its children's
            path_of[i] = path_of[parents[i]] + (ranks[i],)
        node_of_path = {path_of[i]: i for i in kept}
        tree = Tree(list(node_of_path))
        return tree, [0] + [node_of_path[p] for p in tree.paths]
