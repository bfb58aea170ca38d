"""The Lookahead kind: no weights, so nothing to load, score, time or train."""

from __future__ import annotations

from treespec.heads.kind import DrafterKind
from treespec.heads.lookahead.drafter import Lookahead


class LookaheadKind(DrafterKind):
    """Lookahead decoding (conf/drafter/lookahead.yaml): Jacobi iteration fills an n-gram pool; no model."""

    name = "lookahead"
    has_weights = False

    def new_drafter(self, module, candidates, draft_vocab, lean) -> Lookahead:
        return Lookahead()


KIND = LookaheadKind()
