"""The Combined kind: no weights of its own; its parts are other kinds' drafters, named in its config."""

from __future__ import annotations

from treespec.drafter import Drafter
from treespec.heads.combined.drafter import Combined, check_settings
from treespec.heads.kind import DrafterKind


class CombinedKind(DrafterKind):
    """Drafters combined (conf/drafter/combined.yaml): ``parts`` names other entries of the comparison's
    ``available``, each loaded and made as it is alone, then ``combine``d; nothing of its own to load or time."""

    name = "combined"
    has_weights = False
    has_parts = True

    def new_drafter(self, module, candidates, draft_vocab, lean) -> Drafter:
        raise ValueError("drafter 'combined' is made from its parts: treespec.heads.Combined([a, b, ...]), or "
                         "conf/drafter/combined.yaml's parts in the comparison")

    def check_settings(self, mode: str = "union", nodes: int | None = None, min_nodes: int = 1) -> None:
        """Raise ValueError naming a bad setting, before any part is loaded."""
        check_settings(mode, nodes, min_nodes)

    def combine(self, parts: list[Drafter], *, mode: str = "union", nodes: int | None = None, min_nodes: int = 1
                ) -> Combined:
        return Combined(parts, mode=mode, nodes=nodes, min_nodes=min_nodes)


KIND = CombinedKind()
