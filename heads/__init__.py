"""Drafters: everything that proposes a candidate token tree for the target to verify.

Each implements the core's ``Drafter`` interface (treespec/drafter.py, re-exported here); ``registry``
names them for training, the comparison and the scripts.
"""

from treespec.drafter import Drafter, Proposal

from .draft_model import DraftModel
from .eagle import Eagle, EagleModel
from .medusa import Medusa, MedusaHeads
from .prompt_lookup import PromptLookup

__all__ = ["Drafter", "Proposal", "DraftModel", "PromptLookup", "Medusa", "MedusaHeads", "Eagle", "EagleModel"]
