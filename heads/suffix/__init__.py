"""SuffixDecoding (Oliaro et al. 2024): candidate trees grown from suffix-index frequencies over the prompt and
earlier outputs; no model. suffix_trie.py the index, drafter.py the Drafter, kind.py its kind."""

from treespec.heads.suffix.drafter import SuffixDecoding
from treespec.heads.suffix.kind import KIND
from treespec.heads.suffix.suffix_trie import SuffixTrie

__all__ = ["KIND", "SuffixDecoding", "SuffixTrie"]
