"""The comparison's analysis, from results.json's contents (train/compare/report.py renders it; side_by_side.py,
serving.py and train/checks/interop_serving.py read it): per configuration the median speedup (per-prompt ratios
to vanilla) and τ, each with a bootstrap interval over prompts (train/compare/stats.py); each drafter's best; the
run's best and the verdict on every other configuration (a speedup interval that overlaps the best one's is
"indistinguishable from the best in this run"); the peers' ratios; each configuration's shown label; and how far
apart vanilla's speed lay over alike prompt runs (a busy machine). Deterministic (seeded) given results.json.
"""

from __future__ import annotations

import math

from treespec.planning.tree_spec import build_tree
from treespec.train.compare.plots import partial
from treespec.train.compare.stats import Estimate, groups_of, median_interval, tau_interval
from treespec.train.compare.tables import missing

BOOTSTRAP = {"samples": 2000, "level": 0.95, "seed": 0}


def analyse(result: dict) -> dict:
    """Point estimates and bootstrap intervals for every configuration, each drafter's best, the run's best
    and who is indistinguishable from it, the peers' ratios. Deterministic (seeded) given results.json."""
    settings = result.get("settings", {})
    boot = {**BOOTSTRAP, **(settings.get("bootstrap") or {})}
    kw = {"samples": boot["samples"], "level": boot["level"], "seed": boot["seed"]}
    prompt_of_run = result.get("prompt_of_run")
    done = partial(result)
    if done and prompt_of_run is not None:  # a run that stopped early: its runs cover the first prompts only
        prompt_of_run = prompt_of_run[: done[0]]
    configs = {}
    for rec in result["records"]:
        runs = rec.get("runs")
        point = {k: Estimate(math.nan if missing(rec.get(k)) else rec[k]) for k in ("speedup", "tau")}
        if runs and runs.get("speedup"):
            speedup = median_interval(groups_of(runs["speedup"], prompt_of_run), **kw)
            if rec["config"] == "vanilla":  # the baseline: 1 by definition, nothing to resample
                speedup, tau = Estimate(1.0), Estimate(1.0)
            else:
                tau = tau_interval(groups_of(runs["accept_lengths"], prompt_of_run), **kw) \
                    if runs.get("accept_lengths") else point["tau"]
        else:  # a results.json from before per-prompt values were kept: points only
            speedup, tau = point["speedup"], point["tau"]
        configs[rec["config"]] = {**rec, "speedup_est": speedup, "tau_est": tau}
    measured = [c for c in configs.values() if c["config"] != "vanilla"]
    label_variants(result, configs.values(), measured)
    ranked = [c for c in measured if not math.isnan(c["speedup_est"].value)]  # a configuration without one: –
    best = max(ranked, key=lambda c: c["speedup_est"].value) if ranked else None
    for c in measured:
        if c is best:
            c["verdict"] = "best"
        elif best is None or not (c["speedup_est"].has_interval and best["speedup_est"].has_interval):
            c["verdict"] = None  # points only (one prompt, or an old results.json): no call either way
        else:
            c["verdict"] = "indistinguishable" if c["speedup_est"].overlaps(best["speedup_est"]) else "below"
    bests: dict[str, dict] = {}
    speed = lambda c: -math.inf if math.isnan(c["speedup_est"].value) else c["speedup_est"].value
    for c in measured:
        if c["drafter"] not in bests or speed(c) > speed(bests[c["drafter"]]):
            bests[c["drafter"]] = c
    peers = []
    peer_pass = result.get("peer_pass") or {}
    for p in result.get("peers") or []:
        if p["name"] in configs:  # an old results.json listed treespec's vanilla and best among the peers
            continue
        entry = {"name": p["name"], "tokens_per_s": p["tokens_per_s"], "ratios": {}}
        runs = p.get("runs")
        entry["speedup_est"] = median_interval(groups_of(runs["speedup"], prompt_of_run), **kw) if runs else \
            Estimate(p["speedup_vs_vanilla"])
        for drafter, c in bests.items():
            mine = peer_pass.get(c["config"])
            if mine and runs:
                ratios = [a / b for a, b in zip(mine["tokens_per_s"], runs["tokens_per_s"], strict=True)]
                entry["ratios"][drafter] = median_interval(groups_of(ratios, prompt_of_run), **kw)
            elif c is best and p.get("treespec_best_over_this") is not None:
                entry["ratios"][drafter] = Estimate(p["treespec_best_over_this"])
        peers.append(entry)
    return {"configs": configs, "best": best, "bests": bests, "peers": peers, "bootstrap": boot,
            "settings": settings}


def label_variants(result: dict, configs, measured) -> None:
    """Each configuration's ``shown`` tree: its tree, then its acceptance rule and its drafter's candidates
    whenever the run compares more than one of either, so no two rows of a table read alike."""
    entries = result.get("drafter_entries") or {}
    candidates_of = lambda c: (entries.get(c["drafter"]) or {}).get("candidates") or "topk"
    rules = {c.get("acceptance") or "rejection" for c in measured}
    modes = {candidates_of(c) for c in measured}
    for c in configs:
        parts = [chosen(c)]
        if c["config"] != "vanilla" and len(rules) > 1:
            parts.append(c.get("acceptance") or "rejection")
        if c["config"] != "vanilla" and len(modes) > 1:
            parts.append(f"{candidates_of(c)} candidates")
        c["shown"] = ", ".join(parts)


def chosen(c: dict) -> str:
    """A configuration's tree label; an ``auto`` one says what it chose: "auto → chain γ=4", "auto → 12 nodes,
    depth 5", "auto → dynamic 16/8/4", "auto → none" (no drafting); across drafters, which drafter too: "auto →
    eagle, chain γ=4", "auto → vanilla"."""
    across = c.get("chose")
    if across:
        return "auto → vanilla" if across["drafter"] == "vanilla" else f"auto → {across['drafter']}, {across['tree']}"
    spec = c.get("tree_spec")
    if c.get("tree") != "auto" or not isinstance(spec, dict) or spec.get("kind") not in ("paths", "chain", "dynamic"):
        return c["tree"]
    if spec["kind"] == "dynamic":  # a model-free drafter's own budget, chosen from its dry run
        return f"auto → dynamic {spec['total_tokens']}/{spec['depth']}/{spec['top_k']}"
    tree = build_tree(spec)
    if not len(tree):
        return "auto → none"
    return "auto → " + (f"chain γ={tree.depth}" if tree.is_chain else f"{len(tree)} nodes, depth {tree.depth}")


def vanilla_spread(result: dict, a: dict) -> dict | None:
    """How far apart vanilla's tokens/s lie over prompt runs that are alike: {"lo", "median", "hi", "budget",
    "runs", "left_out"} for the budget whose runs lie furthest apart, or None (fewer than two alike runs).

    Alike: runs that generated their whole budget, compared within a budget. A run that stopped early (an end
    token) pays the prefill and the first steps over fewer tokens, so its tokens/s is lower on an idle machine
    too; runs of different budgets share their prefill over different numbers of tokens. What is left (prompts
    differ a little in length) moves tokens/s a little, a busy machine a lot."""
    runs = (a["configs"].get("vanilla", {}).get("runs") or {})
    speeds, lengths = runs.get("tokens_per_s") or [], runs.get("accept_lengths") or []
    info, order = result.get("prompt_info"), result.get("prompt_of_run") or []
    default = (result.get("settings") or {}).get("max_new_tokens")
    groups: dict = {}
    left_out = 0
    for i, speed in enumerate(speeds):
        if missing(speed) or speed <= 0:
            continue
        budget = (info[order[i]].get("max_new_tokens") if info and i < len(order) else None) or default
        if budget is not None and i < len(lengths) and lengths[i] is not None and 1 + sum(lengths[i]) < budget:
            left_out += 1  # the prefill commits one token, each vanilla pass one more
            continue
        groups.setdefault(budget, []).append(speed)
    spreads = [{"lo": min(v), "median": sorted(v)[len(v) // 2], "hi": max(v), "budget": b, "runs": len(v)}
               for b, v in groups.items() if len(v) >= 2]
    if not spreads:
        return None
    return {**max(spreads, key=lambda g: g["hi"] / g["lo"]), "left_out": left_out}
