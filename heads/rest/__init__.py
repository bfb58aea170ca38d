"""REST (He et al. 2024): draft trees retrieved from a datastore, a suffix array over a corpus; no model.
suffix_array.py the index, datastore.py the corpus and its cache, drafter.py the Drafter, kind.py its kind."""

from treespec.heads.rest.datastore import load_datastore
from treespec.heads.rest.drafter import Rest
from treespec.heads.rest.kind import KIND
from treespec.heads.rest.suffix_array import SuffixArray

__all__ = ["KIND", "Rest", "SuffixArray", "load_datastore"]
