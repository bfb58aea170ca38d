"""The drafter registry: every drafter kind by name (heads/kind.py: how to load it, make it a Drafter, measure
its per-depth rank accuracy and its drafting cost, each declared by its own module). Training
(treespec.train.train_heads), the comparison (treespec.train.compare) and the scripts look drafters up here and
nowhere else; conf/drafter/<name>.yaml describes each one's settings once.

    kind = registry.get("eagle")
    drafter = registry.build("eagle", target, source="reference:eagle", candidates="sample")
    drafter = registry.build("auto", target, source="/path/to/any/checkpoint")   # = treespec.heads.load
"""

from __future__ import annotations

from treespec.drafter import Drafter

from . import draft_model, eagle, eagle3, medusa, prompt_lookup
from .kind import DrafterKind
from .load import AUTO, with_measurements
from .vocab import DraftVocab

#: every kind, in the order the comparison lists them; "auto" is any checkpoint treespec.heads.load reads
KINDS: tuple[DrafterKind, ...] = (draft_model.KIND, prompt_lookup.KIND, medusa.KIND, eagle.KIND, eagle3.KIND, AUTO)
_BY_NAME = {kind.name: kind for kind in KINDS}


def get(name: str) -> DrafterKind:
    if name not in _BY_NAME:
        raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(_BY_NAME)}")
    return _BY_NAME[name]


def load(name: str, target, source=None):
    """The trained module of drafter ``name`` from ``source`` (``reference:<name>``, a folder, or for "auto" a Hub
    repo id); None for a drafter without weights."""
    kind = get(name)
    if not kind.has_weights:
        return None
    if source is None:
        raise ValueError(f"drafter {name!r} needs a source: reference:<name> or a folder of trained weights")
    return kind.load(source, target)


def make(name: str, module, candidates: str = "topk", draft_vocab: DraftVocab | None = None, *,
         lean: bool = True) -> Drafter:
    """``DrafterKind.make`` of drafter ``name``: ``draft_vocab`` restricts its vocabulary projection to these
    target ids (FR-Spec); ``lean``: draft without the base model's per-call work (heads/lean.py), False for the
    plain forward."""
    return get(name).make(module, candidates, draft_vocab, lean)


def build(name: str, target, source=None, candidates: str = "topk") -> Drafter:
    """load + make: a ready Drafter for ``target``, with its folder's measured accuracies and saved cost curve
    (heads/load.py's ``with_measurements``) when it has a folder."""
    drafter = make(name, load(name, target, source), candidates)
    return with_measurements(drafter, source) if source is not None and get(name).has_weights else drafter
