"""Drafters: everything that proposes a candidate token tree for the target to verify.

One folder per kind (``heads/<kind>/``: draft_model, prompt_lookup, recycling, suffix, rest, lookahead, medusa,
hydra, dflash, eagle, eagle3, combined; PARD is a draft model), each holding the same roles, one module each:
``network.py`` (its trained module), ``drafter.py`` (the core's ``Drafter`` interface, treespec/drafter.py, and its
rank accuracy), ``objective.py`` (its training loss, a ``Recipe``: heads/training/objective.py), ``upstream.py``
(other projects' layouts) and ``kind.py`` (its
``DrafterKind``: heads/kind.py). Beside them the shared machinery: tree expansion, the unrolled window, draft
vocabularies, lean layer calls, batches, checkpoint detection and export. ``registry`` lists the kinds by name,
once, for training, the comparison, the loader and the scripts. ``Combined`` (heads/combined/) merges several
drafters' trees into one. ``load`` (the registry's "auto" kind) reads any drafter checkpoint (treespec's own,
EAGLE-1/2, EAGLE-3, Medusa; a folder or a Hub repo id) into a Drafter, ``load_profile`` its measurements; ``export``
writes one for SGLang, vLLM, speculators, SafeAILab/EAGLE or FasterDecoding/Medusa.
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
