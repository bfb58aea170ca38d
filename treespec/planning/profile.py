"""A drafter's measured profile: what predicts its acceptance and chooses its trees, kept apart from the Drafter
(treespec/drafter.py: only what the decoding loop calls), and handed to whatever predicts or chooses trees:
``generate(..., profile=)`` for tree kinds "accuracy" and "auto", the comparison's predictions.

    profile = treespec.heads.load_profile("runs/heads/eagle/final")     # a trained drafter's folder
    profile = treespec.heads.load_profile("reference:eagle", target)    # costs measured here on first use
    out = generate(target, ids, drafter=drafter, tree={"kind": "auto"}, profile=profile)
    out.tree                                                            # the tree "auto" chose

- ``accuracy[d][r]``: the chance that the rank-r candidate at depth d + 1 is the token the target emits there
  (a trained folder's head_accuracy.json, heads/training/accuracy.py);
- ``chain_tau``: each acceptance rule's τ of sampled chains in closed form (treespec.planning.chain_tau), for
  drafters that sample their candidates: one measurement, or a list of them at different samplings (chain_tau.json);
- ``measured``: τ per tree measured by a dry run (treespec.planning.measured_tau, measured_trees.json), for a drafter
  without rank accuracies (the model-free kinds: treespec.planning.model_free.model_free_profile makes one);
- ``tree_chooser``: ``(accuracy, max_nodes) → Tree`` on this device's cost model
  (treespec.planning.autotree.auto_chooser; a folder's cost_curve.json through ``from_cost_curve``), ``costs`` the
CostModel it chooses with; - ``measure_chain_tau``: ``(drafter, sampling, prompt) → ChainTau``, how a chain τ missing at
  a sampling is measured on first use (heads.load_profile with a target gives one; None: it cannot be).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from treespec.drafter import SAMPLED_CANDIDATES
from treespec.planning.autotree import CostModel, saved_chooser
from treespec.planning.measured_tau import serving

#: the rules whose τ on sampled chains has a closed form (treespec/planning/chain_tau.py's CHAIN_RULES)
CLOSED_FORM_RULES = ("rejection", "block", "traversal")


@dataclass
class DrafterProfile:
    accuracy: list[list[float]] | None = None
    chain_tau: object | None = None            # planning.chain_tau.ChainTau, or a list of them (one per sampling)
    tree_chooser: Callable | None = None
    measure_chain_tau: Callable | None = None  # (drafter, sampling, prompt [1, P]) → ChainTau, on first use
    costs: CostModel | None = None             # what tree_chooser chooses with, when known
    measured: object | None = None             # planning.measured_tau.MeasuredTrees, or a list of them (one per
    #                                            sampling and rule): τ per tree from a dry run, for a drafter
    #                                            without rank accuracies (the model-free kinds)
    batch_costs: dict | None = None            # {B: CostModel} at B rows, measured on first use of a tree per batch
    #                                            size (planning/batch_table.py) and kept for the next calls

    @classmethod
    def from_cost_curve(cls, accuracy=None, cost_curve: dict | None = None, chain_tau=None,
                        measure_chain_tau: Callable | None = None, measured=None) -> DrafterProfile:
        """A profile whose chooser is ``autotree.saved_chooser`` of a ``cost_curve_record`` (None: no chooser)."""
        if cost_curve is None:
            return cls(accuracy, chain_tau, None, measure_chain_tau, measured=measured)
        return cls(accuracy, chain_tau, saved_chooser(cost_curve), measure_chain_tau, CostModel.from_record(cost_curve),
                   measured)

    def measured_trees(self) -> list:
        """Every dry-run measurement it holds (planning.measured_tau.MeasuredTrees)."""
        if self.measured is None:
            return []
        return list(self.measured) if isinstance(self.measured, (list, tuple)) else [self.measured]

    def measured_at(self, sampling, acceptance: str):
        """Its τ per tree that serves ``sampling`` (None: any) under ``acceptance`` (``MeasuredTrees.serves``); a
        ValueError says what it holds when none does."""
        held = self.measured_trees()
        found = serving(held, sampling, acceptance)
        if found is None:
            have = "; ".join(f"{m.rule} at T={m.sampling.temperature}, top-p={m.sampling.top_p}" for m in held)
            raise ValueError(f"'auto' for a drafter without rank accuracies chooses among the trees its dry run "
                             f"decoded with, and this profile holds none under {acceptance} at "
                             f"T={getattr(sampling, 'temperature', None)}, top-p={getattr(sampling, 'top_p', None)} "
                             f"(it holds: {have}): measure one with treespec.planning.model_free.model_free_profile("
                             "target, drafter, prompts, temperature=..., acceptance=...)")
        return found

    def chain_taus(self) -> list:
        """Every chain τ measurement it holds."""
        if self.chain_tau is None:
            return []
        return list(self.chain_tau) if isinstance(self.chain_tau, (list, tuple)) else [self.chain_tau]

    def chain_tau_at(self, sampling, drafter=None, prompt=None):
        """Its chain τ at ``sampling`` (None: the only one it holds), measured now when it holds none there and can
        measure one (``measure_chain_tau``, on ``drafter`` and ``prompt``); None when neither."""
        held = self.chain_taus()
        if sampling is None:
            return held[0] if len(held) == 1 else None
        found = next((m for m in held if m.sampling == sampling), None)
        if found is None and self.measure_chain_tau is not None and drafter is not None and prompt is not None:
            found = self.measure_chain_tau(drafter, sampling, prompt)
            self.chain_tau = [*held, found]
        return found

    def tau_source(self, kind: str, candidates: str, acceptance: str, sampling, drafter=None, prompt=None):
        """What a tree of ``kind`` is predicted from: for an "auto" tree of candidates sampled at ``sampling``
        (temperature > 0), chains with ``acceptance``'s closed-form τ at that sampling (held, or measured now on
        ``drafter`` and ``prompt``; a ValueError names what is missing when neither); a rule without a closed form
        (typical) and every other case: the top-k rank accuracies."""
        if kind == "auto" and self.accuracy is None and self.measured_trees():
            return self.measured_at(sampling, acceptance)  # a model-free drafter: τ per tree from its dry run
        sampled = candidates in SAMPLED_CANDIDATES and not (sampling is not None and sampling.greedy)
        if kind != "auto" or not sampled or acceptance not in CLOSED_FORM_RULES:
            return self.accuracy
        if sampling is None and not self.chain_taus():
            return self.accuracy  # no sampling given (a comparison's own check): nothing to ask for
        found = self.chain_tau_at(sampling, drafter, prompt)
        if found is None:
            held = ", ".join(f"T={m.sampling.temperature}, top-p={m.sampling.top_p}" for m in self.chain_taus())
            at = "" if sampling is None else f" at T={sampling.temperature}, top-p={sampling.top_p}"
            raise ValueError(
                f"'auto' with sampled candidates chooses γ by each rule's chain τ{at}, which this profile lacks ("
                + (f"measured at {held} only" if held else "no chain_tau.json beside the drafter") + ") and cannot "
                "measure: load it with its target, treespec.heads.load_profile(source, target), which measures it on "
                "first use, or give DrafterProfile(chain_tau=treespec.planning.chain_tau.measure_chain_tau(...))")
        return found.source(acceptance, sampling)
