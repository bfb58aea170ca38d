"""EAGLE-3 (Li et al. 2025): fused aux features, a draft vocabulary, training-time test. network.py and
layer.py the model, drafter.py the Drafter, objective.py its loss, upstream.py other layouts, kind.py its kind."""

from treespec.heads.eagle3.drafter import Eagle3
from treespec.heads.eagle3.kind import KIND
from treespec.heads.eagle3.network import Eagle3Model

__all__ = ['KIND', 'Eagle3', 'Eagle3Model']
