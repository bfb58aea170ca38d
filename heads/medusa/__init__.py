"""Medusa (Cai et al. 2024): heads on the target's last hidden state. network.py the heads, drafter.py the
Drafter and its rank accuracy, objective.py Medusa-1's loss, medusa2.py Medusa-2's joint training, upstream.py
other projects' layouts, kind.py both kinds."""

from treespec.heads.medusa.drafter import Medusa
from treespec.heads.medusa.kind import KIND, MEDUSA2
from treespec.heads.medusa.network import MedusaHeads

__all__ = ["KIND", "MEDUSA2", "Medusa", "MedusaHeads"]
