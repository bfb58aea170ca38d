"""The draft-model kind (SpS: Leviathan et al. 2023, Chen et al. 2023): a small causal LM of the target's
tokenizer, trained by the language-model job (scripts/train_lm.py)."""

from __future__ import annotations

from treespec.drafter import CANDIDATE_MODES
from treespec.heads.draft_model.drafter import DraftModel, rank_accuracy
from treespec.heads.kind import DrafterKind
from treespec.reference import load_model


class DraftModelKind(DrafterKind):
    """A small causal LM of the target's tokenizer (conf/drafter/draft.yaml; reference:draft)."""

    name = "draft"
    candidate_modes = CANDIDATE_MODES
    reduces_vocab = True

    def load(self, source, target):
        return load_model(source, dtype=target.dtype)[0].to(target.device)

    def new_drafter(self, module, candidates, draft_vocab, lean) -> DraftModel:
        return DraftModel(module, candidates=candidates, draft_vocab=draft_vocab, lean=lean)

    def rank_accuracy(self, target, module, windows, **options) -> list[list[float]]:
        return rank_accuracy(target, module, windows, **options)


KIND = DraftModelKind()
