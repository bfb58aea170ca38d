""""auto" across drafters: the best drafter, tree and acceptance rule for this device and workload, or no speculation
when nothing is predicted to pay.

Each drafter's own "auto" already weighs its trees against the empty tree on its cost model (autotree.choose_tree).
Across drafters the question is the same one asked once more: which (drafter, rule)'s best tree has the highest
predicted speedup over vanilla decoding, and is it above 1? Every drafter is predicted by its profile, whatever
it is: rank accuracies (a trained drafter), each rule's chain τ (sampled candidates), or τ per tree from a dry run (a
model-free drafter, treespec/planning/model_free.py), each on its own cost model, whose vanilla step is the same
target pass and engine step. So the comparison is one of predicted tokens/s.

This is planning: it runs before decoding, and the loop is handed the result, a drafter and a tree, as it is handed
any other (``Plan.arguments``):

    plan = plan_across(target, ids, {"eagle": (eagle, load_profile("reference:eagle", target)),
                                     "prompt_lookup": (lookup, model_free_profile(target, lookup, held_out))},
                       max_new_tokens=128)
    out = generate(target, ids, **plan.arguments, max_new_tokens=128)   # plan.name is None: no speculation

``choose_across`` is the choice itself over ``Option``s (a name, a τ source, a cost model, a rule), which the
comparison (train/compare/setup_costs.py, ``{kind: auto, drafters: [...]}``) calls with what it measured.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from treespec.drafter import Drafter
from treespec.dynamic_tree import DynamicTree
from treespec.inputs import check_arguments
from treespec.planning.autotree import CostModel, Prediction, chains_only, choose_tree, tau_source
from treespec.planning.profile import DrafterProfile
from treespec.planning.resolve import loop_arguments
from treespec.planning.tree_spec import CHAIN_RULES
from treespec.tree import Tree
from treespec.walker import ACCEPTANCE_MODES


@dataclass(frozen=True)
class Option:
    """One drafter under one acceptance rule: what predicts its τ (rank accuracies or a τ source) and its steps'
    costs on this device."""

    name: str
    source: object
    costs: CostModel
    rule: str = "rejection"


@dataclass
class Plan:
    """What ``choose_across`` chose: the drafter's ``name`` (None: no speculation, vanilla decoding), its ``tree``
    (``Tree.chain(0)`` for vanilla), the ``acceptance`` rule, the ``prediction`` (speedup 1 for vanilla), and each
    (drafter, rule)'s best prediction in ``considered``. ``drafter``: the Drafter itself, where ``plan_across`` was
    handed it."""

    name: str | None
    tree: Tree | DynamicTree
    acceptance: str
    prediction: Prediction
    considered: dict[tuple[str, str], Prediction] = field(default_factory=dict)
    drafter: object | None = None

    @property
    def arguments(self) -> dict:
        """generate()'s ``drafter``, ``tree`` and ``acceptance`` for this plan."""
        return {"drafter": self.drafter, "tree": self.tree, "acceptance": self.acceptance}


def choose_across(options: list[Option], *, max_nodes: int = 64) -> Plan:
    """The option whose best tree (``choose_tree``, up to ``max_nodes`` candidates) is predicted fastest, or no
    speculation when none is predicted above vanilla; ties go to the earlier option."""
    if not options:
        raise ValueError("'auto' across drafters needs at least one drafter to weigh against no speculation, got an "
                         "empty list")
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 0:  # -1: max() of nothing
        raise ValueError(f"max_nodes must be an integer >= 0 (0: no speculation), got {max_nodes!r}")
    for o in options:
        if not isinstance(o, Option) or not isinstance(o.costs, CostModel) or o.rule not in ACCEPTANCE_MODES:
            raise ValueError(f"'auto' across drafters weighs Options (a name, a τ source, a CostModel, a rule of "
                             f"{ACCEPTANCE_MODES}), got {o!r}")
    seen = [(o.name, o.rule) for o in options]
    twice = sorted({k for k in seen if seen.count(k) > 1})
    if twice:
        raise ValueError(f"'auto' across drafters was given {', '.join(f'{n} under {r}' for n, r in twice)} twice: "
                         "each drafter once per rule")
    considered = {}
    for o in options:
        if o.source is None:
            raise ValueError(f"'auto' across drafters: {o.name} has nothing that predicts its τ under {o.rule} (no "
                             "rank accuracies, chain τ or measured trees)")
        source = chains_only(o.source) if o.rule in CHAIN_RULES else tau_source(o.source)  # block: chains only
        considered[(o.name, o.rule)] = choose_tree(source, o.costs, max_nodes=max_nodes)[0]
    (name, rule), best = max(considered.items(), key=lambda item: item[1].speedup)
    if best.speedup <= 1.0:  # the empty tree is 1.0 exactly: nothing pays
        vanilla = options[0].costs.vanilla()
        return Plan(None, Tree.chain(0), "rejection", Prediction(Tree.chain(0), 1.0, vanilla, 1.0, vanilla),
                    considered)
    return Plan(name, best.tree, rule, best, considered)


def plan_across(target, input_ids, drafters: Mapping[str, tuple], *, acceptance: str | list[str] = "rejection",
                max_nodes: int = 64, **options) -> Plan:
    """The best of ``drafters`` ({name: (Drafter, DrafterProfile)}) for decoding ``input_ids`` on ``target`` with
    generate()'s other ``options`` (max_new_tokens, temperature, ...), under ``acceptance`` (one rule, or a list to
    choose among), or no speculation (``Plan.name`` None). Each profile needs this device's cost model
    (``heads.load_profile(source, target)``, ``planning.model_free.model_free_profile``); a chain τ its sampled
    candidates lack at this sampling is measured now, on the first prompt, where the profile can."""
    if not isinstance(drafters, Mapping):
        raise ValueError(f"drafters must be {{name: (drafter, profile)}}, got {type(drafters).__name__}")
    if not drafters:
        raise ValueError("'auto' across drafters needs at least one drafter to weigh against no speculation, got an "
                         "empty mapping")
    rules = [acceptance] if isinstance(acceptance, str) else list(acceptance)
    if not rules:
        raise ValueError("acceptance: an empty list (give a rule, or rules to choose among)")
    if "tree" in options:  # it was dropped unsaid
        raise ValueError("plan_across chooses the tree (its Plan.tree): leave tree= out")
    choices, made = [], {}
    for name, pair in drafters.items():
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise ValueError(f"drafters[{name!r}] must be a (drafter, profile) pair, got {pair!r}")
        drafter, profile = pair
        if not isinstance(drafter, Drafter):  # None once gave a plan naming a drafter it could not decode with
            raise ValueError(f"drafters[{name!r}] must pair a treespec Drafter with its profile, got "
                             f"{type(drafter).__name__}")
        if not isinstance(profile, DrafterProfile) or profile.costs is None:
            raise ValueError(f"drafters[{name!r}]: its profile needs this device's cost model (a DrafterProfile with "
                             "costs): treespec.heads.load_profile(source, target) for a trained drafter, "
                             "treespec.planning.model_free.model_free_profile(target, drafter, prompts) for a "
                             f"model-free one; got {type(profile).__name__}"
                             + (" without costs" if isinstance(profile, DrafterProfile) else ""))
        made[name] = drafter
        for rule in rules:
            arguments = loop_arguments(target, input_ids, drafter=drafter, acceptance=rule, **options)
            del arguments["tree"]
            checked = check_arguments(**arguments)
            try:
                source = profile.tau_source("auto", getattr(drafter, "candidates", "topk"), rule, checked.sampling,
                                            drafter, checked.first_prompt)
            except ValueError as err:
                raise ValueError(f"drafters[{name!r}]: {err}") from None
            choices.append(Option(name, source, profile.costs, rule))
    plan = choose_across(choices, max_nodes=max_nodes)
    plan.drafter = made.get(plan.name)
    return plan
