"""What a comparison measures before its first run (the journal's ``setup``; train/compare/harness.py runs it): the
target's cost curve and prefill curve, each drafter's curve timed after its drafting calls (at the sizes its trees
verify too), the engine's cost per step, and every drafter × tree × rule resolved into the tree it verifies, with
its prediction.
"""

from __future__ import annotations

import statistics

from treespec.planning.autotree import (
    cost_at,
    measure_cost_curve,
    measure_prefill_curve,
    predict,
    predict_generation,
    tau_source,
)
from treespec.planning.engine_cost import measure_engine_cost
from treespec.planning.tree_spec import tree_to_spec
from treespec.planning.uncertainty import prediction_interval, spread_pairs
from treespec.train.compare.auto_across import across_specs, chosen_trees, per_drafter, plan_across_run
from treespec.train.compare.configurations import DrafterSpec, expand_specs, resolve_tree, spec_label, tree_file
from treespec.tree import Tree

MEASURED_SHARE = 0.05  # a size a measured tree's passes verified at least this often is timed on the curve too


def measure_setup(target, drafters: list[DrafterSpec], tree_specs: list[dict], rules: list[str],
                  prompt_info: list[dict], cost_sizes, context: int, max_nodes: int, log=print) -> dict:
    """What is measured before the first run (the journal's ``setup``): the target's cost curve and prefill
    curve, each drafter's curve, and every drafter × tree × rule resolved to the tree it verifies, with its
    prediction ({name, drafter, rule, tree_spec, same_as} under ``configs``, their report fields under ``meta``),
    or why not (``skipped``). A configuration whose tree equals an earlier one's of the same drafter and rule
    (``auto`` or ``accuracy 4`` resolving to ``chain γ=4``) would measure the same generations again: it is
    measured once and reported under both names (``same_as``)."""
    log(f"cost curve: target forward over N tree tokens after {context} cached ones (the prompts' median context), "
        f"N in {list(cost_sizes)}")
    spreads: dict = {}  # each size's rounds' spread: what a prediction's interval comes from (planning/uncertainty.py)
    curve = measure_cost_curve(target, cost_sizes, past_len=context, spread=spreads)
    log("  " + ", ".join(f"N={n}: {1e3 * t:.1f} ms" for n, t in curve.items()))
    lengths = sorted(p["prompt_tokens"] for p in prompt_info)
    prefill = measure_prefill_curve(target, {lengths[0], lengths[len(lengths) // 2], lengths[-1]})
    log("prefill: " + ", ".join(f"{n} tokens: {1e3 * t:.1f} ms" for n, t in prefill.items()))
    # each drafter's own curve, every forward timed right after one of its drafting calls as in decoding (its
    # weights push the target's out of the caches: ~10 % slower on a CPU); predictions and "auto" use it
    curves, baseline = {}, cost_at(curve, 1)  # vanilla's pass: the target alone
    for d in drafters:  # drafting measured in the loop as fractions of a pass (treespec/planning/drafting_cost.py)
        if d.drafting_cost is not None and d.drafting_cost.target_pass > 0:
            fixed, per_depth, per_node = d.drafting_seconds(baseline)
            log(f"drafting cost of {d.name} on this curve: {1e3 * fixed:.2f} ms per step + {1e3 * per_depth:.2f} ms "
                f"per depth + {1e3 * per_node:.3f} ms per node ({d.drafting_cost.per_depth:.2f} of a pass per depth)")
    after: dict = {}
    for d in drafters:
        if d.drafting_step is not None:
            curves[d.name] = measure_cost_curve(target, cost_sizes, past_len=context, before=d.drafting_step(),
                                                spread=after.setdefault(d.name, {}))
            d.drafter.reset()
            log(f"  after {d.name}'s drafting: " + ", ".join(f"N={n}: {1e3 * t:.1f} ms" for n, t in
                                                           curves[d.name].items()))
    # the loop's own work around each pass (walk, compaction, masks, Python), timed in the loop at this context
    engine_bounds: dict = {}
    engine = measure_engine_cost(target, past_len=context, bounds=engine_bounds, log=log)
    bounds = {d.name: {"curve": spread_pairs(after.get(d.name) or spreads),
                       "baseline": [spreads[1].lo, spreads[1].hi] if 1 in spreads else None, **engine_bounds}
              for d in drafters} if spreads else {}
    log(f"engine, beyond the curve's pass: {1e3 * engine.vanilla:.2f} ms per vanilla step, {1e3 * engine.fixed:.2f} ms "
        f"+ {1e3 * engine.per_node:.3f} ms per tree node per speculative step")
    # each drafter's own trees (DrafterSpec.trees, e.g. Spec-Bench's one per method), else the run's
    planned = [(d, spec, rule) for d in drafters for spec in expand_specs(d.trees or per_drafter(tree_specs))
               for rule in rules]
    for _ in range(2):  # the curves at the sizes the trees have; "auto" may choose again on the finer curve
        costs = {d.name: d.cost_model(curves.get(d.name, curve), baseline, engine) for d in drafters}
        resolved = [resolve_tree(spec, d, costs[d.name], max_nodes, rule=rule)[0] for d, spec, rule in planned]
        across = chosen_trees(across_specs(tree_specs), drafters, costs, rules, max_nodes)
        measure_tree_sizes(target, drafters, planned + [p for p, _ in across], resolved + [t for _, t in across],
                           curve, curves, context, log)
    costs = {d.name: d.cost_model(curves.get(d.name, curve), baseline, engine) for d in drafters}
    configs, meta, skipped, seen = [], {}, [], {}
    for d, spec, rule in planned:
        tree, reason = resolve_tree(spec, d, costs[d.name], max_nodes, rule=rule)
        name = f"{d.name} | {spec_label(spec)}" + (f" | {rule}" if len(rules) > 1 else "")
        if tree is not None and rule == "block" and not (isinstance(tree, Tree) and tree.is_chain):
            tree, reason = None, "block verification verifies chains"
        if tree is None:
            log(f"  skip {name}: {reason}")
            skipped.append({"config": name, "drafter": d.name, "tree": spec_label(spec), "reason": reason})
            continue
        same_as = seen.setdefault((d.name, rule, tree), name) if isinstance(tree, Tree) else name
        if same_as != name:
            log(f"  {name}: the tree of {same_as}, measured once for both")
        configs.append({"name": name, "drafter": d.name, "rule": rule, "tree_spec": tree_to_spec(tree),
                        "same_as": same_as if same_as != name else None})
        # sampled candidates: each rule's own closed-form τ on chains (treespec/planning/chain_tau.py); trees not
        # predicted
        source = d.tau_source(rule)
        known = source is not None and tau_source(source).predicts(tree)
        pred = predict(tree, source, costs[d.name]) if known else None
        interval = prediction_interval(tree, source, costs[d.name], bounds.get(d.name)) if known else None
        meta[name] = {"drafter": d.name, "tree": spec_label(spec), "nodes": len(tree),
                      "depth": tree.depth if isinstance(tree, Tree) else spec.get("depth"),
                      **predicted(pred, prompt_info, prefill, interval), "acceptance": rule,
                      "tree_spec": tree_to_spec(tree), "tree_file": tree_file(name),
                      **({"same_tree_as": same_as} if same_as != name else {})}
    meta["vanilla"] = {"drafter": "none", "tree": "vanilla", "nodes": 0, "depth": 0, "predicted_tau": 1.0,
                       "predicted_speedup": 1.0, "predicted_decode_speedup": 1.0}
    for spec in across_specs(tree_specs):  # "auto" across drafters: one configuration, the drafter it chose
        configs.append(across_config(spec, drafters, costs, rules, max_nodes, configs, meta, prompt_info, prefill,
                                     bounds, log))
    return {"cost_curve": curve, "cost_curves_after_drafting": curves, "cost_bounds": bounds, "prefill_curve": prefill,
            "configs": configs, "meta": meta, "skipped": skipped, "engine": engine.record(),
            "cost_models": {name: c.record() for name, c in costs.items()}}


def across_config(spec: dict, drafters: list[DrafterSpec], costs: dict, rules: list[str], max_nodes: int,
                  configs: list, meta: dict, prompt_info: list[dict], prefill: dict, bounds: dict, log=print) -> dict:
    """An "auto" across drafters entry's configuration (the drafter, tree and rule it chose, or vanilla), its
    predicted fields, overall and per category, added to ``meta`` under its name."""
    config, fields = plan_across_run(spec, drafters, costs, rules, max_nodes, configs, meta)
    pred = fields.pop("prediction")
    chosen = next((d for d in drafters if d.name == config["drafter"]), None)  # None: it chose vanilla
    interval = prediction_interval(pred.tree, chosen.tau_source(config["rule"]), costs[chosen.name],
                                   bounds.get(chosen.name)) if chosen else None
    fields.update(predicted(pred, prompt_info, prefill, interval), predicted_by_category={
        cat: predicted(pred, [p for p in prompt_info if p["category"] == cat], prefill)["predicted_speedup"]
        for cat in dict.fromkeys(p["category"] for p in prompt_info)})
    meta[config["name"]] = fields
    log(f"  {config['name']}: {fields['chose']}")
    return config


def predicted(pred, prompt_info: list[dict], prefill: dict, interval=None) -> dict:
    """A configuration's predicted fields (none: None) from its per-step ``pred``: the speedup of whole generations,
    prefill included, each prompt at its own lengths (what a measured speedup is), per step, τ, a step's ms; with an
    ``interval`` (the predictions at the slow and the fast ends of the cost terms' spreads, planning/uncertainty.py),
    the whole generations' speedup at each end too."""
    whole = lambda p: statistics.median(predict_generation(p, i["prompt_tokens"], i["answer_tokens"], prefill)
                                        for i in prompt_info)
    return {"predicted_tau": pred.tau if pred else None, "predicted_speedup": whole(pred) if pred else None,
            "predicted_decode_speedup": pred.speedup if pred else None,
            "predicted_step_ms": 1e3 * pred.step_cost if pred else None,
            **({"predicted_speedup_lo": whole(interval[0]), "predicted_speedup_hi": whole(interval[1])}
               if pred and interval else {})}


def measure_tree_sizes(target, drafters: list[DrafterSpec], planned: list, resolved: list, curve: dict,
                       curves: dict, context: int, log=print) -> None:
    """Add to each drafter's curve (``curves[name]``, timed after its drafting calls, else the target's ``curve``)
    the sizes its resolved trees verify that it lacks. A CPU's pass is not smooth in N: on the code reference a pass
    over 3 tokens took longer than one over 4 or 5 (docs/results.md, "Drafting measured in the loop"), which a
    curve at powers of two interpolates away."""
    by_name = {d.name: d for d in drafters}
    sizes: dict[str, set[int]] = {}
    for (d, _, rule), tree in zip(planned, resolved, strict=True):
        if tree is None or not len(tree):
            continue
        source = d.tau_source(rule)
        # a tree measured by a dry run verifies the sizes its passes met (a share of them at least), another its own
        verified = [n for n, share in source.sizes(tree).items() if share >= MEASURED_SHARE] \
            if callable(getattr(source, "sizes", None)) and source.predicts(tree) else \
            [tree.num_nodes] if isinstance(tree, Tree) else []
        own = curves.get(d.name, curve)
        for n in verified:
            if n not in own:
                sizes.setdefault(d.name if d.name in curves else "", set()).add(n)
    for name, missing in sizes.items():
        step = by_name[name].drafting_step() if name else None
        own = curves[name] if name else curve
        # timed interleaved with the curve's own sizes around them (anchors), and put on the curve's footing by the
        # anchors' median ratio: timed alone, minutes after the curve, they would fall in another spell of a shared
        # machine (docs/results.md, "Drafting measured in the loop")
        anchors = {n for n in own if n <= 2 * max(missing)}
        timed = measure_cost_curve(target, tuple(sorted(missing | anchors)), past_len=context, before=step)
        if name:
            by_name[name].drafter.reset()
        scale = statistics.median(own[n] / timed[n] for n in anchors) if anchors else 1.0
        extra = {n: timed[n] * scale for n in missing}
        merged = dict(sorted({**own, **extra}.items()))  # kept in order of size, as measured ones are
        own.clear()
        own.update(merged)
        log(f"  at the trees' own sizes{f' after {name} drafting' if name else ''}: "
            + ", ".join(f"N={n}: {1e3 * t:.1f} ms" for n, t in sorted(extra.items()))
            + f" (× {scale:.2f}: the curve's own sizes timed beside them)")
