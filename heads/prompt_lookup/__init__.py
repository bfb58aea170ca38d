"""Prompt lookup (PLD): n-gram matches in the context, no model. drafter.py the Drafter, kind.py its kind."""

from treespec.heads.prompt_lookup.drafter import PromptLookup
from treespec.heads.prompt_lookup.kind import KIND

__all__ = ['KIND', 'PromptLookup']
