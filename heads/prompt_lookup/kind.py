"""The prompt-lookup kind: no weights, so nothing to load, score, time or train."""

from __future__ import annotations

from treespec.heads.kind import DrafterKind
from treespec.heads.prompt_lookup.drafter import PromptLookup


class PromptLookupKind(DrafterKind):
    """Prompt lookup (conf/drafter/prompt_lookup.yaml): no weights, so nothing to load, score or time."""

    name = "prompt_lookup"
    has_weights = False

    def new_drafter(self, module, candidates, draft_vocab, lean) -> PromptLookup:
        return PromptLookup()


KIND = PromptLookupKind()
