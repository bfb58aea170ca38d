"""The Combined kind: no weights of its own; its parts are other kinds' drafters, named in its config."""

from __future__ import annotations

from treespec.drafter import Drafter
from treespec.heads.combined.drafter import Combined, check_settings
from treespec.heads.kind import DrafterKind
from treespec.planning.tree_spec import NEEDS_ACCURACY, build_tree, check_tree_spec


def check_part_tree_specs(part_trees) -> list | None:
    """``part_trees`` (conf/drafter/combined.yaml): None, or a list of tree specs and nulls, one per part → the
    specs checked; ValueError naming anything else. Accuracy-grown kinds need a profile a part lacks here."""
    if part_trees is None:
        return None
    if isinstance(part_trees, (str, dict)) or not hasattr(part_trees, "__iter__"):
        raise ValueError(f"part_trees must list one tree spec or null per part, got {part_trees!r}")
    specs = [None if spec is None else check_tree_spec(spec) for spec in part_trees]
    for spec in specs:
        if isinstance(spec, dict) and spec["kind"] in NEEDS_ACCURACY:
            raise ValueError(f"part_trees: {spec} is grown from a drafter's accuracies, which a part of a combination "
                             "is not profiled for; give a chain, full, paths, dynamic or default tree")
    return specs


class CombinedKind(DrafterKind):
    """Drafters combined (conf/drafter/combined.yaml): ``parts`` names other entries of the comparison's
    ``available``, each loaded and made as it is alone, then ``combine``d; nothing of its own to load or time."""

    name = "combined"
    has_weights = False
    has_parts = True

    def new_drafter(self, module, candidates, draft_vocab, lean) -> Drafter:
        raise ValueError("drafter 'combined' is made from its parts: treespec.heads.Combined([a, b, ...]), or "
                         "conf/drafter/combined.yaml's parts in the comparison")

    def check_settings(self, mode: str = "union", nodes: int | None = None, min_nodes: int = 1,
                       part_trees=None) -> None:
        """Raise ValueError naming a bad setting, before any part is loaded."""
        check_settings(mode, nodes, min_nodes)
        check_part_tree_specs(part_trees)

    def combine(self, parts: list[Drafter], *, mode: str = "union", nodes: int | None = None, min_nodes: int = 1,
                part_trees=None) -> Combined:
        specs = check_part_tree_specs(part_trees)
        trees = None if specs is None else [
            None if spec is None else build_tree(spec, default=part.default_tree)
            for part, spec in zip(parts, specs, strict=False)]  # a wrong length: Combined names it
        return Combined(parts, mode=mode, nodes=nodes, min_nodes=min_nodes, part_trees=trees)


KIND = CombinedKind()
