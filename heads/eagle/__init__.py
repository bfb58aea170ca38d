"""EAGLE-1/2 (Li et al. 2024): a feature-level drafter. network.py the model, drafter.py the Drafter and its
rank accuracy, objective.py its loss, upstream.py other projects' layouts, kind.py its kind."""

from treespec.heads.eagle.drafter import Eagle
from treespec.heads.eagle.kind import KIND
from treespec.heads.eagle.network import EagleModel

__all__ = ['KIND', 'Eagle', 'EagleModel']
