"""Where a verification pass's time goes, per drafter: the report's "Time per pass" table.

A drafter's speedup is τ ÷ (the cost of one pass relative to vanilla's); this table opens that cost up for each
drafter's best configuration, as measured in the run's own decoding (treespec.planning.bench.step_parts): the target's
forwards over the tree, the drafter proposing (a draft model's or a head's depths, a model-free index's
retrieval), the drafter updating from the verified pass (Token Recycling's matrix, SuffixDecoding's trie, EAGLE's
accepted features), the walker, and the rest of the engine's host work (masks, the cache's compaction, Python).
The parts sum to the pass's wall time. The prefill (the target's forward over the prompt and the drafter's own
prefill) is no pass's and is left out (a run journaled before it was kept apart has it spread over the passes).
"""

from __future__ import annotations

from treespec.train.compare.tables import DASH, md_table, missing, num

PARTS = ("target", "draft", "update", "walk", "other")


def table(a: dict) -> tuple[list[str], list[list]]:
    header = ["drafter", "tree", "τ", "ms per pass", "target", "drafting", "index / state update", "walker",
              "other host work", "ms per token"]
    rows = []
    best = {"vanilla": a["configs"]["vanilla"]} if "vanilla" in a["configs"] else {}
    for drafter, c in {**best, **a["bests"]}.items():
        parts = c.get("step_ms")
        if not parts:
            continue
        total = sum(parts.values())
        tau = 1.0 if drafter == "vanilla" else c.get("tau")
        shares = [f"{num(parts[p], '.2f')} ({100 * parts[p] / total:.0f}%)" for p in PARTS]
        rows.append([drafter, DASH if drafter == "vanilla" else c["shown"], num(tau), num(total, ".2f"), *shares,
                     DASH if missing(tau) else num(total / tau, ".2f")])
    return header, rows


def markdown(a: dict) -> list[str]:
    """The section, or nothing for a run without the split (peers only, or results.json from before it)."""
    header, rows = table(a)
    if not rows:
        return []
    note = ("Milliseconds per verification pass by part, each drafter's best configuration (share of the pass in "
            "brackets), the prefill left out: the target's forwards, the drafter proposing its "
            "tree (retrieval, draft depths), the drafter updating from the verified pass (an index's update, "
            "accepted features), the walker, and the engine's other host work. \"ms per token\": the pass ÷ τ.")
    return ["## Time per pass", ""] + md_table(header, rows) + ["", note]
