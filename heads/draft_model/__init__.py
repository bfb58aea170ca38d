"""A separate small causal LM as the drafter (SpS). drafter.py the Drafter and its rank accuracy, kind.py its kind,
network.py a fresh draft for a given target, objective.py its distillation from that target; parallel.py PARD (the
draft filling k depths in one pass, ``ParallelDraft``) and pard_objective.py its adaptation from a trained draft."""

from treespec.heads.draft_model.drafter import DraftModel
from treespec.heads.draft_model.kind import KIND
from treespec.heads.draft_model.parallel import ParallelDraft

__all__ = ['KIND', 'DraftModel', 'ParallelDraft']
