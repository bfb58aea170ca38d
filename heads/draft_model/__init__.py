"""A separate small causal LM as the drafter (SpS). drafter.py the Drafter and its rank accuracy, kind.py its kind,
network.py a fresh draft for a given target, objective.py its distillation from that target."""

from treespec.heads.draft_model.drafter import DraftModel
from treespec.heads.draft_model.kind import KIND

__all__ = ['KIND', 'DraftModel']
