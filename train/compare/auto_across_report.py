"""The report's section on "auto" across drafters (train/compare/auto_across.py): what each such entry chose, why, its
predicted against its measured speedup, and per category how the choice fared against the category's best
configuration. The choice is one per run (the held-out prompts it is predicted from are pooled), so per category it
is the same; what differs is how it pays there, and the category's predicted speedup (each prompt's own lengths).
"""

from __future__ import annotations

import math

from treespec.train.compare.categories import best_per_category, categories_of, category_estimates
from treespec.train.compare.predictions import predicted_text, ratio
from treespec.train.compare.tables import DASH, md_table, num, with_interval


def across_markdown(result: dict, a: dict) -> list[str]:
    """The "Auto across drafters" section (none without such an entry)."""
    entries = [c for c in a["configs"].values() if c.get("chose")]
    if not entries:
        return []
    lines = ["## Auto across drafters", ""]
    for c in entries:
        chose = c["chose"]
        what = "no speculation (vanilla decoding)" if chose["drafter"] == "vanilla" else \
            f"**{chose['drafter']}, {chose['tree']}** under {chose['rule']}"
        considered = ", ".join(f"{k} {v:.2f}×" for k, v in (c.get("considered") or {}).items())
        lines += [f"`{c['config']}` chose {what}: {chose['why']}"
                  + (f" (each one's best tree, predicted per step: {considered})" if considered else "") + ". "
                  f"Predicted {predicted_text(c)} over whole generations, measured "
                  f"{with_interval(c['speedup_est'], suffix='×')} (pred ÷ meas {num(ratio(c))}).", ""]
        table = category_lines(result, a, c)
        if table:
            lines += table + [""]
    lines += ["Chosen before the first timed run from each listed drafter's predictions (accuracies, chain τ, or "
              "τ per tree from a dry run on the held-out prompts), under each of the run's rules, or none when no "
              "drafter is predicted to beat vanilla. \"best there\": the fastest configuration of the run in that "
              "category, any drafter."]
    return lines


def category_lines(result: dict, a: dict, c: dict) -> list[str]:
    """Per category: the choice, its predicted and measured speedup, the category's best configuration."""
    cats = categories_of(result)
    runs = c.get("runs")
    if not cats or not runs or not runs.get("speedup"):
        return []
    best = best_per_category(result, a) or {}
    predicted = c.get("predicted_by_category") or {}
    rows = []
    for cat in cats:
        measured = category_estimates(result, a, {"speedup": runs["speedup"]}, cat)["speedup"]
        there = [at[cat] for at in best.values() if cat in at]
        top = max(there, key=lambda x: x["speedup"].value) if there else None
        share = measured.value / top["speedup"].value if top and top["speedup"].value > 0 else math.nan
        best_there = f"{top['config'].replace(' | ', ', ')}: {with_interval(top['speedup'], suffix='×')}" if top \
            else DASH
        rows.append([cat, c["shown"], num(predicted.get(cat), suffix="×"), with_interval(measured, suffix="×"),
                     num(predicted.get(cat) / measured.value if predicted.get(cat) and measured.value > 0 else None),
                     best_there, num(share)])
    return md_table(["category", "auto chose", "predicted", "measured", "pred ÷ meas", "best there",
                     "auto ÷ best"], rows)
