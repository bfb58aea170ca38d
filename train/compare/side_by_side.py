"""Two or more comparison runs side by side (``python scripts/compare_trees.py compare=[A,B]``): where their
stamps differ (command, code, versions, device, weights, workload), each drafter's best configuration in
each, and every configuration measured in all of them. Rendered from the runs' results.json files only, so
runs from before a field existed (categories, workloads) compare too: what one of them lacks prints as "–".
"""

from __future__ import annotations

import math
from pathlib import Path

from treespec.train.compare.estimates import analyse
from treespec.train.compare.plots import partial
from treespec.train.compare.results_file import load_result
from treespec.train.compare.stamp import flatten
from treespec.train.compare.tables import DASH, md_table, num, with_interval


def compare_runs(paths: list[str | Path]) -> str:
    """Markdown setting two or more runs side by side: where their stamps differ, each drafter's best, and
    every configuration present in all of them (speedup with interval, and whether the intervals overlap)."""
    if len(paths) < 2:
        raise ValueError(f"compare needs at least two runs, got {len(paths)}")
    runs = []
    for p in paths:
        result, folder = load_result(p)
        runs.append((str(folder), result, analyse(result)))
    tags = [chr(ord("A") + i) for i in range(len(runs))]
    lines = ["# Comparison runs side by side", ""]
    def measured(result) -> str:
        cut = partial(result)
        return "complete" if cut is None else f"**partial: {cut[0]} of {cut[1]} prompt runs**"

    lines += md_table(["run", "folder", "command", "started", "measured", "best configuration"],
                      [[t, f"`{f}`", f"`{r.get('stamp', {}).get('command', DASH)}`", r.get("stamp", {}).get("started",
                        DASH), measured(r), r.get("best", DASH)] for t, (f, r, _) in zip(tags, runs, strict=True)])
    flat = [flatten(r.get("stamp") or {}) for _, r, _ in runs]
    flat = [{**f, **flatten(r.get("settings") or {}, "settings")} for f, (_, r, _) in zip(flat, runs, strict=True)]
    keys = sorted(set().union(*flat))
    differ = [k for k in keys if len({f.get(k, DASH) for f in flat}) > 1 and k != "started"]
    lines += ["", "## Where the stamps differ", ""]
    if differ:
        lines += md_table(["key", *tags], [[k, *(_clip(f.get(k, DASH)) for f in flat)] for k in differ])
    else:
        lines += ["Nothing but the start time: same command, config, code, versions, device, weights and prompts."]
    lines += ["", "## Each drafter's best configuration", ""]
    drafters = list(dict.fromkeys(d for _, _, a in runs for d in a["bests"]))
    header = ["drafter"] + [h for t in tags for h in (f"{t}: best tree", f"{t}: τ", f"{t}: speedup")]
    rows = []
    for d in drafters:
        row = [d]
        for _, _, a in runs:
            c = a["bests"].get(d)
            row += [c["tree"], with_interval(c["tau_est"]), with_interval(c["speedup_est"], suffix="×")] if c \
                else [DASH] * 3
        rows.append(row)
    lines += md_table(header, rows)
    common = [name for name in runs[0][2]["configs"] if all(name in a["configs"] for _, _, a in runs[1:])]
    lines += ["", "## Configurations measured in every run", ""]
    header = ["config"] + [f"{t}: speedup" for t in tags] + [f"{t} ÷ A" for t in tags[1:]] + ["intervals overlap"]
    rows = []
    for name in common:
        ests = [a["configs"][name]["speedup_est"] for _, _, a in runs]
        ratios = [num(e.value / ests[0].value if ests[0].value else math.nan, ".2f") for e in ests[1:]]
        overlap = all(e.overlaps(ests[0]) for e in ests[1:])
        rows.append([name, *(with_interval(e, suffix="×") for e in ests), *ratios, "yes" if overlap else "**no**"])
    lines += md_table(header, rows)
    lines += ["", "Intervals: each run's own bootstrap over its prompts. Non-overlapping intervals on the same "
              "prompts, code and device point to a real change; on different devices or thread counts they "
              "need not."]
    return "\n".join(lines) + "\n"


def _clip(text: str, n: int = 70) -> str:
    text = str(text)
    return text if len(text) <= n else text[: n - 1] + "…"


