"""Drafters: everything that proposes a candidate token tree for the target to verify.

One folder per kind (heads/<kind>/), three folders of shared machinery (drafting/, training/, checkpoints/), the
DrafterKind base (kind.py) and the registry that lists the kinds once (registry.py). ``load`` reads any drafter
checkpoint into a Drafter, ``load_profile`` its measurements, ``export`` writes one for a serving stack. Every module,
and who may import whom: docs/design.md, "Module map".
"""

from treespec.drafter import Drafter, Proposal
from treespec.heads.checkpoints.export import export
from treespec.heads.combined import Combined
from treespec.heads.dflash import DFlash, DFlashModel
from treespec.heads.draft_model import DraftModel, ParallelDraft
from treespec.heads.eagle import Eagle, EagleModel
from treespec.heads.eagle3 import Eagle3, Eagle3Model
from treespec.heads.hydra import Hydra, HydraHeads
from treespec.heads.lookahead import Lookahead
from treespec.heads.medusa import Medusa, MedusaHeads
from treespec.heads.prompt_lookup import PromptLookup
from treespec.heads.recycling import TokenRecycling
from treespec.heads.registry import load, load_profile
from treespec.heads.rest import Rest
from treespec.heads.suffix import SuffixDecoding

__all__ = ["Drafter", "Proposal", "Combined", "DraftModel", "ParallelDraft", "PromptLookup", "TokenRecycling",
           "SuffixDecoding", "Rest", "Lookahead", "Medusa", "MedusaHeads", "Hydra", "HydraHeads", "Eagle", "EagleModel",
           "Eagle3", "Eagle3Model", "DFlash", "DFlashModel", "load", "load_profile", "export"]
