"""Spec-Bench's table (Xia et al. 2024), computed the way Spec-Bench computes it, from results.json alone.

Spec-Bench's ``question.jsonl`` holds MT-bench's 80 two-turn questions in eight categories (writing, roleplay,
reasoning, math, coding, extraction, stem, humanities) and 80 each of translation, summarization, qa,
math_reasoning and rag. Its leaderboard has one row per method and the columns below (``COLUMN_OF`` maps the
file's categories to them); MT-bench's eight categories form its "Multi-turn Conversation" column, and get a
table of their own here.

- **Speedup**: a method's tokens per second over all the runs of a column (Σ tokens ÷ Σ seconds, the prefill
  in the seconds) ÷ vanilla decoding's over the same runs, as Spec-Bench's speed script divides total
  throughputs. Greedy decoding is lossless, so both generate the same tokens and the ratio is vanilla's total
  time ÷ the method's. It weighs each run by its time, where the report's "By category" table takes the
  median of per-prompt ratios (train/compare/categories.py): long generations count for more here.
  "Overall" is the same ratio over every run, with a bootstrap interval over prompts (train/compare/stats.py).
- **#Mean Accepted Tokens**: tokens committed per target pass over every pass of every run, the bonus token
  included (τ). transformers' methods count every target call, their prefill included (assisted generation
  verifies its assistant's first candidates in the prefill; train/compare/target_calls.py).

Methods: each drafter's configuration with the highest overall speedup by this measure (one per drafter when
each has one tree, as in conf/experiment/specbench.yaml), then transformers' methods (assisted generation with
the draft model: Spec-Bench's SpS) against the vanilla runs of their own pass.
"""

from __future__ import annotations

import math

from treespec.train.compare.categories import run_categories
from treespec.train.compare.stats import Estimate, throughput_ratio_interval
from treespec.train.compare.tables import DASH, md_table, num, with_interval

MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
MULTI_TURN = "Multi-turn Conversation"
COLUMNS = (MULTI_TURN, "Translation", "Summarization", "QA", "Math", "RAG")
COLUMN_OF = {**dict.fromkeys(MT_BENCH, MULTI_TURN), "translation": "Translation", "summarization": "Summarization",
             "qa": "QA", "math_reasoning": "Math", "rag": "RAG"}
MEAN_ACCEPTED = "#Mean Accepted Tokens"


def applies(result: dict) -> bool:
    """Whether the run's prompts are Spec-Bench's: every category one of its (``COLUMN_OF``)."""
    cats = run_categories(result)
    return bool(cats) and all(c in COLUMN_OF for c in cats)


def _tokens(runs: dict) -> list[int] | None:
    """Tokens each run generated: recorded, or (a results.json from before they were) treespec's accept lengths
    plus the prefill's token; None for a transformers method without them."""
    if runs.get("new_tokens"):
        return list(runs["new_tokens"])
    if runs.get("accept_lengths"):
        return [1 + sum(lengths) for lengths in runs["accept_lengths"]]
    return None


def _timed(runs: dict, tokens: list[int] | None) -> list[tuple[int, float]] | None:
    """(tokens, seconds) of each run: its tokens at its tokens/s."""
    if tokens is None or not runs.get("tokens_per_s"):
        return None
    return [(n, n / s if s and s > 0 else math.nan) for n, s in zip(tokens, runs["tokens_per_s"], strict=False)]


def methods(result: dict, a: dict) -> list[dict]:
    """[{"name", "tree", "runs": [(tokens, seconds)], "vanilla": [(tokens, seconds)], "lengths": per-run accept
    lengths or None}]: every measured configuration (not vanilla), then transformers' methods."""
    vanilla_runs = (a["configs"].get("vanilla") or {}).get("runs") or {}
    vanilla = _timed(vanilla_runs, _tokens(vanilla_runs))
    if vanilla is None:
        return []
    out = []
    for c in a["configs"].values():
        runs = c.get("runs") or {}
        timed = _timed(runs, _tokens(runs))
        if c["config"] != "vanilla" and timed:
            out.append({"name": c["drafter"], "config": c["config"], "tree": c.get("shown", c["tree"]), "runs": timed,
                        "vanilla": vanilla, "lengths": runs.get("accept_lengths"), "peer": False})
    passed = (result.get("peer_pass") or {}).get("vanilla") or {}
    # the peers' own pass's vanilla runs; their tokens are the main pass's (greedy: the same) when not recorded
    peer_vanilla = _timed(passed, passed.get("new_tokens") or _tokens(vanilla_runs)) if passed else None
    for p in result.get("peers") or []:
        runs = p.get("runs") or {}
        timed = _timed(runs, runs.get("new_tokens"))
        if timed and peer_vanilla:
            out.append({"name": p["name"], "config": p["name"], "tree": DASH, "runs": timed, "vanilla": peer_vanilla,
                        "lengths": runs.get("accept_lengths") or None, "peer": True})
    return out


def speedup(m: dict, keep, order: list[int], boot: dict) -> Estimate:
    """Spec-Bench's speedup of method ``m`` over the runs ``keep(i)`` selects, with an interval over prompts."""
    groups: dict[int, list] = {}
    for i, ((n, t), (vn, vt)) in enumerate(zip(m["runs"], m["vanilla"], strict=False)):
        if i < len(order) and keep(i):
            groups.setdefault(order[i], []).append((n, t, vn, vt))
    if not groups:
        return Estimate(math.nan)
    return throughput_ratio_interval(list(groups.values()), **boot)


def mean_accepted(m: dict, keep) -> float | None:
    """Tokens per target pass over every pass of the runs ``keep(i)`` selects (None without accept lengths)."""
    lengths = [n for i, run in enumerate(m["lengths"] or []) if keep(i) for n in run]
    return sum(lengths) / len(lengths) if lengths else None


def table(result: dict, a: dict) -> dict | None:
    """{"rows": [{"name", "config", "tree", "peer", "columns": {column: Estimate}, "overall": Estimate,
    "mean_accepted", "mt_bench": {category: Estimate}, "mt_mean_accepted"}], "prompts": {column: runs},
    "mt_bench": [its categories in the run]}, or None when the run is not on Spec-Bench's questions."""
    if not applies(result):
        return None
    cats = run_categories(result)
    order = result["prompt_of_run"][: len(cats)]
    boot = {k: a["bootstrap"][k] for k in ("samples", "level", "seed")}
    point = {**boot, "samples": 0}  # cells without intervals: no resampling
    every = lambda i: i < len(cats)  # noqa: E731
    in_column = lambda col: lambda i: i < len(cats) and COLUMN_OF[cats[i]] == col  # noqa: E731
    in_category = lambda cat: lambda i: i < len(cats) and cats[i] == cat  # noqa: E731
    mt = [c for c in MT_BENCH if c in cats]
    rows, best = [], {}
    for m in methods(result, a):
        row = {"name": m["name"], "config": m["config"], "tree": m["tree"], "peer": m["peer"],
               "columns": {col: speedup(m, in_column(col), order, point) for col in COLUMNS},
               "overall": speedup(m, every, order, boot), "mean_accepted": mean_accepted(m, every),
               "mt_bench": {c: speedup(m, in_category(c), order, point) for c in mt},
               "mt_mean_accepted": mean_accepted(m, in_column(MULTI_TURN))}
        if m["peer"]:
            rows.append(row)
        elif m["name"] not in best or _value(row["overall"]) > _value(best[m["name"]]["overall"]):
            best[m["name"]] = row
    rows = list(best.values()) + rows
    prompts = {col: sum(1 for c in cats if COLUMN_OF[c] == col) for col in COLUMNS}
    return {"rows": rows, "prompts": prompts, "mt_bench": mt,
            "mt_prompts": {c: sum(1 for x in cats if x == c) for c in mt}}


def _value(e: Estimate) -> float:
    return -math.inf if math.isnan(e.value) else e.value


def _cell(e: Estimate) -> str:
    return with_interval(e, suffix="×")


def markdown(result: dict, a: dict) -> list[str]:
    """The "Spec-Bench" section of results.md (nothing when the run is not on Spec-Bench's questions)."""
    t = table(result, a)
    if t is None or not t["rows"]:
        return []
    level = f"{100 * a['bootstrap']['level']:g}%"
    method = lambda r: r["name"] + (f" ({r['tree']})" if not r["peer"] else "")  # noqa: E731
    header = ["method"] + list(COLUMNS) + [MEAN_ACCEPTED, f"Overall ({level} CI)"]
    body = [[method(r)] + [_cell(r["columns"][c]) for c in COLUMNS] + [num(r["mean_accepted"]), _cell(r["overall"])]
            for r in t["rows"]]
    runs = ", ".join(f"{c}: {n}" for c, n in t["prompts"].items())
    lines = ["## Spec-Bench", "", "Speedup over vanilla decoding per Spec-Bench category, computed as Spec-Bench does: "
             "total tokens ÷ total time of the method over a column's runs, ÷ the same of vanilla (greedy: the same "
             "tokens, so vanilla's total time ÷ the method's; the prefill is in the time). #Mean Accepted Tokens: "
             "tokens committed per target pass, bonus included (transformers' methods: per target call, prefill "
             "included). Each drafter's row is its fastest configuration by this overall speedup; transformers' "
             f"methods are measured against their own pass's vanilla runs. Prompt turns per column: {runs}.", ""]
    lines += md_table(header, body)
    if t["mt_bench"]:
        counts = ", ".join(f"{c}: {n}" for c, n in t["mt_prompts"].items())
        lines += ["", "### MT-bench categories (the Multi-turn Conversation column)", ""]
        lines += md_table(["method"] + t["mt_bench"] + [MEAN_ACCEPTED],
                          [[method(r)] + [_cell(r["mt_bench"][c]) for c in t["mt_bench"]] + [num(r["mt_mean_accepted"])]
                           for r in t["rows"]])
        lines += ["", f"Prompt turns (both turns of each question): {counts}."]
    return lines


def csv_rows(result: dict, a: dict) -> list[dict]:
    """specbench.csv: one row per (method, column or MT-bench category, and overall)."""
    t = table(result, a)
    if t is None:
        return []
    out = []
    for r in t["rows"]:
        cells = [*r["columns"].items(), *r["mt_bench"].items(), ("Overall", r["overall"])]
        for column, e in cells:
            out.append({"method": r["name"], "config": r["config"], "column": column, "speedup": e.value,
                        "speedup_lo": e.lo, "speedup_hi": e.hi,
                        "mean_accepted": r["mean_accepted"] if column == "Overall" else None})
    return out
