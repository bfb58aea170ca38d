"""Tree policies: which candidate tree to verify each step, built from a config.

Static kinds (one Tree for every step):
    {"kind": "chain", "depth": γ}                   classic speculative decoding
    {"kind": "full", "width": w, "depth": d}
    {"kind": "paths", "paths": [[0], [1], [0, 0]]}   Medusa "choices"
    {"kind": "accuracy", "nodes": n}                 grown greedily from measured per-depth top-k
                                                     accuracies (Medusa's sparse trees; analysis.grow_tree)
Bad specifications raise ValueError naming the spec.
"""

from __future__ import annotations

from treespec.analysis import grow_tree
from treespec.tree import Tree

KINDS = ("chain", "full", "paths", "accuracy")


def build_tree(spec, accuracy=None) -> Tree:
    """A Tree from a spec dict (or a Tree, returned as is). ``accuracy[d][r]``: probability that the
    rank-r candidate at depth d+1 is the accepted one (needed by kind "accuracy")."""
    if isinstance(spec, Tree):
        return spec
    original, spec = dict(spec), dict(spec)
    kind = spec.pop("kind", None)
    try:
        if kind == "chain":
            return Tree.chain(int(spec.pop("depth")))
        if kind == "full":
            return Tree.full(int(spec.pop("width")), int(spec.pop("depth")))
        if kind == "paths":
            return Tree.from_paths([tuple(p) for p in spec.pop("paths")])
        if kind == "accuracy":
            if accuracy is None:
                raise ValueError("needs measured per-depth top-k accuracies (train heads first)")
            return grow_tree(accuracy, int(spec.pop("nodes")))
    except KeyError as missing:
        raise ValueError(f"tree spec {original} lacks {missing}") from None
    except (TypeError, ValueError) as err:
        raise ValueError(f"bad tree spec {original}: {err}") from None
    raise ValueError(f"tree spec {original}: kind {kind!r} is not one of {KINDS}")
