"""Drafters: everything that proposes a candidate token tree for the target to verify."""

from .base import Drafter, Proposal
from .draft_model import DraftModel
from .prompt_lookup import PromptLookup

__all__ = ["Drafter", "Proposal", "DraftModel", "PromptLookup"]
