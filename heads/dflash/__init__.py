"""DFlash (Chen et al. 2026, arXiv 2602.06036): a block diffusion drafter that fills a whole block of the tree in one
pass from the target's multi-layer features. network.py and block_layer.py the model, drafter.py the Drafter (chains and
trees over the block: treespec/block_tree.py), objective.py its loss, upstream.py z-lab's layout, kind.py its kind."""

from treespec.heads.dflash.drafter import DFlash
from treespec.heads.dflash.kind import KIND
from treespec.heads.dflash.network import DFlashModel

__all__ = ["KIND", "DFlash", "DFlashModel"]
