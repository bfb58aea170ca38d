"""A drafter's measured profile: what predicts its acceptance and chooses its trees, kept apart from the Drafter
(treespec/drafter.py: only what the decoding loop calls), and handed to whatever predicts or chooses trees:
``generate(..., profile=)`` for tree kinds "accuracy" and "auto", the comparison's predictions.

    profile = treespec.heads.load_profile("runs/heads/eagle/final")     # a trained drafter's folder
    out = generate(target, ids, drafter=drafter, tree={"kind": "auto"}, profile=profile)

- ``accuracy[d][r]``: the chance that the rank-r candidate at depth d + 1 is the token the target emits there
  (a trained folder's head_accuracy.json, heads/accuracy.py);
- ``chain_tau``: each acceptance rule's τ of sampled chains in closed form (treespec.chain_tau), for drafters
  that sample their candidates;
- ``tree_chooser``: ``(accuracy, max_nodes) → Tree`` on this device's cost curve (treespec.autotree.auto_chooser;
  a folder's cost_curve.json through ``from_cost_curve``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from treespec.autotree import saved_chooser
from treespec.drafter import SAMPLED_CANDIDATES


@dataclass
class DrafterProfile:
    accuracy: list[list[float]] | None = None
    chain_tau: object | None = None            # treespec.chain_tau.ChainTau
    tree_chooser: Callable | None = None

    @classmethod
    def from_cost_curve(cls, accuracy=None, cost_curve: dict | None = None, chain_tau=None) -> DrafterProfile:
        """A profile whose chooser is ``autotree.saved_chooser`` of a ``cost_curve_record`` (None: no chooser)."""
        return cls(accuracy, chain_tau, saved_chooser(cost_curve) if cost_curve is not None else None)

    def tau_source(self, kind: str, candidates: str, acceptance: str, sampling):
        """What a tree of ``kind`` is predicted from: for an "auto" tree of sampled candidates with a measured
        ``chain_tau``, chains with ``acceptance``'s closed-form τ (a rule without one, e.g. typical, falls back to
        the rank accuracies); otherwise the top-k rank accuracies."""
        if kind == "auto" and self.chain_tau is not None and candidates in SAMPLED_CANDIDATES:
            source = self.chain_tau.source(acceptance, sampling)
            if source is not None:
                return source
        return self.accuracy
