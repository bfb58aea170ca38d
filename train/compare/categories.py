"""The comparison's results by workload category (train/compare/report.py renders them; train/compare/plots.py draws
them).

Spec-Bench reports drafters per category (multi-turn conversation, translation, summarization, QA, math,
RAG) because acceptance differs by a factor of two between categories for the same drafter, and a tree
chosen on one category is wrong for another. From results.json alone (each prompt's category in
``prompt_info``, each run's prompt in ``prompt_of_run``):

- ``category_table``: each drafter's best configuration (and each transformers peer): speedup and τ per
  category with bootstrap intervals over that category's prompts, and overall;
- ``best_per_category``: each drafter's best configuration within each category;
- ``acceptance_by_position``: τ of each drafter's best configuration by the context length a verification
  pass sees and by its position within the generation (bins of powers of two).

A results.json from before categories (no ``prompt_info``) has none of these: the functions return None.
"""

from __future__ import annotations

import math
from pathlib import Path

from treespec.train.compare.auto_across import drafter_of
from treespec.train.compare.stats import Estimate, groups_of, median_interval, tau_interval
from treespec.train.compare.tables import DASH, md_table, with_interval


def run_categories(result: dict) -> list[str] | None:
    """The category of every measured prompt run, in results.json's run order; None for an old run."""
    info = result.get("prompt_info")
    order = result.get("prompt_of_run")
    if not info or order is None:
        return None
    done = result.get("prompts_done", len(order))
    return [info[p]["category"] for p in order[:done]]


def categories_of(result: dict) -> list[str] | None:
    """The run's categories in the order the prompts came (categories sorted by the workload)."""
    cats = run_categories(result)
    return list(dict.fromkeys(cats)) if cats else None


def _subset(values: list, cats: list[str], order: list[int], category: str) -> tuple[list, list[int]]:
    keep = [i for i, c in enumerate(cats) if c == category]
    return [values[i] for i in keep], [order[i] for i in keep]


def _kw(a: dict) -> dict:
    b = a["bootstrap"]
    return {"samples": b["samples"], "level": b["level"], "seed": b["seed"]}


def category_estimates(result: dict, a: dict, runs: dict, category: str) -> dict[str, Estimate]:
    """{"speedup", "tau" (when the runs have accept lengths), "prompts"} of one configuration's ``runs`` over
    the runs of ``category``."""
    cats, order = run_categories(result), result["prompt_of_run"]
    n = len(runs["speedup"])
    cats, order = cats[:n], order[:n]
    speedups, prompts = _subset(runs["speedup"], cats, order, category)
    out = {"speedup": median_interval(groups_of(speedups, prompts), **_kw(a)), "prompts": len(set(prompts))}
    if runs.get("accept_lengths"):
        lengths, prompts = _subset(runs["accept_lengths"], cats, order, category)
        out["tau"] = tau_interval(groups_of(lengths, prompts), **_kw(a))
    return out


def category_table(result: dict, a: dict) -> dict | None:
    """{"categories": [...], "prompts": {category: n}, "rows": [{"name", "config", "tree", "kind", "cells":
    {category: estimates}, "overall": estimates}]}: each drafter's best configuration, then each peer."""
    cats = categories_of(result)
    if not cats:
        return None
    rows = []
    for drafter, c in a["bests"].items():
        runs = c.get("runs")
        if not runs or not runs.get("speedup"):
            continue
        rows.append({"name": drafter, "config": c["config"], "tree": c.get("shown", c["tree"]), "kind": "drafter",
                     "cells": {cat: category_estimates(result, a, runs, cat) for cat in cats},
                     "overall": {"speedup": c["speedup_est"], "tau": c["tau_est"]}})
    for p in a["peers"]:
        runs = next((q.get("runs") for q in result.get("peers") or [] if q["name"] == p["name"]), None)
        if runs and runs.get("speedup"):
            lengths = runs.get("accept_lengths")  # per target call (train/compare/target_calls.py)
            tau = tau_interval(groups_of(lengths, result["prompt_of_run"][:len(lengths)]), **_kw(a)) if lengths \
                else None
            rows.append({"name": p["name"], "config": p["name"], "tree": "–", "kind": "peer",
                         "cells": {cat: category_estimates(result, a, runs, cat) for cat in cats},
                         "overall": {"speedup": p["speedup_est"], "tau": tau}})
    prompts = {cat: len({p for p, c in zip(result["prompt_of_run"], run_categories(result), strict=False)
                         if c == cat}) for cat in cats}
    return {"categories": cats, "prompts": prompts, "rows": rows}


def best_per_category(result: dict, a: dict) -> dict[str, dict[str, dict]] | None:
    """{drafter: {category: {"config", "tree", "tree_file", "speedup" (Estimate)}}}: the configuration with the
    highest median speedup over the category's prompts, among every configuration of that drafter."""
    cats = categories_of(result)
    if not cats:
        return None
    out: dict[str, dict[str, dict]] = {}
    for c in a["configs"].values():
        runs = c.get("runs")
        if c["config"] == "vanilla" or not runs or not runs.get("speedup"):
            continue
        for cat in cats:
            e = category_estimates(result, a, {"speedup": runs["speedup"]}, cat)["speedup"]
            at = out.setdefault(c["drafter"], {})
            if not math.isnan(e.value) and (cat not in at or e.value > at[cat]["speedup"].value):
                at[cat] = {"config": c["config"], "tree": c.get("shown", c["tree"]), "tree_file": c.get("tree_file"),
                           "speedup": e}
    return out


def _bin(x: int) -> int:
    """The power-of-two bin holding ``x`` >= 1: its lower edge."""
    return 1 << (max(1, int(x)).bit_length() - 1)


def acceptance_by_position(result: dict, a: dict) -> dict[str, dict[str, list[dict]]]:
    """{drafter: {"position": [...], "context": [...]}} for each drafter's best configuration, each a list of
    {"lo", "hi", "tau", "passes"} over power-of-two bins: by the tokens generated before a pass (its position
    within the generation) and by the context it verifies after (prompt + generated; needs ``prompt_info``)."""
    info = result.get("prompt_info")
    order = result.get("prompt_of_run") or []
    out = {}
    for drafter, c in a["bests"].items():
        runs = (c.get("runs") or {}).get("accept_lengths") or []
        by = {"position": {}, "context": {}}
        for i, lengths in enumerate(runs):
            prompt_tokens = info[order[i]]["prompt_tokens"] if info and i < len(order) else None
            generated = 1  # the prefill commits the first token
            for n in lengths:
                keys = [("position", generated)] + ([("context", prompt_tokens + generated)] if prompt_tokens else [])
                for what, x in keys:
                    s = by[what].setdefault(_bin(x), [0, 0])
                    s[0], s[1] = s[0] + n, s[1] + 1
                generated += n
        out[drafter] = {what: [{"lo": lo, "hi": 2 * lo - 1, "tau": s[0] / s[1], "passes": s[1]}
                               for lo, s in sorted(bins.items())] for what, bins in by.items()}
    return out


def category_rows(result: dict, a: dict) -> list[dict]:
    """The by-category table as numbers, one row per (drafter or peer, category) with a category column:
    the wandb table and by_category.csv."""
    table = category_table(result, a)
    if table is None:
        return []
    out = []
    for row in table["rows"]:
        for cat, cell in [*row["cells"].items(), ("overall", row["overall"])]:
            rec = {"name": row["name"], "config": row["config"], "category": cat,
                   "prompts": cell.get("prompts", len(result.get("prompt_info") or []))}
            for key in ("speedup", "tau"):
                e = cell.get(key) or Estimate(math.nan)
                rec.update({key: e.value, f"{key}_lo": e.lo, f"{key}_hi": e.hi})
            out.append(rec)
    return out


def run_rows(result: dict) -> list[dict]:
    """Every prompt run of every configuration with its prompt's id and category (the wandb table)."""
    info, order = result.get("prompt_info"), result.get("prompt_of_run")
    if not info or order is None:
        return []
    out = []
    for rec in result["records"]:
        runs = rec.get("runs") or {}
        for i, speedup in enumerate(runs.get("speedup") or []):
            prompt = info[order[i]]
            lengths = runs["accept_lengths"][i]
            out.append({"config": rec["config"], "drafter": rec["drafter"], "prompt": prompt["id"],
                        "category": prompt["category"], "turn": prompt["turn"],
                        "prompt_tokens": prompt["prompt_tokens"], "tokens_per_s": runs["tokens_per_s"][i],
                        "speedup": speedup,
                        "tau": sum(lengths) / len(lengths) if lengths else None})
    return out


# -- markdown (train/compare/report.py puts these sections into results.md) -------------------------------------
def category_markdown(result: dict, a: dict) -> list[str]:
    """The "By category" section: Spec-Bench's table (a speedup and a τ column per category, then overall),
    each drafter's best tree per category, and where the accuracies came from."""
    table = category_table(result, a)
    if table is None:
        return ["## By category", "", "This run predates workload categories (its results.json has no "
                "prompt_info): every prompt counts as one set."]
    cats, level = table["categories"], f"{100 * a['bootstrap']['level']:g}%"
    header = ["drafter (best overall)", "tree"] + [h for c in cats for h in (f"{c} speedup", f"{c} τ")] + \
        [f"overall speedup ({level} CI)", "overall τ"]
    rows = [[r["name"], r["tree"]] + [x for c in cats for x in (with_interval(r["cells"][c]["speedup"], suffix="×"),
                                                                   with_interval(r["cells"][c].get("tau")))]
            + [with_interval(r["overall"]["speedup"], suffix="×"), with_interval(r["overall"].get("tau"))]
            for r in table["rows"]]
    lines = ["## By category", ""] + md_table(header, rows)
    counts = ", ".join(f"{c}: {table['prompts'][c]}" for c in cats)
    lines += ["", f"Prompts per category: {counts}. Each cell: the median over the category's prompts with a "
              f"bootstrap {level} interval over them (one prompt: no interval); a transformers peer's τ counts every "
              "target call of it, the prefill included (older runs: none). Each drafter's row is its best "
              "configuration over all prompts; the table below picks per category."]
    best = best_per_category(result, a) or {}
    if best:
        lines += ["", "### Each drafter's best tree per category", ""]
        lines += md_table(["drafter"] + cats, [[d] + [f"{at[c]['tree']}: {with_interval(at[c]['speedup'], suffix='×')}"
                                                      if c in at else DASH for c in cats] for d, at in best.items()])
    held = (result.get("settings") or {}).get("held_out")
    if held:
        lines += ["", f"Accuracies (accuracy and auto trees, predictions) were measured on {held}."]
    return lines


def shown_path(path) -> Path:
    """``path`` as a report prints it: relative to the current directory (where the run was started) when it
    lies under it, so no report names the folders of the machine it ran on; as given otherwise."""
    path = Path(path)
    if not path.is_absolute():
        return path
    try:
        return path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:  # elsewhere: the only way to name it
        return path


def usage_lines(result: dict, a: dict, folder=None) -> list[str]:
    """How to decode with the run's best tree elsewhere: ``folder``/best_tree.json and its drafter."""
    best = a.get("best")
    if not best or not best.get("tree_spec"):
        return []
    entry = (result.get("drafter_entries") or {}).get(drafter_of(best)) or {}
    stop = (result.get("settings") or {}).get("end_token_ids")
    return (["## Use the best tree", "", f"The run's best configuration, {best['config']}, saved its tree as "
            "`best_tree.json` beside this file (every configuration's tree is under `trees/`):", "", "```python",
            "from treespec import Tree, generate", "from treespec.heads import registry"
            + (", Combined" if entry.get("parts") else "")]
            + (["from treespec.heads.drafting.vocab import DraftVocab"] if reduces_vocab(entry) else [])
            + (["from treespec.planning.tree_spec import build_tree"] if entry.get("part_trees") else []) + ["",
            f"drafter = {make_line({'name': drafter_of(best), **entry}, folder)}",
            f'tree = Tree.load("{(shown_path(folder or ".") / "best_tree.json").as_posix()}")',
            "out = generate(target, input_ids, drafter=drafter, tree=tree, max_new_tokens=256"
            + (f", eos_token_id={stop})" if stop else ")"), "```"] + auto_lines(result, folder))


def reduces_vocab(entry: dict) -> bool:
    """Whether a run's drafter entry (or a part of it) drafts over an FR-Spec vocabulary the run kept."""
    return bool(entry.get("draft_vocab_file")) or any(reduces_vocab(part) for part in entry.get("parts") or [])


def make_line(entry: dict, folder=None) -> str:
    """The Python expression that makes a run's drafter from its entry (a combination: ``Combined`` of its parts);
    ``folder``: the run's, whose kept FR-Spec vocabulary an entry with ``draft_vocab`` loads."""
    if entry.get("parts"):
        settings = "".join(f", {key}={entry[key]!r}" for key in ("mode", "nodes", "min_nodes")
                           if entry.get(key) is not None)
        if entry.get("part_trees") is not None:  # specs → trees (treespec.planning.tree_spec.build_tree)
            trees = ", ".join("None" if spec is None else f"build_tree({spec!r})" for spec in entry["part_trees"])
            settings += f", part_trees=[{trees}]"
        return f"Combined([{', '.join(make_line(part, folder) for part in entry['parts'])}]{settings})"
    own = f", settings={entry['settings']!r}" if entry.get("settings") else ""  # prompt lookup's n-gram sizes
    if entry.get("draft_vocab_file"):  # FR-Spec: the vocabulary the run drafted with, as it kept it
        vocab = (shown_path(folder or ".") / entry["draft_vocab_file"]).as_posix()
        source = f', "{entry["source"]}"' if entry.get("source") else ""
        return (f'registry.make("{entry["name"]}", registry.load_module("{entry["name"]}", target{source}), '
                f'"{entry.get("candidates", "topk")}", DraftVocab.load("{vocab}"){own})')
    if not entry.get("source"):
        return f'registry.build("{entry["name"]}", target{own})'
    sampled = f', candidates="{entry["candidates"]}"' if entry.get("candidates", "topk") != "topk" else ""
    return f'registry.build("{entry["name"]}", target, source="{entry["source"]}"{sampled}{own})'


def auto_lines(result: dict, folder=None) -> list[str]:
    """How generate()'s tree=auto chooses the tree this run's auto chose: with the drafter's profile folder."""
    chosen = {r["drafter"]: r for r in result["records"] if r.get("tree") == "auto" and r.get("tree_spec")}
    profiles = {d: p for d, p in (result.get("profiles") or {}).items() if d in chosen}
    if not profiles:
        return []
    drafter, path = next(iter(profiles.items()))
    return ["", "`tree={\"kind\": \"auto\"}` chooses the same trees in `generate()` from this run's measurements (its "
            "cost model and accuracies, kept under `profiles/`): " + "; ".join(
                f"{d}'s auto: {chosen[d]['nodes']} nodes, depth {chosen[d]['depth']}" for d in profiles) + ".", "",
            "```python", "from treespec.heads import load_profile", "",
            f'profile = load_profile("{(shown_path(folder or ".") / path).as_posix()}")',
            'out = generate(target, input_ids, drafter=drafter, tree={"kind": "auto"}, profile=profile, ...)',
            "out.tree  # the tree auto chose", "```"]
