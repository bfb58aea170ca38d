"""Hydra (Ankner et al. 2024): sequentially dependent draft heads, Medusa-style heads whose candidates at each
tree node are conditioned on that node's own path. network.py the heads (Hydra++'s deeper heads and prefix
attention layer), drafter.py the Drafter and its rank accuracy, objective.py the loss (Hydra++'s teacher
distillation), kind.py the kind."""

from treespec.heads.hydra.drafter import Hydra
from treespec.heads.hydra.kind import KIND
from treespec.heads.hydra.network import HydraHeads

__all__ = ["KIND", "Hydra", "HydraHeads"]
