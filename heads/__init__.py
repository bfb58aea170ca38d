"""Drafters: everything that proposes a candidate token tree for the target to verify.

Each implements the core's ``Drafter`` interface (treespec/drafter.py, re-exported here); ``registry``
names them for training, the comparison and the scripts. ``load`` reads any drafter checkpoint (treespec's own,
EAGLE-1/2, EAGLE-3, Medusa; a folder or a Hub repo id) into a Drafter; ``export`` writes one for SGLang, vLLM,
speculators, SafeAILab/EAGLE or FasterDecoding/Medusa.
"""

from treespec.drafter import Drafter, Proposal

from .draft_model import DraftModel
from .eagle import Eagle, EagleModel
from .export import export
from .load import load
from .medusa import Medusa, MedusaHeads
from .prompt_lookup import PromptLookup

__all__ = ["Drafter", "Proposal", "DraftModel", "PromptLookup", "Medusa", "MedusaHeads", "Eagle", "EagleModel", "load",
           "export"]
