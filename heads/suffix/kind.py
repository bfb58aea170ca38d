"""The SuffixDecoding kind: no weights, so nothing to load, score, time or train."""

from __future__ import annotations

from treespec.heads.kind import DrafterKind
from treespec.heads.suffix.drafter import SuffixDecoding


class SuffixKind(DrafterKind):
    """SuffixDecoding (conf/drafter/suffix.yaml): suffix-index frequencies over the prompt and earlier outputs."""

    name = "suffix"
    has_weights = False

    def new_drafter(self, module, candidates, draft_vocab, lean) -> SuffixDecoding:
        return SuffixDecoding()


KIND = SuffixKind()
