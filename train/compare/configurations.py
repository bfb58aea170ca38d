"""What a comparison's configuration is: a drafter (``DrafterSpec``: the drafter with what predictions need, its
measured accuracies, drafting costs and chain τ) and a tree spec, expanded from the config's lists
(``expand_specs``), named for the report (``spec_label``) and resolved into the tree that drafter verifies under an
acceptance rule (``resolve_tree``), or the reason it cannot (train/compare/harness.py measures them).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass

from treespec.drafter import SAMPLED_CANDIDATES
from treespec.planning.autotree import CostModel, EngineCost, auto_chooser, cost_at, cost_model
from treespec.planning.drafting_cost import DraftingCost
from treespec.planning.measured_tau import serving
from treespec.planning.tree_spec import NEEDS_ACCURACY, build_tree
from treespec.tree import Tree

#: the key that makes a tree spec "auto" across drafters, {kind: auto, drafters: [...]}: train/compare/auto_across.py
ACROSS_KEY = "drafters"

@dataclass
class DrafterSpec:
    name: str
    drafter: object
    accuracy: list | None = None        # acc[d][r] for accuracy-grown trees and predictions
    draft_cost_per_depth: float = 0.0   # seconds, for predictions, where no ``drafting_cost`` was timed
    draft_cost_fixed: float = 0.0
    max_depth: int | None = None        # deepest tree it can fill (Medusa: number of heads)
    drafting_step: Callable[[], Callable] | None = None  # makes a call running one drafting call (for timing)
    checksum: dict | None = None        # for the report's stamp: source, weight files' and weights' sha1
    entry: dict | None = None           # its conf/drafter entry (registry name, source): how to load it again
    chain_tau: object | None = None     # planning.chain_tau.ChainTau: each rule's τ on sampled chains, if it samples
    trees: list[dict] | None = None     # its own tree specs, replacing the run's (None: the run's)
    drafting_cost: DraftingCost | None = None  # measured in the loop, as fractions of a one-token pass
                                               # (treespec/planning/drafting_cost.py): put on the cost model's
                                               # own pass, in place of the seconds above
    measured: list | None = None        # planning.measured_tau.MeasuredTrees per rule: τ per tree from a dry run,
                                        # for a drafter without rank accuracies (treespec/planning/model_free.py)

    def tau_source(self, rule: str = "rejection"):
        """What predictions and "auto" use under ``rule``: for sampled candidates the measured chain τ of that rule
        (None where no closed form exists: typical acceptance), else the top-k rank accuracies, else the τ per tree
        its dry run measured under that rule (None: not measured under it)."""
        if self.chain_tau is not None:
            return self.chain_tau.source(rule)
        if self.accuracy is None and self.measured:
            return serving(self.measured, None, rule)
        return self.accuracy

    def cost_model(self, curve: dict[int, float], baseline: float | None = None,
                   engine: EngineCost | None = None) -> CostModel:
        """Its steps' cost model on ``curve`` (the target's, timed after its drafting calls where it drafts);
        ``baseline``: the target's one-token pass alone, which a timed ``drafting_cost`` is put on."""
        fixed, per_depth, per_node = self.drafting_seconds(baseline or cost_at(curve, 1))
        return cost_model(curve, per_depth, fixed, baseline, engine, per_node)

    def drafting_seconds(self, one_token_pass: float) -> tuple[float, float, float]:
        """(seconds per proposal, per drafted depth, per tree node) beside a one-token pass of ``one_token_pass``."""
        if self.drafting_cost is not None and self.drafting_cost.target_pass > 0:
            return self.drafting_cost.on(one_token_pass)
        return self.draft_cost_fixed, self.draft_cost_per_depth, 0.0


def expand_specs(specs) -> list[dict]:
    """List-valued fields expand into one spec per value: {"kind": "chain", "depth": [1, 2]} → two specs (a path
    list and an "auto" across drafters' list of drafters are one value)."""
    out = []
    for spec in specs:
        spec = dict(spec)
        keys = [k for k, v in spec.items() if isinstance(v, (list, tuple)) and k not in ("paths", ACROSS_KEY)]
        for values in itertools.product(*(spec[k] for k in keys)):
            out.append({**spec, **dict(zip(keys, values, strict=True))})
    return out


def spec_label(spec: dict) -> str:
    kind = spec.get("kind")
    if kind == "chain":
        return f"chain γ={spec['depth']}"
    if kind == "full":
        return f"full {spec['width']}×{spec['depth']}"
    if kind == "accuracy":
        return f"accuracy {spec['nodes']}"
    if kind == "dynamic":
        return f"dynamic {spec.get('total_tokens')}/{spec.get('depth')}/{spec.get('top_k')}"
    if kind in ("auto", "default"):
        return kind
    return f"{kind} {len(spec.get('paths', []))}"


def tree_file(config: str) -> str:
    """Where a configuration's tree is saved in the run folder: trees/<drafter>__<tree>.json."""
    return "trees/" + re.sub(r"[^A-Za-z0-9._=-]+", "_", config.replace(" | ", "__")).strip("_") + ".json"


def resolve_tree(spec: dict, d: DrafterSpec, costs: CostModel | dict[int, float], max_nodes: int,
                 baseline: float | None = None, rule: str = "rejection"):
    """The tree this drafter verifies for ``spec`` under acceptance ``rule``, or (None, reason) when it cannot fill
    it. ``costs``: the drafter's CostModel, or its cost curve (with its drafting costs, ``baseline`` the vanilla
    pass's seconds, default the curve's one-token cost, and no engine term)."""
    source = d.tau_source(rule)
    if spec.get("kind") in NEEDS_ACCURACY and source is None:
        return None, f"{d.name} has no measured accuracies" + (f" (no closed-form τ for {rule})" if d.chain_tau else "")
    if spec.get("kind") == "accuracy" and d.chain_tau is not None:
        return None, f"{d.name} samples its candidates; accuracy trees grow top-k ranks (auto chooses its chain)"
    if spec.get("kind") == "accuracy" and d.accuracy is None:
        return None, f"{d.name} has no rank accuracies to grow a tree from (auto chooses among its dry run's trees)"
    if spec.get("kind") == "auto":
        spec = {**spec, "max_nodes": spec.get("max_nodes", max_nodes)}
    costs = costs if isinstance(costs, CostModel) else d.cost_model(costs, baseline)
    tree = build_tree(spec, accuracy=source, acceptance=rule, default=d.drafter.default_tree,
                      choose=auto_chooser(costs))
    if not isinstance(tree, Tree) and not d.drafter.grows_dynamic_trees:
        return None, f"{d.name} cannot grow dynamic trees"
    if not isinstance(tree, Tree) and d.drafter.candidates in SAMPLED_CANDIDATES:
        return None, f"{d.name} samples its candidates; dynamic trees grow top-k ones"
    if d.max_depth is not None and tree.depth > d.max_depth:
        return None, f"{d.name} fills depth <= {d.max_depth}"
    return tree, None
