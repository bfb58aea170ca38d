"""The REST kind: no weights; what it loads is its datastore, from the corpus its ``source`` names."""

from __future__ import annotations

from treespec.heads.kind import DrafterKind
from treespec.heads.rest.datastore import load_datastore
from treespec.heads.rest.drafter import Rest, tokenizer_of
from treespec.heads.rest.suffix_array import SuffixArray


class RestKind(DrafterKind):
    """REST (conf/drafter/rest.yaml): retrieval from a datastore; ``source`` is its corpus (None: the stdlib
    corpus minus its held-out files), encoded with the target's tokenizer and cached by content."""

    name = "rest"
    has_weights = False

    def load(self, source, target) -> SuffixArray:
        # built (or read back) here, before anything is timed, not at the first generate()
        return load_datastore(source or "stdlib", tokenizer_of(target))

    def new_drafter(self, module, candidates, draft_vocab, lean) -> Rest:
        return Rest(module if module is not None else "stdlib")


KIND = RestKind()
