"""treespec: tree speculative decoding on stock transformers models.

    from treespec import Tree, generate
    from treespec.heads import DraftModel
    out = generate(target, input_ids, drafter=DraftModel(draft), tree=Tree.full(2, 3), max_new_tokens=64)
    out.sequences, out.mean_accept_length
"""

from .batch_trees import TreesByBatch
from .generate import GenerationResult

# the public generate() plans (a tree spec resolved, measured if need be), then runs the loop: the one place outside
# treespec/planning/ in the core that names planning, and it only re-exports (tests/test_layering.py)
from .planning.resolve import generate  # noqa: TID251
from .sampling import Sampling
from .tree import Tree

__all__ = ["Tree", "TreesByBatch", "generate", "GenerationResult", "Sampling"]
