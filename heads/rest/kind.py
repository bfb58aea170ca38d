"""The REST kind (conf/drafter/rest.yaml): retrieval from a datastore; no weights. What it loads is its datastore:
``source`` is its corpus (None: the stdlib corpus minus its held-out files), encoded with the target's tokenizer
and cached by content."""

from __future__ import annotations

from treespec.heads.kind import ModelFreeKind
from treespec.heads.rest.datastore import load_datastore
from treespec.heads.rest.drafter import Rest, tokenizer_of

KIND = ModelFreeKind(
    "rest", lambda store: Rest(store if store is not None else "stdlib"),
    reads=lambda source, target: load_datastore(source or "stdlib", tokenizer_of(target)))
