"""What a drafter kind is: one object that knows how to load its trained module, make the Drafter generate()
takes, measure its per-depth rank accuracy, and time its drafting. Each drafter module declares its own
(``KIND``: draft_model, prompt_lookup, medusa, eagle, eagle3; heads/load.py's ``AUTO`` for any checkpoint);
heads/registry.py lists them by name for training, the comparison and the scripts.

    kind = registry.get("eagle")
    module = kind.load("reference:eagle", target)               # the trained module (None: no weights)
    drafter = kind.make(module, candidates="sample")            # the Drafter
    acc = kind.rank_accuracy(target, module, windows)           # acc[d][r] (heads/accuracy.py), or None
    fixed, per_depth = kind.cost(drafter)                       # seconds, for predicted speedups
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from treespec.drafter import Drafter
from treespec.timing import median_time

from .vocab import DraftVocab


class DrafterKind:
    """Base class; a kind overrides ``load``, ``new_drafter`` and, where it has them, ``rank_accuracy`` and
    ``max_depth``."""

    #: the registry name (conf/drafter/<name>.yaml's ``name``)
    name: str = ""
    #: whether it has trained weights, loaded from a source (reference:<name>, a folder, a Hub repo id)
    has_weights: bool = True
    #: candidate modes it supports ("sample": children drawn i.i.d. from the draft distribution)
    candidate_modes: tuple[str, ...] = ("topk",)
    #: whether its full-vocabulary head can be restricted to a frequency-ranked subset (FR-Spec, heads/vocab.py)
    reduces_vocab: bool = False

    def __repr__(self) -> str:
        return f"<drafter kind {self.name!r}>"

    def load(self, source, target) -> nn.Module | None:
        """The trained module for ``target`` from ``source``; None for a kind without weights."""
        return None

    def make(self, module, candidates: str = "topk", draft_vocab: DraftVocab | None = None, lean: bool = True
             ) -> Drafter:
        """The Drafter that drives ``module``. ``draft_vocab``: restrict its vocabulary projection to these target
        ids (FR-Spec); ``lean``: draft without the base model's per-call work (heads/lean.py)."""
        if candidates not in self.candidate_modes:
            raise ValueError(f"drafter {self.name!r} takes candidates in {self.candidate_modes}, got {candidates!r}")
        if draft_vocab is not None and not self.reduces_vocab:
            raise ValueError(f"drafter {self.name!r} has no full-vocabulary head to restrict (FR-Spec: draft, medusa, "
                             "eagle)")
        return self.new_drafter(module, candidates, draft_vocab, lean)

    def new_drafter(self, module, candidates: str, draft_vocab: DraftVocab | None, lean: bool) -> Drafter:
        """``make`` after its checks."""
        raise NotImplementedError

    def rank_accuracy(self, target, module, windows, **options) -> list[list[float]] | None:
        """acc[d][r] (heads/accuracy.py), teacher forced on held-out ``windows`` [n, S]; None: it has no fixed
        ranks to score. ``options``: the module's ``rank_accuracy`` keywords (``sampling``, ``depth``, ...)."""
        return None

    def max_depth(self, module) -> int | None:
        """The deepest tree it can fill (Medusa: its number of heads); None: unbounded."""
        return None

    def drafting_step(self, drafter: Drafter, batch: int = 1) -> Callable[[], object] | None:
        """A call that runs one drafting call of ``drafter`` for ``batch`` rows (what ``cost`` times;
        ``Drafter.drafting_step``), to time target passes after it; None: it has no weights to push the target's
        out of the caches."""
        return drafter.drafting_step(batch=batch)

    def cost(self, drafter: Drafter, before: Callable[[], object] | None = None, batch: int = 1
             ) -> tuple[float, float]:
        """(seconds per proposal, seconds per drafted depth) of ``drafter`` as it drafts (lean or not) for ``batch``
        rows, for predicted speedups: a drafter that fills its tree at once costs per proposal, the others per
        depth. ``before()`` runs untimed ahead of each timed call (a target pass, as in decoding):
        ``bench.median_time``."""
        step = self.drafting_step(drafter, batch)
        if step is None:
            return 0.0, 0.0
        seconds = median_time(step, before=before)
        drafter.reset()
        return (seconds, 0.0) if drafter.fills_tree_at_once else (0.0, seconds)
