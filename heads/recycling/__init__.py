"""Token Recycling (Luo et al. 2024): the target's discarded top-k candidates in an adjacency matrix, read as a
tree; no model. drafter.py the Drafter, kind.py its kind."""

from treespec.heads.recycling.drafter import RECYCLING_TREE, RECYCLING_TREE_80, TokenRecycling
from treespec.heads.recycling.kind import KIND

__all__ = ["KIND", "RECYCLING_TREE", "RECYCLING_TREE_80", "TokenRecycling"]
