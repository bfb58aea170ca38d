"""Medusa (Cai et al. 2024): heads on the target's last hidden state. network.py the heads, drafter.py the
Drafter and its rank accuracy, objective.py Medusa-1's loss, medusa2.py Medusa-2's joint training (a recipe of
the kind), upstream.py other projects' layouts, kind.py the kind."""

from treespec.heads.medusa.drafter import Medusa
from treespec.heads.medusa.kind import KIND
from treespec.heads.medusa.network import MedusaHeads

__all__ = ["KIND", "Medusa", "MedusaHeads"]
