"""treespec: tree speculative decoding on stock transformers models.

    from treespec import Tree, generate
    from treespec.heads import DraftModel
    out = generate(target, input_ids, drafter=DraftModel(draft), tree=Tree.full(2, 3), max_new_tokens=64)
    out.sequences, out.mean_accept_length
"""

from .generate import GenerationResult, generate
from .sampling import Sampling
from .tree import Tree

__all__ = ["Tree", "generate", "GenerationResult", "Sampling"]
