"""The drafter registry: every drafter kind by name, and how to load it, make it a Drafter, measure its
per-depth rank accuracy and its drafting cost. Training (treespec.train.heads), the comparison
(treespec.train.compare) and the scripts look drafters up here and nowhere else; conf/drafter/<name>.yaml
describes each one's settings once.

    kind = registry.get("eagle")
    drafter = registry.build("eagle", target, source="reference:eagle", candidates="sample")
    drafter = registry.build("auto", target, source="/path/to/any/checkpoint")   # heads/load.py detects the format
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from treespec.drafter import CANDIDATE_MODES, Drafter
from treespec.reference import load_model, resolve

from . import draft_model, eagle, eagle3, medusa
from .draft_model import DraftModel
from .eagle import Eagle, EagleModel
from .eagle3 import Eagle3, Eagle3Model
from .expansion import depth_cost, depth_step
from .load import drafter_for, load_module, with_measurements
from .medusa import Medusa, MedusaHeads
from .prompt_lookup import PromptLookup
from .vocab import DraftVocab


@dataclass(frozen=True)
class DrafterKind:
    name: str
    #: (source folder, target) → the trained module; None for drafters without weights
    load: Callable | None
    #: (module, candidates, draft vocabulary or None, lean) → the Drafter generate() takes
    make: Callable[[object, str, DraftVocab | None, bool], Drafter]
    #: (target, module, windows, *, sampling) → acc[d][r] (heads/accuracy.py); None: no fixed ranks to score
    rank_accuracy: Callable | None = None
    #: (the Drafter ``make`` gave, before=None) → (seconds per proposal, seconds per drafted depth), for predicted
    #: speedups; ``before()`` runs untimed ahead of each timed call (a target pass, as in decoding)
    cost: Callable[..., tuple[float, float]] = lambda drafter, before=None: (0.0, 0.0)
    #: candidate modes it supports ("sample": children drawn i.i.d. from the draft distribution)
    candidate_modes: tuple[str, ...] = ("topk",)
    #: the deepest tree it can fill, from the module (Medusa: its number of heads); None: unbounded
    max_depth: Callable[[object], int | None] = lambda module: None
    #: whether its full-vocabulary head can be restricted to a frequency-ranked subset (FR-Spec, heads/vocab.py)
    reduces_vocab: bool = False
    #: the Drafter → a call that runs one drafting call (what ``cost`` times), to time target passes after; None:
    #: it has no weights to push the target's out of the caches
    drafting_step: Callable[[Drafter], Callable[[], object]] | None = None


def _load_draft_model(source, target):
    return load_model(source, dtype=target.dtype)[0].to(target.device)


# "auto": any checkpoint treespec.heads.load reads (treespec, EAGLE-1/2, EAGLE-3, Medusa layouts; a folder or a Hub
# repo id), measured and driven as the module it turns out to be.
def _by_module(module, eagle_fn, eagle3_fn, medusa_fn):
    if isinstance(module, Eagle3Model):
        return eagle3_fn
    if isinstance(module, EagleModel):
        return eagle_fn
    if isinstance(module, MedusaHeads):
        return medusa_fn
    raise TypeError(f"drafter 'auto' loaded a {type(module).__name__}, which it cannot drive")


def _auto_rank_accuracy(target, module, windows, **kwargs):
    fn = _by_module(module, eagle.rank_accuracy, eagle3.rank_accuracy, medusa.rank_accuracy)
    return fn(target, module, windows, **kwargs)


def _drafting_cost(drafter, before=None) -> tuple[float, float]:
    """(per proposal, per depth) seconds of a drafter: Medusa fills its tree in one call, the others per depth."""
    if isinstance(drafter, Medusa):
        return medusa.proposal_cost(drafter, before), 0.0
    return 0.0, depth_cost(drafter, before=before)


def _drafting_step(drafter):
    """One drafting call as ``_drafting_cost`` times it (``drafter.reset()`` when done with it)."""
    return medusa.proposal_step(drafter) if isinstance(drafter, Medusa) else depth_step(drafter)


KINDS: dict[str, DrafterKind] = {
    "draft": DrafterKind(
        "draft", _load_draft_model,
        lambda m, candidates, vocab, lean: DraftModel(m, candidates=candidates, draft_vocab=vocab, lean=lean),
        draft_model.rank_accuracy, _drafting_cost, CANDIDATE_MODES, reduces_vocab=True,
        drafting_step=_drafting_step),
    "prompt_lookup": DrafterKind("prompt_lookup", None, lambda m, candidates, vocab, lean: PromptLookup()),
    "medusa": DrafterKind(
        "medusa", lambda source, target: MedusaHeads.from_pretrained(resolve(source), target),
        lambda m, candidates, vocab, lean: Medusa(m, draft_vocab=vocab, lean=lean), medusa.rank_accuracy,
        _drafting_cost, max_depth=lambda m: m.num_heads, reduces_vocab=True, drafting_step=_drafting_step),
    "eagle": DrafterKind(
        "eagle", lambda source, target: EagleModel.from_pretrained(resolve(source), target),
        lambda m, candidates, vocab, lean: Eagle(m, candidates=candidates, draft_vocab=vocab, lean=lean),
        eagle.rank_accuracy,
        _drafting_cost, CANDIDATE_MODES, reduces_vocab=True, drafting_step=_drafting_step),
    "eagle3": DrafterKind(
        "eagle3", lambda source, target: Eagle3Model.from_pretrained(resolve(source), target),
        lambda m, candidates, vocab, lean: Eagle3(m, candidates=candidates, lean=lean), eagle3.rank_accuracy,
        _drafting_cost, CANDIDATE_MODES, drafting_step=_drafting_step),
    "auto": DrafterKind(
        "auto", lambda source, target: load_module(source, target),
        lambda m, candidates, vocab, lean: drafter_for(m, candidates, lean=lean),
        _auto_rank_accuracy, _drafting_cost, CANDIDATE_MODES, drafting_step=_drafting_step,
        max_depth=lambda m: m.num_heads if isinstance(m, MedusaHeads) else None),
}


def get(name: str) -> DrafterKind:
    if name not in KINDS:
        raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(KINDS)}")
    return KINDS[name]


def load(name: str, target, source=None):
    """The trained module of drafter ``name`` from ``source`` (``reference:<name>`` or a folder); None for a
    drafter without weights."""
    kind = get(name)
    if kind.load is None:
        return None
    if source is None:
        raise ValueError(f"drafter {name!r} needs a source: reference:<name> or a folder of trained weights")
    return kind.load(source, target)


def make(name: str, module, candidates: str = "topk", draft_vocab: DraftVocab | None = None, *,
         lean: bool = True) -> Drafter:
    """``draft_vocab``: restrict the drafter's vocabulary projection to these target ids (FR-Spec); ``lean``:
    draft without the base model's per-call work (heads/lean.py), False for the plain forward."""
    kind = get(name)
    if candidates not in kind.candidate_modes:
        raise ValueError(f"drafter {name!r} takes candidates in {kind.candidate_modes}, got {candidates!r}")
    if draft_vocab is not None and not kind.reduces_vocab:
        raise ValueError(f"drafter {name!r} has no full-vocabulary head to restrict (FR-Spec: draft, medusa, eagle)")
    return kind.make(module, candidates, draft_vocab, lean)


def build(name: str, target, source=None, candidates: str = "topk") -> Drafter:
    """load + make: a ready Drafter for ``target``, with its folder's measured accuracies and saved cost curve
    (heads/load.py's ``with_measurements``) when it has a folder."""
    drafter = make(name, load(name, target, source), candidates)
    return with_measurements(drafter, source) if source is not None and get(name).load is not None else drafter
