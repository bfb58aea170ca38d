"""The Token Recycling kind: no weights, so nothing to load, score, time or train."""

from __future__ import annotations

from treespec.heads.kind import DrafterKind
from treespec.heads.recycling.drafter import TokenRecycling


class RecyclingKind(DrafterKind):
    """Token Recycling (conf/drafter/recycling.yaml): the target's own top-k, recycled; nothing to load or time."""

    name = "recycling"
    has_weights = False

    def new_drafter(self, module, candidates, draft_vocab, lean) -> TokenRecycling:
        return TokenRecycling()


KIND = RecyclingKind()
