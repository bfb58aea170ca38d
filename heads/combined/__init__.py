"""Drafters combined: one verified tree from several drafters' proposals, their union by shared prefixes or a
fallback on a weak match (SAM-Decoding's lesson, Hu et al. 2024, made general). tree_union.py the merge, drafter.py
the Drafter, kind.py its kind."""

from treespec.heads.combined.drafter import MODES, Combined
from treespec.heads.combined.kind import KIND
from treespec.heads.combined.tree_union import merge

__all__ = ["KIND", "MODES", "Combined", "merge"]
