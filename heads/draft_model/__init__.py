"""A separate small causal LM as the drafter (SpS). drafter.py the Drafter and its rank accuracy, kind.py its kind."""

from treespec.heads.draft_model.drafter import DraftModel
from treespec.heads.draft_model.kind import KIND

__all__ = ['KIND', 'DraftModel']
