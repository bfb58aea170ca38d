"""Lookahead decoding (Fu et al. 2024): Jacobi iteration over a 2-D window fills an n-gram pool, whose n-grams
starting with the root are verified in the same pass; no model. drafter.py the Drafter, kind.py its kind."""

from treespec.heads.lookahead.drafter import Lookahead
from treespec.heads.lookahead.kind import KIND

__all__ = ["KIND", "Lookahead"]
