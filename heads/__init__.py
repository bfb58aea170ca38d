"""Drafters: everything that proposes a candidate token tree for the target to verify.

Each implements the core's ``Drafter`` interface (treespec/drafter.py, re-exported here), and each drafter
module declares its kind (heads/kind.py: load, make, rank accuracy, drafting cost); ``registry`` lists the
kinds by name for training, the comparison and the scripts. ``load`` (the registry's "auto" kind) reads any
drafter checkpoint (treespec's own, EAGLE-1/2, EAGLE-3, Medusa; a folder or a Hub repo id) into a Drafter;
``export`` writes one for SGLang, vLLM, speculators, SafeAILab/EAGLE or FasterDecoding/Medusa.
"""

from treespec.drafter import Drafter, Proposal

from .draft_model import DraftModel
from .eagle import Eagle
from .eagle_model import EagleModel
from .export import export
from .load import load
from .medusa import Medusa, MedusaHeads
from .prompt_lookup import PromptLookup

__all__ = ["Drafter", "Proposal", "DraftModel", "PromptLookup", "Medusa", "MedusaHeads", "Eagle", "EagleModel", "load",
           "export"]
