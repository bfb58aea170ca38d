"""A tree per batch size: what a batch verifies while B rows are still decoding (B = 1, 2, 4, 8, 16, ...).

A pass over a batch costs what its B × N tokens cost. On a device whose cost curve is flat only up to a few tokens
(a CPU) a tree that pays at B = 1 costs more than it commits at B = 16, where batched vanilla decoding already
uses the arithmetic; serving engines therefore size trees per batch size and switch speculation off under load
(SGLang's speculative batch-size thresholds, TensorRT-LLM's ``acceptance_rate_threshold``). ``TreesByBatch`` is
that table: ``treespec.planning.batch_table`` chooses it from costs measured at each B, and the decoding loop
(treespec/generate.py, ``step_tree_of``) follows it step by step as rows finish and leave the batch: a batch of 16
may decode without drafting, then speculate once only four rows are left.

Between two sizes of the table, a batch takes the larger size's tree: a pass over more rows costs more, so the
larger size's choice is the cautious one. Above the largest, the largest size's. An empty ``Tree`` (``Tree.chain(0)``)
is vanilla decoding at that size.

    table = TreesByBatch({1: Tree.chain(4), 4: Tree.chain(2), 16: Tree.chain(0)})
    table.at(3)    # Tree.chain(2)
    generate(target, prompts, drafter=drafter, tree=table, max_new_tokens=64)
"""

from __future__ import annotations

from collections.abc import Mapping

from treespec.dynamic_tree import DynamicTree
from treespec.tree import Tree


class TreesByBatch:
    """{batch size: Tree or DynamicTree} (module docstring); ``at(b)`` is the tree a batch of ``b`` rows verifies."""

    def __init__(self, trees: Mapping[int, Tree | DynamicTree]):
        if not isinstance(trees, Mapping) or not trees:
            raise ValueError(f"TreesByBatch takes {{batch size: tree}} with at least one entry, got {trees!r}")
        for size, tree in trees.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"TreesByBatch: batch sizes are integers >= 1, got {size!r}")
            if not isinstance(tree, (Tree, DynamicTree)):
                raise ValueError(f"TreesByBatch: the tree for batch size {size} must be a Tree or a DynamicTree, got "
                                 f"{type(tree).__name__}: {tree!r}")
        self.trees = dict(sorted(trees.items()))

    def at(self, rows: int) -> Tree | DynamicTree:
        """The tree a batch of ``rows`` rows verifies: the smallest size of the table at or above ``rows``, else the
        largest size's."""
        size = next((s for s in self.trees if s >= rows), max(self.trees))
        return self.trees[size]

    @property
    def sizes(self) -> list[int]:
        return list(self.trees)

    @property
    def speculates(self) -> bool:
        """Whether any size drafts (a table of empty trees only is vanilla decoding)."""
        return any(len(tree) for tree in self.trees.values())

    @property
    def pauses(self) -> bool:
        """Whether some size does not draft while another does: the loop then keeps what a drafter would need to
        start again (treespec/generate.py, ``resume_drafter``)."""
        return self.speculates and any(not len(tree) for tree in self.trees.values())

    # what the loop's checks and its static pass read of "the tree": the most any size asks
    @property
    def depth(self) -> int:
        return max(tree.depth for tree in self.trees.values())

    @property
    def num_nodes(self) -> int:
        return max(tree.num_nodes for tree in self.trees.values())

    def __len__(self) -> int:
        return max(len(tree) for tree in self.trees.values())

    def __eq__(self, other) -> bool:
        return isinstance(other, TreesByBatch) and self.trees == other.trees

    def __hash__(self) -> int:
        return hash(tuple(self.trees.items()))

    def __repr__(self) -> str:
        return "TreesByBatch({" + ", ".join(f"{s}: {t!r}" for s, t in self.trees.items()) + "})"


def check_batch_sizes(sizes) -> list[int]:
    """The spec's ``batch_sizes``: a non-empty list of distinct integers >= 1 (a ValueError names what is wrong)."""
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise ValueError(f"batch_sizes must be a list of batch sizes such as [1, 2, 4, 8, 16], got {sizes!r}")
    sizes = list(sizes)
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes) \
            or len(set(sizes)) != len(sizes):
        raise ValueError(f"batch_sizes must be distinct integers >= 1, got {sizes!r}")
    return sorted(sizes)
