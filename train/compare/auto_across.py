""""auto" across drafters in a comparison: the tree entry ``{kind: auto, drafters: [eagle, prompt_lookup]}`` is one
configuration, whose drafter, tree and rule are chosen before the first timed run (treespec/planning/across.py's
``choose_across``) from what the setup measured: each listed drafter's τ source under each of the run's rules
(accuracies, chain τ, or its dry run's τ per tree) and its cost model. When none is predicted above vanilla, it
chooses no speculation.

It is measured as what it chose: under the name of a configuration the run measures anyway when it chose that one's
tree (measured once, reported under both), as vanilla when it chose no speculation, else as a configuration of its
own. Its record's ``drafter`` is its label (``auto across eagle, prompt_lookup``), so the report lists it as a row of
its own beside each drafter's best, per category too; ``chose`` says what it chose
(train/compare/auto_across_report.py).
"""

from __future__ import annotations

from omegaconf import OmegaConf

from treespec.planning.across import Option, choose_across
from treespec.planning.autotree import Prediction
from treespec.planning.tree_spec import check_tree_spec, tree_to_spec
from treespec.train.compare.configurations import ACROSS_KEY, expand_specs, spec_label, tree_file
from treespec.train.compare.dry_runs import tree_label
from treespec.tree import Tree

VANILLA = "vanilla"


def across_specs(specs) -> list[dict]:
    """The run's tree entries that choose across drafters."""
    return [s for s in specs if ACROSS_KEY in s]


def per_drafter(specs) -> list[dict]:
    """The run's tree entries each drafter verifies."""
    return [s for s in specs if ACROSS_KEY not in s]


def label(spec: dict) -> str:
    """The configuration's name and its record's ``drafter``."""
    return f"auto across {', '.join(spec[ACROSS_KEY])}"


def drafter_of(c: dict) -> str:
    """The drafter a configuration (a results.json record) decodes with: an "auto" across drafters', the one it chose
    ("vanilla": none)."""
    return (c.get("chose") or {}).get("drafter") or c["drafter"]


def check_across(spec, drafters: list[str]) -> None:
    """A ValueError naming what is wrong with an "auto" across drafters entry: its kind, its list (empty, not of
    names, a name twice, a name that is not one of the run's ``drafters``), its other keys."""
    spec = OmegaConf.to_container(spec, resolve=True) if OmegaConf.is_config(spec) else dict(spec)
    names = spec[ACROSS_KEY]
    where = f"trees: {spec}"
    if spec.get("kind") != "auto":
        raise ValueError(f"{where}: '{ACROSS_KEY}' chooses across drafters, which only kind 'auto' does")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{where}: '{ACROSS_KEY}' must be a list of the run's drafters, got {names!r}")
    if not names:
        raise ValueError(f"{where}: '{ACROSS_KEY}' is an empty list: name the drafters to choose among (one or more of "
                         f"{', '.join(drafters)})")
    unknown = [n for n in names if n not in drafters]
    if unknown:
        raise ValueError(f"{where}: {', '.join(map(repr, unknown))} is not one of this run's drafters "
                         f"({', '.join(drafters)}): add it to drafters=[...] or leave it out of '{ACROSS_KEY}'")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{where}: {', '.join(twice)} named twice")
    check_tree_spec({k: v for k, v in spec.items() if k != ACROSS_KEY})


def check_distinct(specs, drafters: list[str]) -> None:
    """Drafters named once, and tree entries that are different configurations: two alike once failed deep in the
    timing (a zip of unequal lengths), and two "auto" with different max_nodes were reported under one name."""
    twice = sorted({n for n in drafters if drafters.count(n) > 1})
    if twice:
        raise ValueError(f"drafters: {', '.join(twice)} named twice: give each drafter once")
    seen = {}
    for spec in expand_specs(specs):
        name = label(spec) if ACROSS_KEY in spec else spec_label(spec)
        if name in seen:
            raise ValueError(f"trees: {seen[name]} and {spec} are both configuration '{name}': give each tree once"
                             + (" (one 'auto' per run: compare other max_nodes in a run of their own)"
                                if spec.get("kind") == "auto" else ""))
        seen[name] = spec


def options(spec: dict, drafters: list, costs: dict, rules: list[str]) -> list[Option]:
    """Each listed drafter under each rule that something predicts it under."""
    by_name = {d.name: d for d in drafters}
    return [Option(name, by_name[name].tau_source(rule), costs[name], rule) for name in spec[ACROSS_KEY]
            for rule in rules if by_name[name].tau_source(rule) is not None]


def chosen_trees(specs: list[dict], drafters: list, costs: dict, rules: list[str], max_nodes: int) -> list:
    """[((DrafterSpec, spec, rule), tree)] of what each across entry chooses now: its tree's sizes are timed on the
    curve with the run's own (setup_costs.measure_tree_sizes)."""
    by_name, out = {d.name: d for d in drafters}, []
    for spec in specs:
        found = options(spec, drafters, costs, rules)
        if found:
            plan = choose_across(found, max_nodes=spec.get("max_nodes", max_nodes))
            if plan.name is not None:
                out.append(((by_name[plan.name], spec, plan.acceptance), plan.tree))
    return out


def plan_across_run(spec: dict, drafters: list, costs: dict, rules: list[str], max_nodes: int, configs: list,
                    meta: dict) -> tuple[dict, dict]:
    """(the planned configuration, its report fields with its per-step ``prediction``) of an across entry, given the
    configurations planned so far (``configs``, their ``meta``), whose measurement it shares when it chose one's
    tree."""
    name = label(spec)
    found = options(spec, drafters, costs, rules)
    plan = choose_across(found, max_nodes=spec.get("max_nodes", max_nodes)) if found else None
    considered = {f"{n} | {r}": p.speedup for (n, r), p in plan.considered.items()} if plan else {}
    if plan is None or plan.name is None:
        vanilla = next(iter(costs.values())).vanilla()
        why = "none of them is predicted to beat vanilla decoding" if plan else "none of them is predicted"
        fields = {"drafter": name, "tree": "auto", "nodes": 0, "depth": 0, "acceptance": "rejection",
                  "tree_spec": tree_to_spec(Tree.chain(0)), "tree_file": tree_file(name), "same_tree_as": VANILLA,
                  "chose": {"drafter": VANILLA, "tree": VANILLA, "rule": None, "why": why}, "considered": considered,
                  "prediction": Prediction(Tree.chain(0), 1.0, vanilla, 1.0, vanilla)}
        return {"name": name, "drafter": None, "rule": "rejection", "tree_spec": fields["tree_spec"],
                "same_as": VANILLA}, fields
    tree_spec = tree_to_spec(plan.tree)
    same = next((c["same_as"] or c["name"] for c in configs if c["drafter"] == plan.name
                 and c["rule"] == plan.acceptance and c["tree_spec"] == tree_spec), None)
    chose = {"drafter": plan.name, "tree": tree_label(plan.tree), "rule": plan.acceptance,
             "why": f"predicted {plan.prediction.speedup:.2f}× a step, the highest of {len(considered)}"}
    fields = {"drafter": name, "tree": "auto", "nodes": len(plan.tree), "depth": plan.tree.depth,
              "acceptance": plan.acceptance, "tree_spec": tree_spec, "tree_file": tree_file(name), "chose": chose,
              "considered": considered, "prediction": plan.prediction, **({"same_tree_as": same} if same else {})}
    return {"name": name, "drafter": plan.name, "rule": plan.acceptance, "tree_spec": tree_spec, "same_as": same}, \
        fields

